"""The flash-attn-style public API, drop-in for flash-attn 2's ``flash_attn_interface``.

:func:`flash_attn_func`, :func:`flash_attn_varlen_func` and the packed forms
:func:`flash_attn_qkvpacked_func`, :func:`flash_attn_kvpacked_func`,
:func:`flash_attn_varlen_qkvpacked_func`, :func:`flash_attn_varlen_kvpacked_func` take
flash-attn's arguments in flash-attn's order (``dropout_p, softmax_scale, causal,
window_size, softcap, alibi_slopes, deterministic, return_attn_probs``); our extensions
(``backend``, ``return_lse``, ``attn_mask``, ``layout``) are keyword-only.

All are differentiable in q, k, v. Forward saves exactly ``q, k, v, out`` and the float32
softmax statistics for backward (the logsumexp; on NPU the kernel's row max and row sum)
-- never a ``[sq, sk]`` matrix, windows and ALiBi included -- and backward calls the
backend's kernel, which recomputes the probabilities. The packed forms pass views of the
packed tensor, so they save the same bytes.

The logsumexp of a query row that sees no key: ``return_lse=True`` gives its true value,
``-inf`` (what the context-parallel merges compute with); ``return_attn_probs=True`` gives
flash-attn's ``(out, softmax_lse, S_dmask)`` with flash-attn's convention, ``+inf``, there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from . import checks
from .backends import AttentionBackend, AttentionParams, get_backend
from .backends.base import LAYOUTS, SoftmaxStats, backward_kernel, forward_kernel, inf_where_no_key
from .backends.reference import DropoutState, attention_probs

Tensor = torch.Tensor


@dataclass
class _ForwardRecord:
    """What a forward leaves for ``return_attn_probs`` (its dropout replay state)."""

    rng_state: Any = field(default=None)


class _FlashAttnFunction(torch.autograd.Function):
    """Autograd around a backend's dense forward/backward kernels."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        backend: AttentionBackend,
        params: AttentionParams,
        record: Optional[_ForwardRecord],
    ):
        out, stats, rng_state = forward_kernel(backend, q, k, v, params)
        ctx.save_for_backward(q, k, v, out, *stats.tensors())
        ctx.backend, ctx.params, ctx.rng_state = backend, params, rng_state
        if record is not None:
            record.rng_state = rng_state
        lse = stats.lse()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, *stats = ctx.saved_tensors
        stats = SoftmaxStats.from_tensors(stats)
        dq, dk, dv = backward_kernel(
            ctx.backend, dout, q, k, v, out, stats, ctx.rng_state, ctx.params
        )
        return dq, dk, dv, None, None, None


