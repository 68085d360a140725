"""Ulysses attention (``comm_type="a2a"``, DeepSpeed).

An all-to-all turns ``[b, s_local, h, d]`` into ``[b, s_total, h/cp, d]`` (every rank gets
the whole sequence for ``1/cp`` of the heads), the chunks are put back in position order,
one fused kernel call runs, and the inverse all-to-all returns ``[b, s_local, h, d]``. Needs
``hq % cp == 0``; key/value heads are replicated when ``hkv < cp`` and ``cp % hkv == 0``;
each rank takes the ALiBi slopes of its own heads (:func:`heads_of_rank`).

A :class:`UlyssesSequence` strategy knows the token order and runs the kernel: one dense
sequence (:class:`DenseSequence`) or packed documents, whose gathered rows are put in
position order by one index map (:class:`PackedSequence`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch
import torch.distributed as dist

from ..api import _FlashAttnFunction, _FlashAttnVarlenFunction
from ..backends import AttentionBackend, AttentionParams
from .layout import cp_chunk_ids, thd_positions_for_cp_rank
from .merge import per_token

Tensor = torch.Tensor


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along ``scatter_dim`` over the group and concatenate what arrives along
    ``gather_dim`` (in rank order). Backward is the inverse all-to-all. Saves nothing."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _all_to_all(x: Tensor, group, scatter_dim: int, gather_dim: int) -> Tensor:
    size = group.size()
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class UlyssesSequence(Protocol):
    """The token order and the kernel of Ulysses over one kind of input: the strategy
    :func:`ulysses` runs, :class:`DenseSequence` (one sequence) or :class:`PackedSequence`
    (packed documents)."""

    seq: int  # the sequence dim of q, k, v and out
    heads: int  # their head dim

    def to_positions(self, x: Tensor) -> Tensor:
        """The gathered rows (every rank's rows, in rank order) -> position order."""
        ...

    def to_ranks(self, x: Tensor) -> Tensor:
        """Inverse of :meth:`to_positions`."""
        ...

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``(out, lse per token)`` over the whole sequence, this rank's heads: ``out`` like
        ``q``, the lse beside it with one value per (token, head) and a trailing dim of 1."""
        ...

    def lse_from_tokens(self, lse: Tensor) -> Tensor:
        """This rank's lse per token (after the inverse all-to-all) -> the kernel's lse
        layout: ``[b, h, s_local]`` (dense) or ``[h, t_local]`` (packed)."""
        ...


class DenseSequence:
    """Ulysses over one dense sequence: the gathered chunks come in rank order and are put
    back in position order chunk by chunk; one dense kernel call."""

    def __init__(self, backend: AttentionBackend, params: AttentionParams, cp_size: int):
        self.backend, self.params = backend, params
        self.seq, self.heads = params.layout.index("s"), 2
        where = {}  # index of each sequence chunk (position order) in the rank-order concatenation
        for rank in range(cp_size):
            first, second = cp_chunk_ids(cp_size, rank)
            where[first], where[second] = 2 * rank, 2 * rank + 1
        self.order = [where[chunk] for chunk in range(2 * cp_size)]
        self.inverse = [0] * len(self.order)
        for position, index in enumerate(self.order):
            self.inverse[index] = position

    def to_positions(self, x: Tensor) -> Tensor:
        chunks = x.chunk(len(self.order), dim=self.seq)
        return torch.cat([chunks[i] for i in self.order], dim=self.seq)

    def to_ranks(self, x: Tensor) -> Tensor:
        chunks = x.chunk(len(self.order), dim=self.seq)
        return torch.cat([chunks[i] for i in self.inverse], dim=self.seq)

    def attend(self, q, k, v) -> tuple[Tensor, Tensor]:
        """``(out, lse per token)``; lse as ``[.., s, .., h, 1]`` beside ``out``."""
        out, lse = _FlashAttnFunction.apply(q, k, v, self.backend, self.params, None)
        return out, per_token(lse, self.params.layout)

    def lse_from_tokens(self, lse: Tensor) -> Tensor:
        """``[.., s_local, .., h, 1]`` -> ``[b, h, s_local]``."""
        lse = lse.squeeze(-1)
        return (
            lse.permute(0, 2, 1) if self.params.layout == "bshd" else lse.permute(1, 2, 0)
        ).contiguous()


class PackedSequence:
    """Ulysses over packed documents ``[t, h, d]``: the gathered rows come in rank order
    (rank r's parts of every document) and are put in position order by one index map;
    one varlen kernel call over the whole pack."""

    def __init__(
        self,
        backend: AttentionBackend,
        params: AttentionParams,
        cu_seqlens: list[int],
        cp_size: int,
        device,
    ):
        self.backend, self.params, self.cu = backend, params, cu_seqlens
        self.seq, self.heads = 0, 1
        positions = torch.cat(
            [thd_positions_for_cp_rank(cu_seqlens, cp_size, r) for r in range(cp_size)]
        )
        self.rank_order = positions.to(device)  # rank-order row j holds position rank_order[j]
        self.position_order = torch.argsort(positions).to(device)

    def to_positions(self, x: Tensor) -> Tensor:
        return x.index_select(0, self.position_order)

    def to_ranks(self, x: Tensor) -> Tensor:
        return x.index_select(0, self.rank_order)

    def attend(self, q, k, v) -> tuple[Tensor, Tensor]:
        out, lse = _FlashAttnVarlenFunction.apply(
            q, k, v, self.cu, self.cu, self.backend, self.params, None
        )
        return out, lse.t().unsqueeze(-1)  # [h, t] -> [t, h, 1]

    def lse_from_tokens(self, lse: Tensor) -> Tensor:
        return lse.squeeze(-1).t().contiguous()  # [t_local, h, 1] -> [h, t_local]


def heads_of_rank(params: AttentionParams, group: dist.ProcessGroup) -> AttentionParams:
    """``params`` for this rank's share of the heads after Ulysses' all-to-all (the
    ``rank``-th of ``cp`` equal head chunks): its columns of the ALiBi slopes."""
    slopes = params.alibi_slopes
    if slopes is None:
        return params
    share = slopes.shape[-1] // group.size()  # ulysses refuses heads that do not divide
    rank = group.rank()
    return replace(params, alibi_slopes=slopes[..., rank * share : (rank + 1) * share].contiguous())


def ulysses(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, sequence: UlyssesSequence
) -> tuple[Tensor, Tensor]:
    """All-to-all from sequence to heads, one kernel call, and back.

    q ``[.., s_local, .., hq, d]``, k/v ``[.., s_local, .., hkv, d]`` (dims
    ``sequence.seq``/``sequence.heads``) -> ``(out like q, lse)``, lse as
    :meth:`UlyssesSequence.lse_from_tokens` gives it (not differentiable).
    """
    cp_size, heads = group.size(), sequence.heads
    hq, hkv = q.shape[heads], k.shape[heads]
    if hq % cp_size:
        raise ValueError(
            f"a2a context parallelism splits the {hq} query heads of this rank over {cp_size} ranks: "
            f"the number of heads must be divisible by the context-parallel size"
        )
    if hkv % cp_size:
        if cp_size % hkv:
            raise ValueError(
                f"a2a context parallelism: {hkv} key/value heads can neither be split over nor "
                f"replicated to {cp_size} ranks (need hkv % cp == 0 or cp % hkv == 0)"
            )
        # replicate each kv head to cp/hkv ranks; the query heads of one rank share one kv head
        k = k.repeat_interleave(cp_size // hkv, dim=heads)
        v = v.repeat_interleave(cp_size // hkv, dim=heads)
    seq = sequence.seq

    def seq_to_heads(x):  # [.., s_local, .., h, d] -> [.., s_total, .., h/cp, d], position order
        return sequence.to_positions(_AllToAll.apply(x, group, heads, seq))

    def heads_to_seq(x):  # inverse
        return _AllToAll.apply(sequence.to_ranks(x), group, seq, heads)

    out, lse = sequence.attend(seq_to_heads(q), seq_to_heads(k), seq_to_heads(v))
    with torch.no_grad():
        lse = sequence.lse_from_tokens(heads_to_seq(lse))
    return heads_to_seq(out), lse
