"""``FlashDotProductAttention``: a drop-in ``core_attention`` for megatron-core.

Replaces Megatron's ``DotProductAttention`` (which materialises ``[b, np, sq, sk]``
scores) with :func:`mcore_flash.ops.flash_attn_func`: only ``q, k, v, out`` and the
float32 logsumexp are kept for backward.

Megatron conventions kept exactly:

* inputs ``[sq, b, np, hn]`` (query) and ``[sk, b, ng, hn]`` (key/value, GQA not
  expanded), output ``[sq, b, np * hn]``; packed (THD) inputs ``[t, np, hn]``, output
  ``[t, np * hn]``. ``np``/``ng`` are per tensor-parallel rank.
* ``attention_mask`` is bool with True = masked out, broadcastable to ``[b, 1, sq, sk]``.
  A mask equal to the causal one takes the fused causal path (no mask tensor reaches the
  kernel); ``attention_mask=None`` follows ``attn_mask_type``; any other mask is honoured
  as given.
* ``softmax_scale`` defaults to ``1/sqrt(kv_channels)``. ``apply_query_key_layer_scaling``
  divides the scores by ``layer_number`` and Megatron's softmax multiplies them back in
  fp32, so it does not change the result; the fused kernel always accumulates in fp32, so
  it is accepted and has no effect.
* attention dropout is drawn inside ``get_cuda_rng_tracker().fork()`` when sequence
  parallel is off (as Megatron does): different per TP rank, replayed by recompute.

Differences from the stock module: causal is aligned bottom-right when ``sq != sk``
(flash-attn >= 2.1; identical when ``sq == sk``), and a query row whose keys are all
masked gives 0 (Megatron's -10000 fill gives a uniform average).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_flash.ops import backend_names, flash_attn_func, flash_attn_varlen_func

Tensor = torch.Tensor

_CAUSAL_TYPES = tuple(t for t in (AttnMaskType.causal, getattr(AttnMaskType, "causal_bottom_right", None)) if t)


class FlashDotProductAttention(MegatronModule):
    """Fused-kernel core attention with Megatron's ``DotProductAttention`` interface."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        backend: Optional[str] = None,
        **kwargs,
    ):
        super().__init__(config=config)
        tp_size = _tensor_parallel_size(pg_collection, kwargs.get("model_comm_pgs"))
        heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
        _check_heads(heads, groups, tp_size)
        if config.context_parallel_size > 1:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size}: FlashDotProductAttention does not "
                "implement context parallelism yet; use --context-parallel-size 1"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} is not supported by the fused kernel; use 'vanilla'")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("window_size (sliding-window attention) is not supported by FlashDotProductAttention")
        if backend is not None and backend not in backend_names():
            raise ValueError(f"attention backend {backend!r} is unknown; choose one of {backend_names()} or None")

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.backend = backend
        self.num_attention_heads_per_partition = heads // tp_size
        self.num_query_groups_per_partition = max(1, groups // tp_size)
        self.hidden_size_per_attention_head = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
        **kwargs,
    ) -> Tensor:
        """``[sq, b, np, hn]`` (or packed ``[t, np, hn]``) -> ``[sq, b, np*hn]`` (``[t, np*hn]``)."""
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by FlashDotProductAttention")
        causal_type = (attn_mask_type or self.attn_mask_type) in _CAUSAL_TYPES
        dropout_p = self.dropout_p if self.training else 0.0
        with self._dropout_rng(dropout_p):
            if packed_seq_params is not None:
                return self._packed_forward(query, key, value, attention_mask, causal_type, dropout_p, packed_seq_params)
            return self._dense_forward(query, key, value, attention_mask, causal_type, dropout_p)

    def _dense_forward(self, query, key, value, attention_mask, causal_type, dropout_p) -> Tensor:
        sq, b, np_, hn = query.shape
        causal, mask = _resolve_mask(attention_mask, causal_type, b, np_, sq, key.shape[0])
        # q, k, v are views into Megatron's fused QKV projection output; contiguous copies
        # let the kernel keep [s, b, n, d] each instead of that whole buffer for backward.
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        out = flash_attn_func(
            query.transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            dropout_p=dropout_p,
            softmax_scale=self.softmax_scale,
            causal=causal,
            backend=self.backend,
            attn_mask=mask,
        )  # [b, sq, np, hn]
        return out.transpose(0, 1).reshape(sq, b, np_ * hn)

    def _packed_forward(self, query, key, value, attention_mask, causal_type, dropout_p, params) -> Tensor:
        if getattr(params, "qkv_format", "thd") != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={params.qkv_format!r}: only 'thd' is supported")
        if attention_mask is not None:
            raise ValueError("packed sequences (THD) take no attention_mask: boundaries come from cu_seqlens")
        for name in ("q", "kv"):
            padded = getattr(params, f"cu_seqlens_{name}_padded", None)
            actual = getattr(params, f"cu_seqlens_{name}")
            if padded is not None and not torch.equal(padded.cpu(), actual.cpu()):
                raise ValueError(f"cu_seqlens_{name}_padded != cu_seqlens_{name}: padded packed sequences are not supported")
        out = flash_attn_varlen_func(
            query,
            key,
            value,
            params.cu_seqlens_q,
            params.cu_seqlens_kv,
            int(params.max_seqlen_q),
            int(params.max_seqlen_kv),
            dropout_p=dropout_p,
            softmax_scale=self.softmax_scale,
            causal=causal_type,
            backend=self.backend,
        )  # [t, np, hn]
        return out.reshape(out.shape[0], -1)

    def _dropout_rng(self, dropout_p: float):
        """Megatron's RNG scope for attention dropout (tracker fork unless sequence parallel)."""
        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()