class _FlashAttnVarlenFunction(torch.autograd.Function):
    """Autograd around a backend's packed-sequence forward/backward kernels."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        cu_q: list,
        cu_k: list,
        backend: AttentionBackend,
        params: AttentionParams,
        record,
    ):
        out, stats, rng_state = backend.varlen_forward(q, k, v, cu_q, cu_k, params)
        ctx.save_for_backward(q, k, v, out, *stats.tensors())
        ctx.cu, ctx.backend, ctx.params, ctx.rng_state = (cu_q, cu_k), backend, params, rng_state
        if record is not None:
            record.rng_state = rng_state
        lse = stats.lse()[0]  # [hq, tq]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, *stats = ctx.saved_tensors
        dq, dk, dv = ctx.backend.varlen_backward(
            dout, q, k, v, out, SoftmaxStats.from_tensors(stats), ctx.rng_state, *ctx.cu, ctx.params
        )
        return dq, dk, dv, None, None, None, None, None


def resolve_call(
    q: Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    dropout_p: float,
    backend: Union[str, AttentionBackend, None],
    attn_mask: Optional[Tensor] = None,
    layout: str = "bshd",
    *,
    window_size=(-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    batch: Optional[int] = None,
) -> tuple[AttentionBackend, AttentionParams]:
    """The backend and the checked :class:`AttentionParams` of one attention call.

    ``window_size=(left, right)`` is flash-attn's (-1 = unbounded); with ``causal`` the
    right side is 0. ``batch`` (None for packed calls) is what a ``[b, hq]`` ALiBi slope
    tensor must match.
    """
    left, right = checks.check_window_size(window_size)
    params = AttentionParams(
        causal=bool(causal),
        softmax_scale=checks.resolve_scale(softmax_scale, q.shape[-1]),
        dropout_p=checks.check_dropout(dropout_p),
        attn_mask=attn_mask,
        layout=layout,
        softcap=checks.check_softcap(softcap),
        alibi_slopes=checks.check_alibi_slopes(alibi_slopes, q, batch),
        deterministic=checks.check_flag(deterministic, "deterministic"),
    )
    hi = 0 if causal else (None if right < 0 else right)
    params = params.with_band(None if left < 0 else -left, hi)
    impl = get_backend(backend, q.device.type)
    impl.check_params(params)
    return impl, params


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: Union[str, AttentionBackend, None] = None,
    return_lse: bool = False,
    attn_mask: Optional[Tensor] = None,
    layout: str = "bshd",
):
    """Fused scaled-dot-product attention (flash-attn 2's ``flash_attn_func``).

    Args:
        q: ``[b, sq, hq, d]`` (``layout="sbhd"``: ``[sq, b, hq, d]``).
        k, v: ``[b, sk, hkv, d]`` (``[sk, b, hkv, d]``) with ``hq % hkv == 0`` (GQA/MQA; not expanded).
        dropout_p: attention-probability dropout (training only; pass 0.0 in eval).
        softmax_scale: defaults to ``1 / sqrt(d)``.
        causal: bottom-right aligned causal mask (flash-attn >= 2.1 semantics).
        window_size: ``(left, right)`` sliding window: query ``i`` sees keys ``j`` with
            ``i + sk - sq - left <= j <= i + sk - sq + right``; -1 = unbounded.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (Gemma 2, Grok).
        alibi_slopes: float32 ``[hq]`` or ``[b, hq]``; adds ``-slope * |i + sk - sq - j|``.
        deterministic: ask for a deterministic backward. reference and cpu always are; a
            backend that cannot promise it runs the reference kernel or raises.
        return_attn_probs: return flash-attn's ``(out, softmax_lse, S_dmask)``: lse with +inf
            on rows that see no key, and (testing only, ``[b, hq, sq, sk]`` materialised)
            the float32 attention probabilities, negated where dropout dropped them.
        backend: ``"npu" | "cuda" | "cpu" | "reference"``, an :class:`AttentionBackend`
            instance, or None for the automatic choice (see :mod:`mcore_flash.ops.backends`).
        return_lse: also return the logsumexp ``[b, hq, sq]`` (float32, natural log, -inf on
            rows that see no key).
        attn_mask: optional bool mask, True = masked out, shaped ``[b|1, hq|1, sq, sk]``
            (an extension over flash-attn; combined with ``causal`` and ``window_size``).
        layout: ``"bshd"`` (flash-attn's) or ``"sbhd"`` (Megatron's; an extension: the NPU
            kernel takes it without a copy).

    Returns:
        ``out`` (q's layout and dtype); ``(out, lse [b, hq, sq])`` with ``return_lse``;
        ``(out, softmax_lse, S_dmask)`` with ``return_attn_probs``.
        Rows that see no key give ``out = 0``.
    """
    checks.check_layout(layout, LAYOUTS)
    checks.check_qkv(q, k, v, packed=False, layout=layout)
    seq, batch = layout.index("s"), layout.index("b")
    checks.check_attn_mask(attn_mask, q.shape[batch], q.shape[2], q.shape[seq], k.shape[seq])
    impl, params = resolve_call(
        q,
        causal,
        softmax_scale,
        dropout_p,
        backend,
        attn_mask,
        layout,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        batch=q.shape[batch],
    )
    impl.check_inputs(q, k, v, params)
    record = _ForwardRecord() if return_attn_probs else None
    out, lse = _FlashAttnFunction.apply(q, k, v, impl, params, record)
    if return_attn_probs:
        to_bshd = (lambda x: x) if layout == "bshd" else (lambda x: x.transpose(0, 1))
        probs = _probs(to_bshd(q), to_bshd(k), lse, record.rng_state, params, impl)
        return out, inf_where_no_key(lse), probs
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
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: Union[str, AttentionBackend, None] = None,
    return_lse: bool = False,
):
    """Attention over packed sequences; no token attends across a sequence boundary.

    Args:
        q: ``[total_q, hq, d]``; k, v: ``[total_k, hkv, d]``.
        cu_seqlens_q, cu_seqlens_k: int ``[num_seqs + 1]`` cumulative lengths from 0.
        max_seqlen_q, max_seqlen_k: the longest sequence of each (checked).
        alibi_slopes: ``[hq]`` or ``[num_seqs, hq]``.
        Other arguments as in :func:`flash_attn_func`; causal, windows and ALiBi positions
        are per sequence (bottom-right aligned in each).

    Returns:
        ``out [total_q, hq, d]``; ``(out, lse [hq, total_q])`` with ``return_lse``;
        ``(out, softmax_lse [hq, total_q], None)`` with ``return_attn_probs`` (no
        probabilities for packed sequences).
    """
    checks.check_qkv(q, k, v, packed=True)
    cu_q = checks.check_cu_seqlens(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
    cu_k = checks.check_cu_seqlens(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
            f"got {len(cu_q) - 1} and {len(cu_k) - 1}"
        )
    impl, params = resolve_call(
        q,
        causal,
        softmax_scale,
        dropout_p,
        backend,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        batch=len(cu_q) - 1,
    )
    impl.check_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), params)
    out, lse = _FlashAttnVarlenFunction.apply(q, k, v, cu_q, cu_k, impl, params, None)
    if return_attn_probs:
        return out, inf_where_no_key(lse), None
    return (out, lse) if return_lse else out


def flash_attn_qkvpacked_func(
    qkv: Tensor, dropout_p=0.0, softmax_scale=None, causal=False, *args, **kwargs
):
    """:func:`flash_attn_func` with ``qkv [b, s, 3, h, d]`` (gradient ``[b, s, 3, h, d]``)."""
    q, k, v = _unpack(qkv, 2, 3, "qkv", "[b, s, 3, h, d]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, *args, **kwargs)


def flash_attn_kvpacked_func(
    q: Tensor, kv: Tensor, dropout_p=0.0, softmax_scale=None, causal=False, *args, **kwargs
):
    """:func:`flash_attn_func` with ``kv [b, sk, 2, hkv, d]``."""
    k, v = _unpack(kv, 2, 2, "kv", "[b, sk, 2, hkv, d]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, *args, **kwargs)


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p=0.0, *args, **kwargs
):
    """:func:`flash_attn_varlen_func` with ``qkv [total, 3, h, d]`` and one ``cu_seqlens``."""
    q, k, v = _unpack(qkv, 1, 3, "qkv", "[total, 3, h, d]")
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, *args, **kwargs
    )


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p=0.0,
    *args,
    **kwargs,
):
    """:func:`flash_attn_varlen_func` with ``kv [total_k, 2, hkv, d]``."""
    k, v = _unpack(kv, 1, 2, "kv", "[total_k, 2, hkv, d]")
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return flash_attn_varlen_func(q, k, v, *lengths, dropout_p, *args, **kwargs)


def _unpack(packed: Tensor, dim: int, parts: int, name: str, shape: str) -> tuple[Tensor, ...]:
    """Views of the ``parts`` tensors packed along ``dim`` (no copy)."""
    if (
        not isinstance(packed, torch.Tensor)
        or packed.dim() != dim + 3
        or packed.shape[dim] != parts
    ):
        got = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f"{name} must be shaped {shape}, got {got}")
    return packed.unbind(dim)


def _probs(
    q: Tensor, k: Tensor, lse: Tensor, rng_state, params: AttentionParams, backend: AttentionBackend
) -> Tensor:
    """The ``[b, hq, sq, sk]`` float32 probabilities of a finished forward (testing only)."""
    if params.dropout_p > 0 and not isinstance(rng_state, DropoutState):
        raise ValueError(
            f"return_attn_probs with dropout_p > 0: the {backend.name} backend's dropout masks are drawn inside "
            "its kernel and cannot be replayed outside it; use backend='reference' (or dropout_p=0)"
        )
    return attention_probs(q.detach(), k.detach(), lse, rng_state, params)
