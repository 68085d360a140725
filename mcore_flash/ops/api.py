"""The flash-attn-style public API: :func:`flash_attn_func` and :func:`flash_attn_varlen_func`.

Both are differentiable in q, k, v. Forward saves exactly ``q, k, v, out`` and the float32
softmax statistics for backward (the logsumexp; on NPU the kernel's row max and row sum)
-- never a ``[sq, sk]`` matrix -- and backward calls the backend's kernel, which
recomputes the probabilities.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import checks
from .backends import AttentionBackend, AttentionParams, get_backend
from .backends.base import LAYOUTS, SoftmaxStats, backward_kernel, forward_kernel

Tensor = torch.Tensor


class _FlashAttnFunction(torch.autograd.Function):
    """Autograd around a backend's dense forward/backward kernels."""

    @staticmethod
    def forward(ctx, q, k, v, backend: AttentionBackend, params: AttentionParams):
        out, stats, rng_state = forward_kernel(backend, q, k, v, params)
        ctx.save_for_backward(q, k, v, out, *stats.tensors())
        ctx.backend, ctx.params, ctx.rng_state = backend, params, rng_state
        lse = stats.lse()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, *stats = ctx.saved_tensors
        stats = SoftmaxStats.from_tensors(stats)
        dq, dk, dv = backward_kernel(ctx.backend, dout, q, k, v, out, stats, ctx.rng_state, ctx.params)
        return dq, dk, dv, None, None


class _FlashAttnVarlenFunction(torch.autograd.Function):
    """Autograd around a backend's packed-sequence forward/backward kernels."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q: list, cu_k: list, backend: AttentionBackend, params: AttentionParams):
        out, stats, rng_state = backend.varlen_forward(q, k, v, cu_q, cu_k, params)
        ctx.save_for_backward(q, k, v, out, *stats.tensors())
        ctx.cu, ctx.backend, ctx.params, ctx.rng_state = (cu_q, cu_k), backend, params, rng_state
        lse = stats.lse()[0]  # [hq, tq]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, *stats = ctx.saved_tensors
        dq, dk, dv = ctx.backend.varlen_backward(
            dout, q, k, v, out, SoftmaxStats.from_tensors(stats), ctx.rng_state, *ctx.cu, ctx.params
        )
        return dq, dk, dv, None, None, None, None


def resolve_call(
    q: Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    dropout_p: float,
    backend: Union[str, AttentionBackend, None],
    attn_mask: Optional[Tensor] = None,
    layout: str = "bshd",
) -> tuple[AttentionBackend, AttentionParams]:
    """The backend and the checked :class:`AttentionParams` of one attention call."""
    params = AttentionParams(
        causal=bool(causal),
        softmax_scale=checks.resolve_scale(softmax_scale, q.shape[-1]),
        dropout_p=checks.check_dropout(dropout_p),
        attn_mask=attn_mask,
        layout=layout,
    )
    return get_backend(backend, q.device.type), params


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    *,
    backend: Union[str, AttentionBackend, None] = None,
    return_lse: bool = False,
    attn_mask: Optional[Tensor] = None,
    layout: str = "bshd",
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Fused scaled-dot-product attention.

    Args:
        q: ``[b, sq, hq, d]`` (``layout="sbhd"``: ``[sq, b, hq, d]``).
        k, v: ``[b, sk, hkv, d]`` (``[sk, b, hkv, d]``) with ``hq % hkv == 0`` (GQA/MQA; not expanded).
        dropout_p: attention-probability dropout (training only; pass 0.0 in eval).
        softmax_scale: defaults to ``1 / sqrt(d)``.
        causal: bottom-right aligned causal mask (flash-attn >= 2.1 semantics).
        backend: ``"npu" | "cuda" | "cpu" | "reference"``, an :class:`AttentionBackend`
            instance, or None for the automatic choice (see :mod:`mcore_flash.ops.backends`).
        return_lse: also return the logsumexp ``[b, hq, sq]`` (float32, natural log).
        attn_mask: optional bool mask, True = masked out, shaped ``[b|1, hq|1, sq, sk]``
            (an extension over flash-attn; combined with ``causal``).
        layout: ``"bshd"`` (flash-attn's) or ``"sbhd"`` (Megatron's; an extension: the NPU
            kernel takes it without a copy).

    Returns:
        ``out`` (q's layout and dtype), or ``(out, lse [b, hq, sq])`` with ``return_lse``.
        Rows that see no key give ``out = 0`` and ``lse = -inf``.
    """
    checks.check_layout(layout, LAYOUTS)
    checks.check_qkv(q, k, v, packed=False, layout=layout)
    seq, batch = layout.index("s"), layout.index("b")
    checks.check_attn_mask(attn_mask, q.shape[batch], q.shape[2], q.shape[seq], k.shape[seq])
    impl, params = resolve_call(q, causal, softmax_scale, dropout_p, backend, attn_mask, layout)
    impl.check_inputs(q, k, v, params)
    out, lse = _FlashAttnFunction.apply(q, k, v, impl, params)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    *,
    backend: Union[str, AttentionBackend, None] = None,
    return_lse: bool = False,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Attention over packed sequences; no token attends across a sequence boundary.

    Args:
        q: ``[total_q, hq, d]``; k, v: ``[total_k, hkv, d]``.
        cu_seqlens_q, cu_seqlens_k: int ``[num_seqs + 1]`` cumulative lengths from 0.
        max_seqlen_q, max_seqlen_k: the longest sequence of each (checked).
        Other arguments as in :func:`flash_attn_func`.

    Returns:
        ``out [total_q, hq, d]``, or ``(out, lse [hq, total_q])`` with ``return_lse``.
    """
    checks.check_qkv(q, k, v, packed=True)
    cu_q = checks.check_cu_seqlens(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
    cu_k = checks.check_cu_seqlens(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
            f"got {len(cu_q) - 1} and {len(cu_k) - 1}"
        )
    impl, params = resolve_call(q, causal, softmax_scale, dropout_p, backend)
    impl.check_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), params)
    out, lse = _FlashAttnVarlenFunction.apply(q, k, v, cu_q, cu_k, impl, params)
    return (out, lse) if return_lse else out
