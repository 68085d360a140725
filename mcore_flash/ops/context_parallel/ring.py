"""Ring attention (``comm_type="p2p"``; Megatron/TE ``cp_comm_type="p2p"``, MindSpeed
``megatron_cp_algo``).

K/V blocks travel around the ring (rank r sends to r+1, receives from r-1) while the
current block is computed. Which rows of the local queries meet which rows of the visiting
K/V block at each step, under which band and ALiBi shift, is :mod:`.ring_plan`'s arithmetic;
a :class:`RingBlocks` strategy turns that plan into kernel calls, for one dense sequence
(:class:`DenseBlocks`) or packed documents (:class:`PackedBlocks`). Each block returns
``(out_i, stats_i)``; partial results merge as (row max, row sum) pairs in fp32 accumulators
(:mod:`.merge`). Backward replays the ring with the MERGED ``out`` and statistics
(:class:`RingAttention` has the order of hops and kernels).

:class:`RingAttention` saves only the local ``q, k, v, out`` and the fp32 statistics (plus
the per-block dropout replay states): saved bytes per rank are ``1/cp`` of the unsplit ones.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from ..backends import AttentionBackend, AttentionParams
from ..backends.base import SoftmaxStats, backward_kernel, forward_kernel
from .layout import Rows, concat_ranges
from .merge import accumulator_dtype, empty_accumulators, merge_block, set_stat_rows
from .ring_plan import (
    Block,
    PairCut,
    RowsKey,
    blocks_by_halves,
    by_chunk_pairs,
    chunk_pairs,
    pair_cut,
)

Tensor = torch.Tensor

_KV_TAG = 1917  # point-to-point tags keep the K/V and the dK/dV hops apart
_DKV_TAG = 1918


class _Ring:
    """Neighbours of this rank in ``group`` and asynchronous hops along the ring."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = group.size()
        self.rank = group.rank()
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def hop(self, send: Tensor, recv: Tensor, tag: int) -> list:
        """Post ``send -> next`` and ``recv <- prev``; returns the requests to wait on.

        One ``batch_isend_irecv`` per hop: NCCL/HCCL then run the pair as one group (a ring
        of separately posted blocking sends could deadlock there); gloo runs it as is.
        """
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, self.next, self.group, tag),
                dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
            ]
        )


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


_ALL = slice(None)


