"""Ascend NPU backend: ``torch_npu.npu_fusion_attention`` and its grad op.

Follows the operator contract in ``shared/reference/npu-ops.md`` (torch_npu op-plugin):

* dense inputs use ``input_layout="BSND"`` (our ``[b, s, h, d]`` as is), packed inputs
  ``"TND"`` with cumulative ``actual_seq_qlen``/``actual_seq_kvlen`` lists without the 0;
* ``head_num`` is the number of QUERY heads; K/V keep their own head count (native GQA);
* ``keep_prob = 1 - dropout_p``; dropout is replayed from the op's ``seed, offset, numels``;
* causal -> ``sparse_mode=3`` (bottom-right, our convention) with the cached COMPRESSED
  2048x2048 upper-triangular mask, never an ``S x S`` one;
* an explicit bool mask (True = masked out, the op's polarity too) -> ``sparse_mode=1``
  (full mask, tockens ignored), combined with the causal rule when both are asked for;
* ``lse = softmax_max[..., 0] + log(softmax_sum[..., 0])``; backward gets the statistics
  back as ``softmax_max = lse, softmax_sum = 1`` (exp(s - lse) is the same probability),
  which is also how context parallelism feeds it merged statistics.

``torch_npu`` is imported lazily, on first use: importing it without CANN breaks torch.
This path has NOT run on Ascend hardware; it is tested against a pure-PyTorch double of
the documented contract (tests/npu_double.py).
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch

from .base import AttentionBackend, AttentionParams, Tensor

MAX_TOCKENS = 2147483647
COMPRESSED_MASK_SIZE = 2048
SPARSE_FULL_MASK = 1
SPARSE_CAUSAL_BOTTOM_RIGHT = 3
MAX_HEAD_DIM = 768
MAX_HEADS = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STATS_WIDTH = 8  # softmax_max / softmax_sum carry 8 identical trailing copies


def _torch_npu():
    return importlib.import_module("torch_npu")


class NpuBackend(AttentionBackend):
    """``npu_fusion_attention`` (FlashAttention on Ascend)."""

    name = "npu"

    def __init__(self):
        self._compressed_masks: dict[torch.device, Tensor] = {}

    def unavailable_reason(self) -> str:
        try:
            _torch_npu()
        except ImportError:
            return (
                "torch_npu is not installed. Install Ascend CANN first, then "
                "`pip install 'mcore-flash[npu]'` (a torch_npu build matching your torch)"
            )
        return ""

    def check_inputs(self, q, k, v, params):
        if q.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"npu backend supports float16, bfloat16 and float32, got q.dtype={q.dtype}")
        if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(
                f"npu backend: head_dim {q.shape[-1]} is outside npu_fusion_attention's 1..{MAX_HEAD_DIM}"
            )
        if not 1 <= q.shape[-2] <= MAX_HEADS:
            raise ValueError(
                f"npu backend: {q.shape[-2]} query heads per rank is outside npu_fusion_attention's "
                f"1..{MAX_HEADS}; raise --tensor-model-parallel-size"
            )

    # ---- dense (BSND) --------------------------------------------------------------------

    def forward(self, q, k, v, params):
        mask, sparse_mode = self._mask_and_mode(params, q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.device)
        outputs = _torch_npu().npu_fusion_attention(
            q, k, v, q.shape[2], "BSND", **self._common(params, mask, sparse_mode, _has_empty_rows(mask))
        )
        out, softmax_max, softmax_sum = outputs[0], outputs[1], outputs[2]
        return out, _lse_from_stats(softmax_max, softmax_sum), _rng_state(outputs)

    def backward(self, dout, q, k, v, out, lse, rng_state, params):
        mask, sparse_mode = self._mask_and_mode(params, q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.device)
        softmax_max, softmax_sum = _stats_from_lse(lse)
        grads = _torch_npu().npu_fusion_attention_grad(
            q, k, v, dout, q.shape[2], "BSND",
            softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out,
            **self._common(params, mask, sparse_mode, _has_empty_rows(mask), grad=True),
            **_replay_kwargs(rng_state),
        )  # fmt: skip
        return grads[0], grads[1], grads[2]

    # ---- packed (TND) --------------------------------------------------------------------

    def varlen_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, params):
        mask, sparse_mode = self._mask_and_mode(params, 1, q.shape[1], None, None, q.device)
        outputs = _torch_npu().npu_fusion_attention(
            q, k, v, q.shape[1], "TND",
            actual_seq_qlen=cu_seqlens_q[1:], actual_seq_kvlen=cu_seqlens_k[1:],
            **self._common(params, mask, sparse_mode, _has_keyless_sequence(cu_seqlens_q, cu_seqlens_k)),
        )  # fmt: skip
        lse = _lse_from_stats(outputs[1], outputs[2])  # [T, N]
        return outputs[0], lse.transpose(0, 1).contiguous(), _rng_state(outputs)

    def varlen_backward(self, dout, q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, params):
        mask, sparse_mode = self._mask_and_mode(params, 1, q.shape[1], None, None, q.device)
        softmax_max, softmax_sum = _stats_from_lse(lse.transpose(0, 1))
        grads = _torch_npu().npu_fusion_attention_grad(
            q, k, v, dout, q.shape[1], "TND",
            softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out,
            actual_seq_qlen=cu_seqlens_q[1:], actual_seq_kvlen=cu_seqlens_k[1:],
            **self._common(params, mask, sparse_mode, _has_keyless_sequence(cu_seqlens_q, cu_seqlens_k), grad=True),
            **_replay_kwargs(rng_state),
        )  # fmt: skip
        return grads[0], grads[1], grads[2]

    # ---- shared arguments ----------------------------------------------------------------

    @staticmethod
    def _common(
        params: AttentionParams, mask: Optional[Tensor], sparse_mode: int, empty_rows: bool, grad: bool = False
    ) -> dict:
        """Keyword arguments shared by forward and grad. ``empty_rows``: some query row sees
        no key, which needs ``inner_precise=2`` (the op only turns it on by itself for
        sparse_mode=3 with Sq > Skv)."""
        scale_key = "scale_value" if grad else "scale"
        return {
            "pse": None,
            "padding_mask": None,
            "atten_mask": mask,
            scale_key: params.softmax_scale,
            "keep_prob": 1.0 - params.dropout_p,
            "pre_tockens": MAX_TOCKENS,
            "next_tockens": MAX_TOCKENS,
            "inner_precise": 2 if empty_rows else 0,
            "sparse_mode": sparse_mode,
        }

    def _mask_and_mode(self, params, b, hq, sq, sk, device) -> tuple[Optional[Tensor], int]:
        """The ``atten_mask`` and ``sparse_mode`` for these params (packed: sq = sk = None)."""
        if params.attn_mask is not None:
            return _dense_mask(params.attn_mask, params.causal, b, hq, sq, sk), SPARSE_FULL_MASK
        if params.causal:
            return self._compressed_causal_mask(device), SPARSE_CAUSAL_BOTTOM_RIGHT
        return None, 0  # no mask: the op computes full attention

    def _compressed_causal_mask(self, device: torch.device) -> Tensor:
        if device not in self._compressed_masks:
            ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device)
            self._compressed_masks[device] = torch.triu(ones, diagonal=1)
        return self._compressed_masks[device]


def _dense_mask(mask: Tensor, causal: bool, b: int, hq: int, sq: int, sk: int) -> Tensor:
    """Our ``[b|1, hq|1, sq, sk]`` mask as one of the op's shapes (BNSS, B1SS, 11SS)."""
    if causal:
        rows = torch.arange(sq, device=mask.device).unsqueeze(-1)
        mask = mask | (torch.arange(sk, device=mask.device) > rows + (sk - sq))
    if mask.shape[0] == 1 and mask.shape[1] == hq and b > 1:  # 1NSS is not an accepted shape
        mask = mask.expand(b, hq, sq, sk)
    return mask.contiguous()