def _tensor_parallel_size(pg_collection, model_comm_pgs) -> int:
    """TP size from the process-group collection (0.15+), model_comm_pgs (0.13-0.14) or mpu."""
    for groups in (pg_collection, model_comm_pgs):
        tp_group = getattr(groups, "tp", None)
        if tp_group is not None:
            return tp_group.size()
    return parallel_state.get_tensor_model_parallel_world_size()


def _check_heads(heads: int, groups: int, tp_size: int) -> None:
    if heads % tp_size != 0:
        raise ValueError(
            f"num_attention_heads ({heads}) must be divisible by tensor_model_parallel_size ({tp_size}); "
            "change --num-attention-heads or --tensor-model-parallel-size"
        )
    if heads % groups != 0:
        raise ValueError(
            f"num_query_groups ({groups}) must divide num_attention_heads ({heads}); change --num-query-groups"
        )
    if groups >= tp_size and groups % tp_size != 0:
        raise ValueError(
            f"num_query_groups ({groups}) must be divisible by tensor_model_parallel_size ({tp_size}) "
            "(or smaller than it, then key/value heads are replicated); change --num-query-groups"
        )


def _resolve_mask(
    mask: Optional[Tensor], causal_type: bool, b: int, heads: int, sq: int, sk: int
) -> tuple[bool, Optional[Tensor]]:
    """``(causal, mask for the kernel)`` from Megatron's mask and mask type.

    No mask -> the mask type decides. A mask equal to the causal mask -> fused causal with
    no mask tensor (checked exactly; the check is linear in the mask's size, which the
    caller already paid for). Anything else is passed on as ``[b|1, np|1, sq, sk]``.
    """
    if mask is None:
        return causal_type, None
    if mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be bool (True = masked out), got {mask.dtype}")
    if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, heads) or mask.shape[2] not in (1, sq) or mask.shape[3] != sk:
        raise ValueError(
            f"attention_mask shape {tuple(mask.shape)} is not supported: use [b|1, 1, sq|1, sk] = "
            f"[{b}|1, 1, {sq}|1, {sk}] (True = masked out)"
        )
    mask = mask.expand(mask.shape[0], mask.shape[1], sq, sk)
    if sq == sk and _is_causal(mask):
        return True, None
    return False, mask


def _is_causal(mask: Tensor) -> bool:
    """Whether every ``[sq, sk]`` slice of ``mask`` is the upper-triangular causal mask."""
    sq, sk = mask.shape[-2:]
    if not (mask[..., 0, -1].all() and not mask[..., -1, :].any()):  # cheap rejection first
        return False
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    return bool((mask == causal).all())