class RingBlocks(Protocol):
    """The kernel calls of ring attention over one kind of local rows: the strategy
    :class:`RingAttention` runs, :class:`DenseBlocks` (one sequence) or
    :class:`PackedBlocks` (packed documents).

    ``softcap`` and ``deterministic`` need nothing from the ring: the cap acts on each score
    before the softmax, so block statistics merge as they are, and the ring's order of
    accumulation is fixed."""

    params: AttentionParams  # of the whole call: its layout, causal flag, band, ALiBi slopes
    seq: int  # the sequence dim of q, k, v and out
    rows: dict[RowsKey, Rows]  # the local rows that each key of a plan names

    def plan(self, step: int, ring: _Ring) -> list[Block]:
        """The kernel calls of ring step ``step`` (K/V of rank ``(rank - step) mod cp``):
        ``(query rows, kv rows, the params of that block's kernel)``, keys of ``rows``."""
        ...

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_rows: RowsKey,
        kv_rows: RowsKey,
        params: AttentionParams,
    ) -> tuple[Tensor, SoftmaxStats, Any]:
        """``(out, stats, rng_state)`` of one block: ``q`` holds the rows ``q_rows`` names,
        ``k``/``v`` those ``kv_rows`` names, along dim :attr:`seq`."""
        ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        stats: SoftmaxStats,
        rng_state: Any,
        q_rows: RowsKey,
        kv_rows: RowsKey,
        params: AttentionParams,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of one block, from the MERGED ``out`` and ``stats`` of its rows."""
        ...


class DenseBlocks:
    """Ring blocks of one dense sequence: this rank's ``s_local`` rows are chunk ``r`` then
    chunk ``2cp-1-r``, so the halves (and their cuts) are slices; kernels are the backend's
    dense ones."""

    def __init__(self, backend: AttentionBackend, params: AttentionParams, local_len: int):
        self.backend, self.params = backend, params
        self.seq = params.layout.index("s")
        self.half = local_len // 2
        self.rows: dict[RowsKey, Rows] = {
            "all": _ALL,
            "first": slice(0, self.half),
            "second": slice(self.half, None),
        }

    def _register(self, half: str, start: int, n: int) -> RowsKey:
        """The key of rows ``[start, start + n)`` of ``half``."""
        key = (half, start, n)
        if key not in self.rows:
            base = 0 if half == "first" else self.half
            self.rows[key] = slice(base + start, base + start + n)
        return key

    def plan(self, step: int, ring: _Ring) -> list[Block]:
        if not by_chunk_pairs(self.params):
            return blocks_by_halves(step, ring.rank, ring.size, self.params)
        blocks = []  # the cut of each chunk pair the band reaches
        for q_half, kv_half, chunk_delta in chunk_pairs(step, ring.rank, ring.size):
            cut = pair_cut(self.params, chunk_delta * self.half, self.half)
            if cut is not None:
                q_rows = self._register(q_half, cut.first_row, cut.n)
                kv_rows = self._register(kv_half, cut.first_key, cut.n)
                blocks.append(
                    (
                        q_rows,
                        kv_rows,
                        replace(self.params.with_band(*cut.band), alibi_shift=cut.alibi_shift),
                    )
                )
        return blocks

    def forward(self, q, k, v, q_rows: RowsKey, kv_rows: RowsKey, params: AttentionParams):
        return forward_kernel(self.backend, q, k, v, params)

    def backward(
        self,
        dout,
        q,
        k,
        v,
        out,
        stats,
        rng_state,
        q_rows: RowsKey,
        kv_rows: RowsKey,
        params: AttentionParams,
    ):
        return backward_kernel(self.backend, dout, q, k, v, out, stats, rng_state, params)


class PackedBlocks:
    """Ring blocks of packed documents (THD seen as ``[1, t_local, h, d]``): each document's
    local rows are its chunk ``r`` then its chunk ``2cp-1-r``, so a half is an index set and
    kernels are the backend's varlen ones with the cumulative lengths of the rows taken.

    Every block is ONE varlen kernel call over all documents with their cumulative lengths
    (with a window or ALiBi: one per group of documents whose cut pairs share a band, and an
    ALiBi shift: :meth:`_pair_plan`)."""

    def __init__(
        self, backend: AttentionBackend, params: AttentionParams, local_cu: list[int], device
    ):
        self.backend, self.params, self.seq, self.device = backend, params, 1, device
        self.starts = local_cu[:-1]
        self.halves = [(end - start) // 2 for start, end in zip(local_cu[:-1], local_cu[1:])]
        self.rows: dict[RowsKey, Rows] = {"all": _ALL}
        self.cu: dict[RowsKey, list[int]] = {"all": local_cu}
        self.slopes: dict[
            tuple[int, ...], Tensor
        ] = {}  # per-document ALiBi slopes of a group of documents
        for half in ("first", "second"):
            self._register(half, tuple((doc, 0, n) for doc, n in enumerate(self.halves)), key=half)

    def _register(
        self, half: str, spans: tuple[tuple[int, int, int], ...], key: Optional[RowsKey] = None
    ) -> RowsKey:
        """The key of rows ``[start, start + n)`` of ``half`` of each document, for ``spans``
        of ``(document, start, n)`` (their row indices and cumulative lengths)."""
        key = (half, spans) if key is None else key
        if key not in self.rows:
            offsets = [
                self.starts[d] + (self.halves[d] if half == "second" else 0) + start
                for d, start, _ in spans
            ]
            lengths = [n for _, _, n in spans]
            self.rows[key] = concat_ranges(offsets, lengths).to(self.device)
            self.cu[key] = [0]
            for n in lengths:
                self.cu[key].append(self.cu[key][-1] + n)
        return key

    def plan(self, step: int, ring: _Ring) -> list[Block]:
        if not by_chunk_pairs(self.params):
            return blocks_by_halves(step, ring.rank, ring.size, self.params)
        return self._pair_plan(step, ring.rank, ring.size)

    def _pair_plan(self, step: int, rank: int, size: int) -> list[Block]:
        """Each chunk pair of step ``step`` once per group of documents whose cuts
        (:func:`~.ring_plan.pair_cut`) get the same band (and, with ALiBi, the same distance
        shift)."""
        alibi = self.params.alibi_slopes is not None
        blocks = []
        for q_half, kv_half, chunk_delta in chunk_pairs(step, rank, size):
            groups: dict[tuple, list[tuple[int, PairCut]]] = {}
            for doc, chunk in enumerate(self.halves):
                cut = pair_cut(self.params, chunk_delta * chunk, chunk) if chunk else None
                if cut is not None:
                    groups.setdefault((cut.band, cut.alibi_shift if alibi else 0), []).append(
                        (doc, cut)
                    )
            for (band, shift), cuts in groups.items():
                q_rows = self._register(
                    q_half, tuple((doc, cut.first_row, cut.n) for doc, cut in cuts)
                )
                kv_rows = self._register(
                    kv_half, tuple((doc, cut.first_key, cut.n) for doc, cut in cuts)
                )
                block_params = replace(self.params.with_band(*band), alibi_shift=shift)
                blocks.append(
                    (
                        q_rows,
                        kv_rows,
                        self._with_slopes_of(block_params, tuple(doc for doc, _ in cuts)),
                    )
                )
        return blocks

    def forward(self, q, k, v, q_rows: RowsKey, kv_rows: RowsKey, params: AttentionParams):
        out, stats, rng_state = self.backend.varlen_forward(
            q[0], k[0], v[0], self.cu[q_rows], self.cu[kv_rows], params
        )
        return out.unsqueeze(0), stats, rng_state

    def backward(
        self,
        dout,
        q,
        k,
        v,
        out,
        stats,
        rng_state,
        q_rows: RowsKey,
        kv_rows: RowsKey,
        params: AttentionParams,
    ):
        grads = self.backend.varlen_backward(
            dout[0],
            q[0],
            k[0],
            v[0],
            out[0],
            stats,
            rng_state,
            self.cu[q_rows],
            self.cu[kv_rows],
            params,
        )
        return tuple(g.unsqueeze(0) for g in grads)

    def _with_slopes_of(self, params: AttentionParams, docs: tuple[int, ...]) -> AttentionParams:
        """``params`` for a varlen call over documents ``docs`` only: their rows of per-document
        ``[num_docs, hq]`` ALiBi slopes (taken once per group, then reused every step)."""
        slopes = params.alibi_slopes
        if slopes is None or slopes.dim() == 1 or len(docs) == slopes.shape[0]:
            return params
        if docs not in self.slopes:
            self.slopes[docs] = slopes[torch.tensor(docs, device=slopes.device)]
        return replace(params, alibi_slopes=self.slopes[docs])


def _at(rows: slice, seq_dim: int) -> tuple:
    """The index selecting ``rows`` (a slice) of the sequence dim ``seq_dim``."""
    return (slice(None),) * seq_dim + (rows,)


def _take(x: Tensor, rows: Rows, seq_dim: int) -> Tensor:
    """Rows ``rows`` of the sequence dim (contiguous, as kernels take them)."""
    if isinstance(rows, slice):
        return x[_at(rows, seq_dim)].contiguous()
    return x.index_select(seq_dim, rows)


def _put(x: Tensor, rows: Rows, seq_dim: int, value: Tensor) -> None:
    """``x[rows] = value`` along the sequence dim, in place."""
    if isinstance(rows, slice):
        x[_at(rows, seq_dim)] = value
    else:
        x.index_copy_(seq_dim, rows, value.to(x.dtype))


def _add(x: Tensor, rows: Rows, seq_dim: int, value: Tensor) -> None:
    """``x[rows] += value`` along the sequence dim, in place."""
    if isinstance(rows, slice):
        x[_at(rows, seq_dim)] += value
    else:
        x.index_add_(seq_dim, rows, value.to(x.dtype))


class RingAttention(torch.autograd.Function):
    """Ring attention over ``blocks`` (a :class:`RingBlocks`); saves only the local q, k, v,
    merged out and merged statistics.

    ``apply(q, k, v, group, blocks)`` with q, k, v this rank's rows in ``blocks.params.layout``
    (``[b, s_local, h, d]`` or ``[s_local, b, h, d]``; packed documents as
    ``[1, t_local, h, d]``) returns ``(out, lse)``: ``out`` like q (with v's head dim), and
    the merged statistics' logsumexp ``[b, hq, s_local]`` (not differentiable).

    Forward: the send of the next K/V block is posted (``batch_isend_irecv``) before the
    current block's kernels run and waited after them; each block's ``(out_i, stats_i)``
    merges into fp32 accumulators (:mod:`.merge`).

    Backward replays the ring: each block's kernel backward is called with the MERGED ``out``
    and statistics (so they give the final probabilities and ``rowsum(dout * out)`` the final
    ``D``); dq accumulates locally, and an fp32 dK/dV accumulator travels with the K/V block,
    one hop behind it, so that after ``cp`` hops each rank receives the complete dK/dV of its
    own block. The dK/dV hop of step ``i`` is overlapped with the kernel of step ``i+1``.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, blocks: RingBlocks):
        ring, seq, params = _Ring(group), blocks.seq, blocks.params
        kv = torch.stack([k, v])  # one message per hop
        rng_states: list[list[Any]] = []
        out_acc: Optional[Tensor] = None
        for step in range(ring.size):
            if step + 1 < ring.size:  # send the next block while this one is computed
                incoming = torch.empty_like(kv)
                requests = ring.hop(kv, incoming, _KV_TAG)
            rng_states.append([])
            for q_rows, kv_rows, block_params in blocks.plan(step, ring):
                rows, cols = blocks.rows[q_rows], blocks.rows[kv_rows]
                out, stats, rng_state = blocks.forward(
                    _take(q, rows, seq),
                    _take(kv[0], cols, seq),
                    _take(kv[1], cols, seq),
                    q_rows,
                    kv_rows,
                    block_params,
                )
                rng_states[-1].append(rng_state)
                if out_acc is None and q_rows == "all":  # a first block that covers every row
                    out_acc, stats_acc = out.to(accumulator_dtype(q.dtype)), stats
                    continue
                if out_acc is None:
                    out_acc, stats_acc = empty_accumulators(q, v, stats, seq)
                acc_rows = _take(out_acc, rows, seq), stats_acc.rows(rows)
                merged, merged_stats = merge_block(*acc_rows, out, stats, params.layout)
                _put(out_acc, rows, seq, merged)
                set_stat_rows(stats_acc, rows, merged_stats)
            if step + 1 < ring.size:
                _wait(requests)
                kv = incoming
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, *stats_acc.tensors())
        ctx.group, ctx.blocks, ctx.rng_states = group, blocks, rng_states
        lse = stats_acc.lse()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, *stats = ctx.saved_tensors
        stats = SoftmaxStats.from_tensors(stats)
        blocks: RingBlocks = ctx.blocks
        ring, seq = _Ring(ctx.group), blocks.seq
        acc_dtype = accumulator_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        kv = torch.stack([k, v])
        dkv_requests: list = []
        dkv_incoming: Optional[Tensor] = None
        for step in range(ring.size):
            if step + 1 < ring.size:
                kv_incoming = torch.empty_like(kv)
                kv_requests = ring.hop(kv, kv_incoming, _KV_TAG)
            kv_grads = []
            for (q_rows, kv_rows, block_params), rng_state in zip(
                blocks.plan(step, ring), ctx.rng_states[step]
            ):
                rows, cols = blocks.rows[q_rows], blocks.rows[kv_rows]
                dq_blk, dk_blk, dv_blk = blocks.backward(
                    _take(dout, rows, seq),
                    _take(q, rows, seq),
                    _take(kv[0], cols, seq),
                    _take(kv[1], cols, seq),
                    _take(out, rows, seq),
                    stats.rows(rows),
                    rng_state,
                    q_rows,
                    kv_rows,
                    block_params,
                )
                _add(dq, rows, seq, dq_blk)
                kv_grads.append((cols, dk_blk, dv_blk))
            if step == 0:  # the dK/dV accumulator of our own block starts here ...
                dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=kv.device)
            else:  # ... the others arrive from the previous rank, one hop behind K/V
                _wait(dkv_requests)
                dkv = dkv_incoming
            for cols, dk_blk, dv_blk in kv_grads:
                _add(dkv[0], cols, seq, dk_blk)
                _add(dkv[1], cols, seq, dv_blk)
            dkv_incoming = torch.empty_like(dkv)
            dkv_requests = ring.hop(
                dkv, dkv_incoming, _DKV_TAG
            )  # after the last step: to its owner
            if step + 1 < ring.size:
                _wait(kv_requests)
                kv = kv_incoming
        _wait(dkv_requests)
        dk, dv = dkv_incoming[0].to(k.dtype), dkv_incoming[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None