def _has_empty_rows(mask: Optional[Tensor]) -> bool:
    """Whether an explicit mask hides every key from some query row."""
    return mask is not None and bool(mask.all(dim=-1).any())


def _has_keyless_sequence(cu_seqlens_q: list[int], cu_seqlens_k: list[int]) -> bool:
    """Whether a packed sequence has queries but no keys."""
    q_lens = [b - a for a, b in zip(cu_seqlens_q[:-1], cu_seqlens_q[1:])]
    k_lens = [b - a for a, b in zip(cu_seqlens_k[:-1], cu_seqlens_k[1:])]
    return any(nq > 0 and nk == 0 for nq, nk in zip(q_lens, k_lens))


def _lse_from_stats(softmax_max: Tensor, softmax_sum: Tensor) -> Tensor:
    """``[..., 8]`` statistics -> logsumexp ``[...]`` float32; -inf where nothing was visible."""
    row_max, row_sum = softmax_max[..., 0].float(), softmax_sum[..., 0].float()
    return torch.where(row_sum > 0, row_max + torch.log(row_sum), float("-inf"))


def _stats_from_lse(lse: Tensor) -> tuple[Tensor, Tensor]:
    """Statistics the grad op accepts for a given logsumexp (empty rows: max = +inf -> p = 0)."""
    row_max = torch.where(torch.isneginf(lse), float("inf"), lse).float()
    softmax_max = row_max.unsqueeze(-1).expand(*row_max.shape, STATS_WIDTH).contiguous()
    return softmax_max, torch.ones_like(softmax_max)


def _rng_state(outputs: tuple) -> tuple[Any, Any, Any]:
    """``(seed, offset, numels)`` from the forward op's outputs 4..6."""
    return outputs[4], outputs[5], outputs[6]


def _replay_kwargs(rng_state: tuple[Any, Any, Any]) -> dict:
    seed, offset, numels = rng_state
    return {"seed": seed, "offset": offset, "numels": numels}
