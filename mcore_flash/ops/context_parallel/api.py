"""The entry points of context-parallel attention: check the arguments, resolve the backend
and run the chosen algorithm's dense or packed strategy (ring: :mod:`.ring`, Ulysses:
:mod:`.ulysses`)."""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from .. import checks
from ..api import flash_attn_func, flash_attn_varlen_func, resolve_call
from ..backends import AttentionBackend
from ..backends.base import LAYOUTS
from .layout import check_thd_cp_lengths
from .ring import DenseBlocks, PackedBlocks, RingAttention, RingBlocks
from .ulysses import DenseSequence, PackedSequence, UlyssesSequence, heads_of_rank, ulysses

Tensor = torch.Tensor

COMM_TYPES = ("p2p", "a2a")


def context_parallel_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Optional[dist.ProcessGroup],
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    dropout_p: float = 0.0,
    comm_type: str = "p2p",
    backend: Union[str, AttentionBackend, None] = None,
    return_lse: bool = False,
    layout: str = "bshd",
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Attention over a sequence split across ``group`` (see :mod:`mcore_flash.ops.context_parallel`).

    Args:
        q: ``[b, s_local, hq, d]``; k, v: ``[b, s_local, hkv, d]`` -- this rank's chunks
            ``r`` and ``2cp-1-r`` of ``2cp`` (:func:`~.layout.split_for_cp_rank`), so
            ``s_local = s_total / cp`` tokens, even (``layout="sbhd"``: ``[s_local, b, h, d]``).
        group: the context-parallel process group (None or size 1: plain attention).
        causal: causal over the WHOLE sequence (positions from the chunk layout).
        softmax_scale: multiplies the scores; defaults to ``1 / sqrt(d)``.
        dropout_p: attention-probability dropout, a probability (training only).
        window_size: flash-attn's ``(left, right)`` sliding window over the whole sequence,
            in tokens; the ring skips the chunk pairs it misses.
        alibi_slopes: ``[hq]`` or ``[b, hq]`` float32; distances are global positions (the
            ring gives each chunk pair its shift, Ulysses each rank its heads' slopes).
        comm_type: ``"p2p"`` (ring) or ``"a2a"`` (Ulysses all-to-all over heads).
        Other arguments (``softcap``, ``deterministic``, ``backend``, ``layout``) as in
        :func:`mcore_flash.ops.flash_attn_func`.

    Returns:
        ``out`` (q's layout and dtype, this rank's tokens), or with ``return_lse``
        ``(out, lse [b, hq, s_local])``: float32 natural-log logsumexp over the WHOLE
        sequence's keys, -inf for a row that sees none; not differentiable.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"comm_type={comm_type!r} is not supported; choose one of {COMM_TYPES}")
    cp_size = 1 if group is None else group.size()
    if cp_size == 1:
        return flash_attn_func(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            backend=backend,
            return_lse=return_lse,
            layout=layout,
        )
    checks.check_layout(layout, LAYOUTS)
    checks.check_qkv(q, k, v, packed=False, layout=layout)
    seq = layout.index("s")
    if q.shape[seq] != k.shape[seq]:
        raise ValueError(
            f"context parallelism is self-attention over one split sequence: q has {q.shape[seq]} "
            f"local tokens, k/v {k.shape[seq]}"
        )
    if q.shape[seq] % 2:
        raise ValueError(
            f"local sequence length {q.shape[seq]} is odd: each context-parallel rank holds two equal "
            f"chunks, so the total length must be divisible by 2 * cp = {2 * cp_size}"
        )
    impl, params = resolve_call(
        q,
        causal,
        softmax_scale,
        dropout_p,
        backend,
        layout=layout,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        batch=q.shape[layout.index("b")],
    )
    impl.check_inputs(q, k, v, params)
    if comm_type == "a2a":
        sequence: UlyssesSequence = DenseSequence(impl, heads_of_rank(params, group), cp_size)
        out, lse = ulysses(q, k, v, group, sequence)
    else:
        blocks: RingBlocks = DenseBlocks(impl, params, q.shape[seq])
        out, lse = RingAttention.apply(q, k, v, group, blocks)
    return (out, lse) if return_lse else out


def context_parallel_varlen_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    group: Optional[dist.ProcessGroup],
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    dropout_p: float = 0.0,
    comm_type: str = "p2p",
    backend: Union[str, AttentionBackend, None] = None,
    return_lse: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Attention over packed documents split across ``group``; no token sees another document.

    Args:
        q: ``[t_local, hq, d]``; k, v: ``[t_local, hkv, d]`` -- this rank's rows of the pack,
            :func:`~.layout.thd_positions_for_cp_rank` (chunks ``r`` and ``2cp-1-r`` of every
            document), ``t_local = t_total / cp`` tokens.
        cu_seqlens: int ``[num_docs + 1]`` cumulative document lengths in tokens over the
            WHOLE pack (``cu_seqlens[-1] == cp * t_local``), each a multiple of ``2*cp``.
        window_size: a sliding window within each document, in tokens.
        alibi_slopes: ``[hq]`` or ``[num_docs, hq]`` float32; distances within each document.
        Other arguments as in :func:`context_parallel_attn_func`.

    Ring (p2p): every hop is one varlen kernel call over all documents -- at step 0 the
    diagonal (causal, each document's local rows against themselves), then every
    document's first halves as keys (``src < r``) or second halves as queries
    (``src > r``), unmasked. With a window every hop is split into its chunk pairs as for
    one sequence, but a document's chunk is ``len / 2cp`` rows, so the shifted band differs
    between documents: each document's pair is cut (:func:`~.ring_plan.pair_cut`), each pair runs one
    varlen call per group of documents whose cuts share a band, and documents the band
    misses are skipped. With ALiBi every hop is split the same way, windowed or not, and
    documents are grouped by band and distance shift (which depends on the document's
    length: its pair is ``(a - b) * len / 2cp`` rows off the diagonal before the cut).
    Ulysses (a2a): the rows are gathered in position order and one varlen call runs over the
    whole pack.

    Returns:
        ``out [t_local, hq, d]`` (q's dtype), or with ``return_lse`` ``(out, lse [hq, t_local])``:
        float32 natural-log logsumexp over the keys of each row's document; not differentiable.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"comm_type={comm_type!r} is not supported; choose one of {COMM_TYPES}")
    cp_size = 1 if group is None else group.size()
    checks.check_qkv(q, k, v, packed=True)
    if q.shape[0] != k.shape[0]:
        raise ValueError(
            f"packed context parallelism is self-attention: q has {q.shape[0]} rows, k/v {k.shape[0]}"
        )
    cu = checks.check_cu_seqlens(
        cu_seqlens, q.shape[0] * cp_size, q.shape[0] * cp_size, "cu_seqlens"
    )
    if cp_size == 1:
        longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            longest,
            longest,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            deterministic,
            backend=backend,
            return_lse=return_lse,
        )
    check_thd_cp_lengths(cu, cp_size)
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
        batch=len(cu) - 1,
    )
    impl.check_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), params)
    if comm_type == "a2a":
        sequence: UlyssesSequence = PackedSequence(
            impl, heads_of_rank(params, group), cu, cp_size, q.device
        )
        out, lse = ulysses(q, k, v, group, sequence)
    else:
        local_cu = [n // cp_size for n in cu]
        blocks: RingBlocks = PackedBlocks(impl, params, local_cu, q.device)
        out, lse = RingAttention.apply(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), group, blocks
        )
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out
