"""Ascend NPU backend: ``torch_npu.npu_fusion_attention`` and its grad op.

Follows the operator contract of torch_npu 2.13 (``docs/npu-contract.md``; each of our cases
and the call it becomes: its section "How our backend calls ``npu_fusion_attention``"); the
rules, one by one, are :class:`NpuBackend`'s:

* layouts without copies: ``"bshd"`` is ``"BSND"``, Megatron's ``[s, b, h, d]`` its free
  ``[s, b, h*d]`` view ``"SBH"``, packed ``[t, h, d]`` ``"TND"``;
* ``head_num`` is the number of QUERY heads; K/V keep their own head count (native GQA);
* causal and windows become sparse modes (:class:`~mcore_flash.npu_contract.SparseMode`)
  with the cached compressed 2048x2048 mask, never an ``S x S`` one;
* backward gets the kernel's own ``softmax_max`` and ``softmax_sum`` ``[b, n, s, 8]`` back;
  ``lse = max + log(sum)`` only for callers;
* ``softcap``, ``alibi_slopes`` and ``deterministic=True`` raise
  (:meth:`NpuBackend.check_params`); packs TND cannot compute run the reference kernel.

``torch_npu`` is imported lazily, on first use: importing it without CANN breaks torch.
This path has NOT run on Ascend hardware; it is tested against contract doubles of the
ops (``mcore_flash.emulation``), also under the emulated npu device.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch

from mcore_flash.npu_contract import COMPRESSED_MASK_SIZE, MAX_TOCKENS, SparseMode

from .base import AttentionBackend, AttentionParams, SoftmaxStats, Tensor, band_mask, band_rows
from .reference import ReferenceBackend

MAX_HEAD_DIM = 768
MAX_HEADS = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STATS_WIDTH = 8  # softmax_max / softmax_sum carry 8 identical trailing copies
_OP_LAYOUTS = {"bshd": "BSND", "sbhd": "SBH"}


def _torch_npu():
    return importlib.import_module("torch_npu")


class NpuBackend(AttentionBackend):
    """``npu_fusion_attention`` (FlashAttention on Ascend).

    How it calls the op (torch_npu 2.13's contract, ``docs/npu-contract.md``):

    * layouts without copies: flash-attn's ``[b, s, h, d]`` is ``"BSND"``; Megatron's
      ``[s, b, h, d]`` (``layout="sbhd"``) is passed as its free ``[s, b, h*d]`` view,
      ``"SBH"``, as MindSpeed does; packed ``[t, h, d]`` is ``"TND"`` with cumulative
      ``actual_seq_qlen``/``actual_seq_kvlen`` lists without the 0;
    * ``head_num`` is the number of QUERY heads; K/V keep their own head count (native GQA);
    * ``keep_prob = 1 - dropout_p``; dropout is replayed from the op's ``seed, offset, numels``;
    * sparse modes are named by :class:`~mcore_flash.npu_contract.SparseMode`, an ``IntEnum``
      (the op receives the int);
    * causal -> ``RIGHT_DOWN_CAUSAL`` (3, bottom-right, our convention) with the cached
      COMPRESSED 2048x2048 upper-triangular mask, never an ``S x S`` one;
    * a sliding window (our band ``(lo, hi)``) -> ``BAND`` (4, origin bottom-right) with the
      compressed mask, ``pre_tockens = -lo`` and ``next_tockens = hi`` (unbounded
      sides ``2147483647``), dense and TND alike;
    * an explicit bool mask (True = masked out, the op's polarity too) -> ``ALL_MASK`` (1, the
      mask as given, tockens ignored), combined with the causal rule or the window when both
      are asked for; ``inner_precise=2`` when a row sees no key;
    * ``softcap``, ``alibi_slopes`` and ``deterministic=True`` raise (:meth:`check_params`
      says why);
    * backward gets the kernel's own ``softmax_max`` and ``softmax_sum`` ``[b, n, s, 8]`` back
      (what torch_npu's autograd passes; context parallelism passes them merged as
      (max, sum) pairs, as MindSpeed does); ``lse = max + log(sum)`` only for callers;
    * TND statistics are shaped ``[t, n, 8]`` but hold their data in ``[n, t, 8]`` order (the
      default ``softmax_layout=""``): they are read through a free ``[n, t, 8]`` view;
    * in TND ``inner_precise`` does nothing, so packs the kernel cannot compute - a sequence
      with queries but no keys, or causal with more queries than keys - run the reference
      kernel (logged once); Megatron's packed self-attention never produces them.
    """

    name = "npu"
    layouts = ("bshd", "sbhd")

    def __init__(self):
        self._compressed_masks: dict[torch.device, Tensor] = {}
        self.fallback = ReferenceBackend()

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
            raise TypeError(
                f"npu backend supports float16, bfloat16 and float32, got q.dtype={q.dtype}"
            )
        if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(
                f"npu backend: head_dim {q.shape[-1]} is outside npu_fusion_attention's 1..{MAX_HEAD_DIM}"
            )
        if not 1 <= q.shape[-2] <= MAX_HEADS:
            raise ValueError(
                f"npu backend: {q.shape[-2]} query heads per rank is outside npu_fusion_attention's "
                f"1..{MAX_HEADS}; raise --tensor-model-parallel-size"
            )

    def check_params(self, params):
        """Refuse ``softcap``, ``alibi_slopes`` and ``deterministic=True`` by name.

        The op has no score cap. ALiBi would need its ``pse`` input, which
        ``npu_fusion_attention`` takes only as a materialised ``[B|1, N, Sq, Skv]`` bias in the
        query's dtype (O(s^2) memory, again for the grad op, and not in TND), while
        ``npu_fusion_attention_v2``'s ``pse_type=2`` generates the bias from slopes by a formula
        the torch_npu 2.13 and CANN docs do not state (and only for Sq == Skv). Its docs name no
        deterministic switch.
        """
        unsupported = [
            name
            for name, on in (
                ("softcap", params.softcap > 0),
                ("alibi_slopes", params.alibi_slopes is not None),
                ("deterministic=True", params.deterministic),
            )
            if on
        ]
        if unsupported:
            raise ValueError(
                f"npu backend: {', '.join(unsupported)} is not supported by npu_fusion_attention as this backend calls "
                "it; drop the argument, or run backend='reference' (slow) to check results"
            )

    # ---- dense (BSND / SBH) --------------------------------------------------------------

    def forward(self, q, k, v, params):
        mask, sparse_mode = self._dense_mask_and_mode(params, q, k)
        outputs = _torch_npu().npu_fusion_attention(
            *_op_inputs(params.layout, q, k, v),
            q.shape[-2],
            _OP_LAYOUTS[params.layout],
            **self._common(params, mask, sparse_mode, self._empty_rows(params, mask, q, k)),
        )
        out = _from_op(outputs[0], params.layout, q.shape[-2])
        return out, SoftmaxStats(outputs[1], outputs[2]), _rng_state(outputs)

    def backward(self, dout, q, k, v, out, stats, rng_state, params):
        mask, sparse_mode = self._dense_mask_and_mode(params, q, k)
        query, key, value, dy, attention_in = _op_inputs(params.layout, q, k, v, dout, out)
        grads = _torch_npu().npu_fusion_attention_grad(
            query,
            key,
            value,
            dy,
            q.shape[-2],
            _OP_LAYOUTS[params.layout],
            softmax_max=stats.row_max,
            softmax_sum=stats.row_sum,
            attention_in=attention_in,
            **self._common(
                params, mask, sparse_mode, self._empty_rows(params, mask, q, k), grad=True
            ),
            **_replay_kwargs(rng_state),
        )
        heads = (q.shape[-2], k.shape[-2], v.shape[-2])
        return tuple(_from_op(grad, params.layout, n) for grad, n in zip(grads[:3], heads))

    # ---- packed (TND) --------------------------------------------------------------------

    def varlen_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, params):
        if self._varlen_needs_fallback(cu_seqlens_q, cu_seqlens_k, params):
            out, stats, rng_state = self.fallback.varlen_forward(
                q, k, v, cu_seqlens_q, cu_seqlens_k, params
            )
            return out, _kernel_stats(stats), rng_state
        mask, sparse_mode = self._mask_and_mode(params, q.device)
        outputs = _torch_npu().npu_fusion_attention(
            q,
            k,
            v,
            q.shape[1],
            "TND",
            actual_seq_qlen=cu_seqlens_q[1:],
            actual_seq_kvlen=cu_seqlens_k[1:],
            **self._common(params, mask, sparse_mode, False),
        )
        t, n = q.shape[0], q.shape[1]  # [t, n, 8] holding [n, t, 8] data: a free view
        stats = SoftmaxStats(*(x.view(n, t, STATS_WIDTH).unsqueeze(0) for x in outputs[1:3]))
        return outputs[0], stats, _rng_state(outputs)

    def varlen_backward(
        self, dout, q, k, v, out, stats, rng_state, cu_seqlens_q, cu_seqlens_k, params
    ):
        if self._varlen_needs_fallback(cu_seqlens_q, cu_seqlens_k, params):
            return self.fallback.varlen_backward(
                dout, q, k, v, out, stats, rng_state, cu_seqlens_q, cu_seqlens_k, params
            )
        mask, sparse_mode = self._mask_and_mode(params, q.device)
        t, n = q.shape[0], q.shape[1]
        softmax_max, softmax_sum = (x[0].view(t, n, STATS_WIDTH) for x in stats.tensors())
        grads = _torch_npu().npu_fusion_attention_grad(
            q,
            k,
            v,
            dout,
            n,
            "TND",
            softmax_max=softmax_max,
            softmax_sum=softmax_sum,
            attention_in=out,
            actual_seq_qlen=cu_seqlens_q[1:],
            actual_seq_kvlen=cu_seqlens_k[1:],
            **self._common(params, mask, sparse_mode, False, grad=True),
            **_replay_kwargs(rng_state),
        )
        return grads[0], grads[1], grads[2]

    def _varlen_needs_fallback(
        self, cu_seqlens_q: list[int], cu_seqlens_k: list[int], params
    ) -> bool:
        q_lens = [b - a for a, b in zip(cu_seqlens_q[:-1], cu_seqlens_q[1:])]
        k_lens = [b - a for a, b in zip(cu_seqlens_k[:-1], cu_seqlens_k[1:])]
        reason = None
        if any(nq > 0 and nk == 0 for nq, nk in zip(q_lens, k_lens)):
            reason = "a packed sequence with queries but no keys (TND has no inner_precise)"
        elif params.causal and any(nq > nk for nq, nk in zip(q_lens, k_lens)):
            reason = "causal packed sequences with more queries than keys (TND sparse_mode 3 needs Sq <= Skv)"
        elif params.window is not None and any(
            _band_has_empty_rows(params, nq, nk) for nq, nk in zip(q_lens, k_lens)
        ):
            reason = (
                "a window that leaves a packed query row without keys (TND has no inner_precise)"
            )
        return self._falls_back(reason)

    # ---- shared arguments ----------------------------------------------------------------

    @staticmethod
    def _common(
        params: AttentionParams,
        mask: Optional[Tensor],
        sparse_mode: SparseMode,
        empty_rows: bool,
        grad: bool = False,
    ) -> dict:
        """Keyword arguments shared by forward and grad. ``empty_rows``: some query row sees
        no key, which needs ``inner_precise=2`` (the op only turns it on by itself for
        sparse_mode=3 with Sq > Skv)."""
        scale_key = "scale_value" if grad else "scale"
        pre_tockens = next_tockens = MAX_TOCKENS
        if sparse_mode == SparseMode.BAND:
            lo, hi = params.window
            pre_tockens = MAX_TOCKENS if lo is None else -lo
            next_tockens = MAX_TOCKENS if hi is None else hi
        return {
            "pse": None,
            "padding_mask": None,
            "atten_mask": mask,
            scale_key: params.softmax_scale,
            "keep_prob": 1.0 - params.dropout_p,
            "pre_tockens": pre_tockens,
            "next_tockens": next_tockens,
            "inner_precise": 2 if empty_rows else 0,
            "sparse_mode": sparse_mode,
        }

    def _dense_mask_and_mode(
        self, params: AttentionParams, q: Tensor, k: Tensor
    ) -> tuple[Optional[Tensor], SparseMode]:
        seq, batch = params.layout.index("s"), params.layout.index("b")
        if params.attn_mask is not None:
            mask = _dense_mask(params, q.shape[batch], q.shape[2], q.shape[seq], k.shape[seq])
            return mask, SparseMode.ALL_MASK
        return self._mask_and_mode(params, q.device)

    def _mask_and_mode(
        self, params: AttentionParams, device: torch.device
    ) -> tuple[Optional[Tensor], SparseMode]:
        """The compressed mask with ``RIGHT_DOWN_CAUSAL`` (causal) or ``BAND`` (window), or no
        mask (full attention, ``DEFAULT_MASK``)."""
        if params.window is not None:
            return self._compressed_causal_mask(device), SparseMode.BAND
        if params.causal:
            return self._compressed_causal_mask(device), SparseMode.RIGHT_DOWN_CAUSAL
        return None, SparseMode.DEFAULT_MASK

    @staticmethod
    def _empty_rows(params: AttentionParams, mask: Optional[Tensor], q: Tensor, k: Tensor) -> bool:
        """Whether some query row sees no key (an explicit mask's, or the band's)."""
        if mask is not None and mask.dim() == 4:
            return _has_empty_rows(mask)
        seq = params.layout.index("s")
        return params.window is not None and _band_has_empty_rows(
            params, q.shape[seq], k.shape[seq]
        )

    def _compressed_causal_mask(self, device: torch.device) -> Tensor:
        if device not in self._compressed_masks:
            ones = torch.ones(
                COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device
            )
            self._compressed_masks[device] = torch.triu(ones, diagonal=1)
        return self._compressed_masks[device]


def _op_inputs(layout: str, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Our ``[b, s, n, d]`` (BSND, as is) or ``[s, b, n, d]`` (SBH: ``[s, b, n*d]``, a view
    when contiguous) tensors in the op's layout."""
    if layout == "bshd":
        return tensors
    return tuple(x.flatten(2) for x in tensors)


def _from_op(x: Tensor, layout: str, heads: int) -> Tensor:
    """An op output back in our layout (SBH ``[s, b, n*d]`` -> ``[s, b, n, d]``, a view)."""
    return x if layout == "bshd" else x.unflatten(2, (heads, -1))


def _dense_mask(params: AttentionParams, b: int, hq: int, sq: int, sk: int) -> Tensor:
    """Our ``[b|1, hq|1, sq, sk]`` mask, with the causal rule or window folded in, as one of
    the op's shapes (BNSS, B1SS, 11SS)."""
    mask = params.attn_mask
    lo, hi = params.band()
    if (lo, hi) != (None, None):
        mask = mask | band_mask(lo, hi, (0, sq), (0, sk), sq, sk, mask.device)
    if mask.shape[0] == 1 and mask.shape[1] == hq and b > 1:  # 1NSS is not an accepted shape
        mask = mask.expand(b, hq, sq, sk)
    return mask.contiguous()


def _band_has_empty_rows(params: AttentionParams, sq: int, sk: int) -> bool:
    """Whether the window leaves a query row of ``sq`` against ``sk`` keys without keys (the
    band moves monotonically, so the first and the last row decide)."""
    lo, hi = params.band()
    return sq > 0 and any(
        k0 == k1
        for k0, k1 in (band_rows(lo, hi, 0, 1, sq, sk), band_rows(lo, hi, sq - 1, sq, sq, sk))
    )


def _has_empty_rows(mask: Optional[Tensor]) -> bool:
    """Whether an explicit mask hides every key from some query row."""
    return mask is not None and bool(mask.all(dim=-1).any())


def _rng_state(outputs: tuple) -> tuple[Any, Any, Any]:
    """``(seed, offset, numels)`` from the forward op's outputs 4..6."""
    return outputs[4], outputs[5], outputs[6]


def _replay_kwargs(rng_state: tuple[Any, Any, Any]) -> dict:
    seed, offset, numels = rng_state
    return {"seed": seed, "offset": offset, "numels": numels}


def _kernel_stats(stats: SoftmaxStats) -> SoftmaxStats:
    """A logsumexp ``[b, h, s]`` in the kernel's own form, ``softmax_max = lse`` and
    ``softmax_sum = 1`` (0 on rows that see no key), ``[b, h, s, 8]``: so a block the
    reference kernel ran merges with the kernel's blocks under context parallelism."""
    lse = stats.lse()
    row_sum = torch.where(torch.isneginf(lse), 0.0, 1.0)
    return SoftmaxStats(
        *(x.unsqueeze(-1).expand(*x.shape, STATS_WIDTH).contiguous() for x in (lse, row_sum))
    )
