"""Context-parallel attention: the sequence is split over the ranks of a process group.

Knows nothing of Megatron: it takes a ``torch.distributed`` ProcessGroup (Megatron's CP
group, or any other) and calls the backend kernels of :mod:`mcore_flash.ops.backends`.

    from mcore_flash.ops.context_parallel import context_parallel_attn_func, split_for_cp_rank

    q_local = split_for_cp_rank(q, seq_dim=1, cp_size=cp, cp_rank=rank)   # same for k, v
    out_local = context_parallel_attn_func(q_local, k_local, v_local, group, causal=True)

Layout (Megatron's ``get_batch_on_this_cp_rank``): the sequence is cut into ``2*cp`` equal
chunks and rank ``r`` holds chunks ``r`` and ``2*cp-1-r``, concatenated, so every rank
gets the same causal work. Tensors use the layouts of :mod:`mcore_flash.ops.api`:
``"bshd"`` (``q [b, s_local, hq, d]``, ``k``/``v`` ``[b, s_local, hkv, d]``) or Megatron's
``"sbhd"`` (sequence first: the ring's row blocks are then contiguous slices).

Two algorithms (``comm_type``):

``"p2p"`` -- ring attention (Megatron/TE ``cp_comm_type="p2p"``, MindSpeed
``megatron_cp_algo``). K/V blocks travel around the ring (rank r sends to r+1, receives
from r-1) while the current block is computed: the send of the next block is posted
(``batch_isend_irecv``) before the kernel runs and waited after it. At step ``i`` rank ``r``
holds the K/V of rank ``src = (r - i) mod cp``; with ``c = s_local / 2`` and causal:

* ``i == 0`` (own block): q ``[2c]`` x kv ``[2c]`` causal (the concatenation of chunks r and
  2cp-1-r is in increasing position order, so the plain causal mask is exact);
* ``src < r``: kv chunk ``src`` precedes both query chunks, kv chunk ``2cp-1-src`` follows
  both: q ``[2c]`` x kv first half ``[c]``, no mask;
* ``src > r``: both kv chunks precede query chunk ``2cp-1-r`` and follow chunk ``r``:
  q second half ``[c]`` x kv ``[2c]``, no mask.

Without causal every step is q ``[2c]`` x kv ``[2c]``, no mask.

With a sliding window (``window_size``) every step is split into its four chunk pairs
(query chunk ``a``, kv chunk ``b``, each ``[c]``): the global band ``lo <= j - i <= hi``
becomes the local band ``(lo + delta, hi + delta)`` with ``delta = (a - b) * c``; a pair the
band misses entirely is skipped (neither computed nor masked, no kernel call), a pair it
covers entirely runs unmasked, and a pair it cuts runs only the square of its rows that see
a key against the keys they see (:func:`_pair_cut`: no kernel meets a row without keys,
which TND calls and flash-attn's windows cannot compute). With window 4096 at 128K over cp 8
most pairs are skipped. ALiBi (``alibi_slopes``) splits every step the same way, windowed or
not: its distance ``|j - i|`` is global too, so each block's kernel gets its distance below
the global diagonal as ``alibi_shift`` (:class:`~mcore_flash.ops.backends.AttentionParams`):
``delta``, plus ``first_row - first_key`` for a cut pair. ``softcap`` and ``deterministic`` need
nothing from the ring: the cap acts on each score before the softmax, so block statistics
merge as they are, and the ring's order of accumulation is fixed. Each block returns
``(out_i, stats_i)``; partial results merge as (row max, row sum) pairs, MindSpeed's rule
(fp32 accumulators)::

    m = max(m_acc, m_i);  w_acc = s_acc exp(m_acc - m);  w_i = s_i exp(m_i - m)
    s = w_acc + w_i;      out = (out_acc w_acc + out_i w_i) / s

A logsumexp is the pair ``(lse, 1)``, and a merged pair of logsumexp statistics is kept as
``lse = m + log s``; the npu kernel's own ``softmax_max``/``softmax_sum`` stay (max, sum)
pairs, which is what its grad op takes. Backward replays the ring: each block's kernel
backward is called with the MERGED ``out`` and statistics (so they give the final
probabilities and ``rowsum(dout * out)`` the final ``D``); dq accumulates locally, and an
fp32 dK/dV accumulator travels with the K/V block, one hop behind it, so that after ``cp``
hops each rank receives the complete dK/dV of its own block. The dK/dV hop of step ``i``
is overlapped with the kernel of step ``i+1``.

The autograd function saves only the local ``q, k, v, out`` and the fp32 statistics (plus
the per-block dropout replay states): saved bytes per rank are ``1/cp`` of the unsplit ones.

``"a2a"`` -- Ulysses (DeepSpeed): an all-to-all turns ``[b, s_local, h, d]`` into
``[b, s_total, h/cp, d]`` (every rank gets the whole sequence for ``1/cp`` of the heads),
the chunks are put back in position order, one fused kernel call runs, and the inverse
all-to-all returns ``[b, s_local, h, d]``. Needs ``hq % cp == 0``; key/value heads are
replicated when ``hkv < cp`` and ``cp % hkv == 0``; each rank takes the ALiBi slopes of its
own heads.

Packed documents (THD, :func:`context_parallel_varlen_attn_func`): every document is split
into ``2*cp`` chunks and rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of EVERY document
(:func:`thd_positions_for_cp_rank`, Transformer Engine's scheme), so the rule above holds per
document: the ring's halves become index sets (each document's first / second half) and
every block is ONE varlen kernel call over all documents with their cumulative lengths
(with a window or ALiBi: one per group of documents whose cut pairs share a band, and an
ALiBi shift);
Ulysses gathers the rows and puts them in position order by one index map. Documents must be
padded to multiples of ``2*cp``. Neither algorithm takes an explicit attention mask.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Hashable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from . import checks
from .api import _FlashAttnFunction, _FlashAttnVarlenFunction, flash_attn_func, flash_attn_varlen_func, resolve_call
from .backends import AttentionBackend, AttentionParams
from .backends.base import LAYOUTS, SoftmaxStats, backward_kernel, forward_kernel

Tensor = torch.Tensor

__all__ = [
    "COMM_TYPES",
    "context_parallel_attn_func",
    "context_parallel_varlen_attn_func",
    "thd_positions_for_cp_rank",
    "concat_ranges",
    "check_thd_cp_lengths",
    "split_for_cp_rank",
    "gather_from_cp_ranks",
    "cp_chunk_ids",
]

COMM_TYPES = ("p2p", "a2a")

_KV_TAG = 1917  # point-to-point tags keep the K/V and the dK/dV hops apart
_DKV_TAG = 1918


# ---- layout --------------------------------------------------------------------------------


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two sequence chunks (out of ``2*cp_size``) rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_for_cp_rank(x: Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> Tensor:
    """Rank ``cp_rank``'s part of ``x`` along ``seq_dim``: chunks r and 2cp-1-r of 2cp.

    Megatron's ``get_batch_on_this_cp_rank`` split. Raises ValueError when the length is not
    divisible by ``2*cp_size``.
    """
    seq = x.shape[seq_dim]
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside a context-parallel group of size {cp_size}")
    if seq % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq} is not divisible by 2 * context-parallel size = {2 * cp_size} "
            "(each rank holds two equal chunks)"
        )
    if cp_size == 1:
        return x
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=seq_dim)


def gather_from_cp_ranks(parts: list[Tensor], seq_dim: int) -> Tensor:
    """Inverse of :func:`split_for_cp_rank`: every rank's part (rank order) -> the whole."""
    cp_size = len(parts)
    chunks: list[Optional[Tensor]] = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        first, second = cp_chunk_ids(cp_size, rank)
        chunks[first], chunks[second] = part.chunk(2, dim=seq_dim)
    return torch.cat(chunks, dim=seq_dim)


def thd_positions_for_cp_rank(cu_seqlens: list[int], cp_size: int, cp_rank: int) -> Tensor:
    """Rank ``cp_rank``'s rows of a pack of documents: their positions in the whole pack.

    Transformer Engine's THD split (and megatron-core's THD RoPE): every document (length
    ``cu_seqlens[i+1] - cu_seqlens[i]``, divisible by ``2*cp_size``) is cut into ``2*cp``
    equal chunks and the rank takes chunks ``r`` and ``2cp-1-r`` of EVERY document, in
    document order (``cp_size == 1``: every row). Returns int64 ``[cu_seqlens[-1] // cp_size]``.
    """
    if cp_size == 1:
        return torch.arange(cu_seqlens[-1])
    check_thd_cp_lengths(cu_seqlens, cp_size)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    starts, lengths = [], []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        chunk = (end - start) // (2 * cp_size)
        starts += [start + first * chunk, start + second * chunk]
        lengths += [chunk, chunk]
    return concat_ranges(starts, lengths)


def concat_ranges(starts: list[int], lengths: list[int]) -> Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a loop of
    tensor ops (packs hold thousands of documents). int64."""
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    total = int(lengths_t.sum())
    segment_starts = torch.cumsum(lengths_t, 0) - lengths_t
    offsets = torch.arange(total) - torch.repeat_interleave(segment_starts, lengths_t, output_size=total)
    return torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64), lengths_t, output_size=total) + offsets


def check_thd_cp_lengths(cu_seqlens: list[int], cp_size: int) -> None:
    """Every document of a pack split over ``cp_size`` ranks must be a multiple of ``2*cp``."""
    lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    bad = [n for n in lengths if n % (2 * cp_size)]
    if bad:
        raise ValueError(
            f"packed documents of lengths {bad[:6]} are not multiples of 2 x context-parallel size = "
            f"{2 * cp_size}: pad every document to a multiple of {2 * cp_size} "
            "(mcore_flash.transformer.packed_sequences does; cu_seqlens_q_padded holds the padded lengths)"
        )


# ---- public entry point ----------------------------------------------------------------------


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
    """Attention over a sequence split across ``group`` (see the module docstring).

    Args:
        q: ``[b, s_local, hq, d]``; k, v: ``[b, s_local, hkv, d]`` -- this rank's chunks
            ``r`` and ``2cp-1-r`` of ``2cp`` (:func:`split_for_cp_rank`), ``s_local`` even
            (``layout="sbhd"``: ``[s_local, b, h, d]``).
        group: the context-parallel process group (None or size 1: plain attention).
        causal: causal over the WHOLE sequence (positions from the chunk layout).
        window_size: flash-attn's ``(left, right)`` sliding window over the whole sequence;
            the ring skips the chunk pairs it misses.
        alibi_slopes: ``[hq]`` or ``[b, hq]``; distances are global positions (the ring
            gives each chunk pair its shift, Ulysses each rank its heads' slopes).
        comm_type: ``"p2p"`` (ring) or ``"a2a"`` (Ulysses all-to-all over heads).
        Other arguments (``softcap``, ``deterministic``, ...) as in
        :func:`mcore_flash.ops.flash_attn_func`.

    Returns:
        ``out`` (q's layout), or ``(out, lse [b, hq, s_local])``.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"comm_type={comm_type!r} is not supported; choose one of {COMM_TYPES}")
    cp_size = 1 if group is None else group.size()
    if cp_size == 1:
        return flash_attn_func(
            q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            backend=backend, return_lse=return_lse, layout=layout,
        )  # fmt: skip
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
        q, causal, softmax_scale, dropout_p, backend, layout=layout, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, batch=q.shape[layout.index("b")],
    )  # fmt: skip
    impl.check_inputs(q, k, v, params)
    if comm_type == "a2a":
        out, lse = _ulysses(q, k, v, group, _DenseSequence(impl, _heads_of_rank(params, group), cp_size))
    else:
        out, lse = _RingAttention.apply(q, k, v, group, _DenseBlocks(impl, params, q.shape[seq]))
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
            :func:`thd_positions_for_cp_rank` (chunks ``r`` and ``2cp-1-r`` of every document).
        cu_seqlens: int ``[num_docs + 1]`` cumulative document lengths over the WHOLE pack
            (``cu_seqlens[-1] == cp * t_local``), each a multiple of ``2*cp``.
        window_size: a sliding window within each document.
        alibi_slopes: ``[hq]`` or ``[num_docs, hq]``; distances within each document.
        Other arguments as in :func:`context_parallel_attn_func`.

    Ring (p2p): every hop is one varlen kernel call over all documents -- at step 0 the
    diagonal (causal, each document's local rows against themselves), then every
    document's first halves as keys (``src < r``) or second halves as queries
    (``src > r``), unmasked. With a window every hop is split into its chunk pairs as for
    one sequence, but a document's chunk is ``len / 2cp`` rows, so the shifted band differs
    between documents: each document's pair is cut (:func:`_pair_cut`), each pair runs one
    varlen call per group of documents whose cuts share a band, and documents the band
    misses are skipped. With ALiBi every hop is split the same way, windowed or not, and
    documents are grouped by band and distance shift (which depends on the document's
    length: its pair is ``(a - b) * len / 2cp`` rows off the diagonal before the cut).
    Ulysses (a2a): the rows are gathered in position order and one varlen call runs over the
    whole pack.

    Returns:
        ``out [t_local, hq, d]``, or ``(out, lse [hq, t_local])``.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"comm_type={comm_type!r} is not supported; choose one of {COMM_TYPES}")
    cp_size = 1 if group is None else group.size()
    checks.check_qkv(q, k, v, packed=True)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"packed context parallelism is self-attention: q has {q.shape[0]} rows, k/v {k.shape[0]}")
    cu = checks.check_cu_seqlens(cu_seqlens, q.shape[0] * cp_size, q.shape[0] * cp_size, "cu_seqlens")
    if cp_size == 1:
        longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, longest, longest, dropout_p, softmax_scale, causal, window_size,
            softcap, alibi_slopes, deterministic, backend=backend, return_lse=return_lse,
        )  # fmt: skip
    check_thd_cp_lengths(cu, cp_size)
    impl, params = resolve_call(
        q, causal, softmax_scale, dropout_p, backend, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, deterministic=deterministic, batch=len(cu) - 1,
    )  # fmt: skip
    impl.check_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), params)
    if comm_type == "a2a":
        out, lse = _ulysses(q, k, v, group, _PackedSequence(impl, _heads_of_rank(params, group), cu, cp_size, q.device))
    else:
        local_cu = [n // cp_size for n in cu]
        blocks = _PackedBlocks(impl, params, local_cu, q.device)
        out, lse = _RingAttention.apply(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), group, blocks)
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out


# ---- ring (p2p) ------------------------------------------------------------------------------


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
Rows = Union[slice, Tensor]  # a slice of the local sequence, or the indices of its rows


RowsKey = Hashable  # names a set of local rows: "all", "first", "second", or a cut of a half
Block = tuple[RowsKey, RowsKey, AttentionParams]  # (query rows, kv rows, the params of that block's kernel)


def _ring_blocks(step: int, rank: int, size: int, params: AttentionParams) -> list[Block]:
    """The kernel calls of ring step ``step`` without chunk pairs: ``(query rows, kv rows,
    params)`` with rows ``"all"``, ``"first"`` (the rows of chunk ``r``) or ``"second"``
    (those of chunk ``2cp-1-r``); see the module docstring."""
    if not params.causal or step == 0:
        return [("all", "all", params)]  # step 0 is the diagonal block
    src = (rank - step) % size
    unmasked = params.with_band(None, None)
    if src < rank:
        return [("all", "first", unmasked)]  # kv chunk src precedes both query chunks, 2cp-1-src follows
    return [("second", "all", unmasked)]  # both kv chunks precede chunk 2cp-1-r only


def _by_chunk_pairs(params: AttentionParams) -> bool:
    """Whether a ring step must be split into its chunk pairs: a window's band, or ALiBi's
    distances, depend on where each chunk lies, not only on the causal order of chunks."""
    return params.window is not None or params.alibi_slopes is not None


def _chunk_pairs(step: int, rank: int, size: int) -> list[tuple[str, str, int]]:
    """``(query half, kv half, query chunk - kv chunk)`` of the four chunk pairs of step ``step``."""
    q_chunks = zip(("first", "second"), cp_chunk_ids(size, rank))
    kv_chunks = list(zip(("first", "second"), cp_chunk_ids(size, (rank - step) % size)))
    return [(q_half, kv_half, a - b) for q_half, a in q_chunks for kv_half, b in kv_chunks]


def _shifted_band(lo, hi, delta: int, c: int):
    """The local band of a ``c x c`` block ``delta`` rows below the diagonal, or None when no
    pair ``(i, j)`` of it is inside; sides it does not cut become None."""
    lo = None if lo is None else lo + delta
    hi = None if hi is None else hi + delta
    if (lo is not None and lo > c - 1) or (hi is not None and hi < -(c - 1)):
        return None
    lo = None if lo is not None and lo <= -(c - 1) else lo
    hi = None if hi is not None and hi >= c - 1 else hi
    return lo, hi


class _PairCut(NamedTuple):
    """The part of a chunk pair a band reaches: rows ``[first_row, first_row + n)`` of its
    query chunk against keys ``[first_key, first_key + n)`` of its kv chunk."""

    first_row: int
    first_key: int
    n: int
    band: tuple[Optional[int], Optional[int]]  # the band of that n x n block
    alibi_shift: int  # its ALiBi distance shift


def _pair_cut(params: AttentionParams, delta: int, c: int) -> Optional[_PairCut]:
    """The block of a ``c x c`` chunk pair ``delta`` rows below the global diagonal that holds
    every (query, key) pair inside ``params``' band, and no row without a key; None when the
    band misses the pair.

    Row ``i`` sees keys ``[i + lo, i + hi]``: a band below the diagonal (``hi < 0``) leaves
    the first ``-hi`` rows and the last ``-hi`` keys out, one above it (``lo > 0``) the first
    ``lo`` keys and the last ``lo`` rows. What is left is a square whose band holds its own
    diagonal: no kernel meets a row without keys (which TND calls and flash-attn's windows
    cannot compute) and no row is computed for nothing."""
    band = _shifted_band(*params.band(), delta, c)
    if band is None:
        return None
    lo, hi = band
    first_row = 0 if hi is None else max(0, -hi)
    first_key = 0 if lo is None else max(0, lo)
    n = c - first_row - first_key
    trim = first_row - first_key
    return _PairCut(first_row, first_key, n, _shifted_band(lo, hi, trim, n), delta + trim)


class _DenseBlocks:
    """Ring blocks of one dense sequence: this rank's ``s_local`` rows are chunk ``r`` then
    chunk ``2cp-1-r``, so the halves (and their cuts) are slices; kernels are the backend's
    dense ones."""

    def __init__(self, backend: AttentionBackend, params: AttentionParams, local_len: int):
        self.backend, self.params = backend, params
        self.seq = params.layout.index("s")
        self.half = local_len // 2
        self.rows = {"all": _ALL, "first": slice(0, self.half), "second": slice(self.half, None)}

    def _register(self, half: str, start: int, n: int) -> RowsKey:
        """The key of rows ``[start, start + n)`` of ``half``."""
        key = (half, start, n)
        if key not in self.rows:
            base = 0 if half == "first" else self.half
            self.rows[key] = slice(base + start, base + start + n)
        return key

    def plan(self, step: int, ring: "_Ring") -> list[Block]:
        if not _by_chunk_pairs(self.params):
            return _ring_blocks(step, ring.rank, ring.size, self.params)
        blocks = []  # the cut of each chunk pair the band reaches
        for q_half, kv_half, chunk_delta in _chunk_pairs(step, ring.rank, ring.size):
            cut = _pair_cut(self.params, chunk_delta * self.half, self.half)
            if cut is not None:
                q_rows = self._register(q_half, cut.first_row, cut.n)
                kv_rows = self._register(kv_half, cut.first_key, cut.n)
                blocks.append((q_rows, kv_rows, replace(self.params.with_band(*cut.band), alibi_shift=cut.alibi_shift)))
        return blocks

    def forward(self, q, k, v, q_rows: RowsKey, kv_rows: RowsKey, params: AttentionParams):
        return forward_kernel(self.backend, q, k, v, params)

    def backward(self, dout, q, k, v, out, stats, rng_state, q_rows: RowsKey, kv_rows: RowsKey, params: AttentionParams):
        return backward_kernel(self.backend, dout, q, k, v, out, stats, rng_state, params)


class _PackedBlocks:
    """Ring blocks of packed documents (THD seen as ``[1, t_local, h, d]``): each document's
    local rows are its chunk ``r`` then its chunk ``2cp-1-r``, so a half is an index set and
    kernels are the backend's varlen ones with the cumulative lengths of the rows taken."""

    def __init__(self, backend: AttentionBackend, params: AttentionParams, local_cu: list[int], device):
        self.backend, self.params, self.seq, self.device = backend, params, 1, device
        self.starts = local_cu[:-1]
        self.halves = [(end - start) // 2 for start, end in zip(local_cu[:-1], local_cu[1:])]
        self.rows, self.cu = {"all": _ALL}, {"all": local_cu}
        self.slopes: dict[tuple[int, ...], Tensor] = {}  # per-document ALiBi slopes of a group of documents
        for half in ("first", "second"):
            self._register(half, tuple((doc, 0, n) for doc, n in enumerate(self.halves)), key=half)

    def _register(self, half: str, spans: tuple[tuple[int, int, int], ...], key: Optional[RowsKey] = None) -> RowsKey:
        """The key of rows ``[start, start + n)`` of ``half`` of each document, for ``spans``
        of ``(document, start, n)`` (their row indices and cumulative lengths)."""
        key = (half, spans) if key is None else key
        if key not in self.rows:
            offsets = [self.starts[d] + (self.halves[d] if half == "second" else 0) + start for d, start, _ in spans]
            lengths = [n for _, _, n in spans]
            self.rows[key] = concat_ranges(offsets, lengths).to(self.device)
            self.cu[key] = [0]
            for n in lengths:
                self.cu[key].append(self.cu[key][-1] + n)
        return key

    def plan(self, step: int, ring: "_Ring") -> list[Block]:
        if not _by_chunk_pairs(self.params):
            return _ring_blocks(step, ring.rank, ring.size, self.params)
        return self._pair_plan(step, ring.rank, ring.size)

    def _pair_plan(self, step: int, rank: int, size: int) -> list[Block]:
        """Each chunk pair of step ``step`` once per group of documents whose cuts
        (:func:`_pair_cut`) get the same band (and, with ALiBi, the same distance shift)."""
        alibi = self.params.alibi_slopes is not None
        blocks = []
        for q_half, kv_half, chunk_delta in _chunk_pairs(step, rank, size):
            groups: dict[tuple, list[tuple[int, _PairCut]]] = {}
            for doc, chunk in enumerate(self.halves):
                cut = _pair_cut(self.params, chunk_delta * chunk, chunk) if chunk else None
                if cut is not None:
                    groups.setdefault((cut.band, cut.alibi_shift if alibi else 0), []).append((doc, cut))
            for (band, shift), cuts in groups.items():
                q_rows = self._register(q_half, tuple((doc, cut.first_row, cut.n) for doc, cut in cuts))
                kv_rows = self._register(kv_half, tuple((doc, cut.first_key, cut.n) for doc, cut in cuts))
                block_params = replace(self.params.with_band(*band), alibi_shift=shift)
                blocks.append((q_rows, kv_rows, self._with_slopes_of(block_params, tuple(doc for doc, _ in cuts))))
        return blocks

    def forward(self, q, k, v, q_rows: RowsKey, kv_rows: RowsKey, params: AttentionParams):
        out, stats, rng_state = self.backend.varlen_forward(q[0], k[0], v[0], self.cu[q_rows], self.cu[kv_rows], params)
        return out.unsqueeze(0), stats, rng_state

    def backward(self, dout, q, k, v, out, stats, rng_state, q_rows: RowsKey, kv_rows: RowsKey, params: AttentionParams):
        grads = self.backend.varlen_backward(
            dout[0], q[0], k[0], v[0], out[0], stats, rng_state, self.cu[q_rows], self.cu[kv_rows], params
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


def _per_token(weight: Tensor, layout: str) -> Tensor:
    """``[b, h, s]`` -> broadcastable against ``[b, s, h, d]`` (bshd) or ``[s, b, h, d]`` (sbhd)."""
    weight = weight.permute(0, 2, 1) if layout == "bshd" else weight.permute(2, 0, 1)
    return weight.unsqueeze(-1)


def _merge(out_acc: Tensor, acc: SoftmaxStats, out: Tensor, new: SoftmaxStats, layout: str) -> tuple[Tensor, SoftmaxStats]:
    """Fold one block's ``(out, stats)`` into the fp32 accumulator rows ``out_acc``; returns
    the merged rows and their statistics (see the module docstring)."""
    m_acc, m_new = acc.row_max, new.row_max
    s_acc = 1.0 if acc.row_sum is None else acc.row_sum
    s_new = 1.0 if new.row_sum is None else new.row_sum
    m = torch.maximum(m_acc, m_new)
    safe = torch.where(torch.isneginf(m), 0.0, m)  # rows nothing was visible to yet
    w_acc, w_new = s_acc * torch.exp(m_acc - safe), s_new * torch.exp(m_new - safe)
    total = w_acc + w_new

    def per_token(x):  # one value per row ([b, h, s], or its first copy of [b, h, s, 8])
        return _per_token(x[..., 0] if x.dim() == 4 else x, layout)

    denominator = per_token(torch.where(total > 0, total, 1.0))
    merged = (out_acc * per_token(w_acc) + out.to(out_acc.dtype) * per_token(w_new)) / denominator
    if acc.row_sum is None:
        return merged, SoftmaxStats(torch.where(total > 0, m + torch.log(total), float("-inf")))
    return merged, SoftmaxStats(m, total)


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _set_rows(stats: SoftmaxStats, rows: Rows, value: SoftmaxStats) -> None:
    for target, source in zip(stats.tensors(), value.tensors()):
        target[:, :, rows] = source


class _RingAttention(torch.autograd.Function):
    """Ring attention over ``blocks`` (:class:`_DenseBlocks` or :class:`_PackedBlocks`);
    saves only the local q, k, v, merged out and merged statistics."""

    @staticmethod
    def forward(ctx, q, k, v, group, blocks):
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
                    _take(q, rows, seq), _take(kv[0], cols, seq), _take(kv[1], cols, seq), q_rows, kv_rows, block_params
                )
                rng_states[-1].append(rng_state)
                if out_acc is None and q_rows == "all":  # a first block that covers every row
                    out_acc, stats_acc = out.to(_accumulator_dtype(q.dtype)), stats
                    continue
                if out_acc is None:
                    out_acc, stats_acc = _empty_accumulators(q, v, stats, seq)
                acc_rows = _take(out_acc, rows, seq), stats_acc.rows(rows)
                merged, merged_stats = _merge(*acc_rows, out, stats, params.layout)
                _put(out_acc, rows, seq, merged)
                _set_rows(stats_acc, rows, merged_stats)
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
        blocks = ctx.blocks
        ring, seq = _Ring(ctx.group), blocks.seq
        acc_dtype = _accumulator_dtype(q.dtype)
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
            for (q_rows, kv_rows, block_params), rng_state in zip(blocks.plan(step, ring), ctx.rng_states[step]):
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
            dkv_requests = ring.hop(dkv, dkv_incoming, _DKV_TAG)  # after the last step: to its owner
            if step + 1 < ring.size:
                _wait(kv_requests)
                kv = kv_incoming
        _wait(dkv_requests)
        dk, dv = dkv_incoming[0].to(k.dtype), dkv_incoming[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None


def _empty_accumulators(q: Tensor, v: Tensor, like: SoftmaxStats, seq: int) -> tuple[Tensor, SoftmaxStats]:
    """fp32 zeros shaped like the output and statistics of rows that have seen no key yet
    (``-inf`` maxima, zero sums), shaped like ``like`` with every local row."""
    shape = list(q.shape)
    shape[-1] = v.shape[-1]
    out = torch.zeros(shape, dtype=_accumulator_dtype(q.dtype), device=q.device)
    rows = q.shape[seq]
    shape = (*like.row_max.shape[:2], rows, *like.row_max.shape[3:])
    row_max = torch.full(shape, float("-inf"), dtype=like.row_max.dtype, device=q.device)
    row_sum = None if like.row_sum is None else torch.zeros(row_max.shape, dtype=like.row_sum.dtype, device=q.device)
    return out, SoftmaxStats(row_max, row_sum)


# ---- Ulysses (a2a) ---------------------------------------------------------------------------


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


class _DenseSequence:
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
        return out, _per_token(lse, self.params.layout)

    def lse_from_tokens(self, lse: Tensor) -> Tensor:
        """``[.., s_local, .., h, 1]`` -> ``[b, h, s_local]``."""
        lse = lse.squeeze(-1)
        return (lse.permute(0, 2, 1) if self.params.layout == "bshd" else lse.permute(1, 2, 0)).contiguous()


class _PackedSequence:
    """Ulysses over packed documents ``[t, h, d]``: the gathered rows come in rank order
    (rank r's parts of every document) and are put in position order by one index map;
    one varlen kernel call over the whole pack."""

    def __init__(self, backend: AttentionBackend, params: AttentionParams, cu_seqlens: list[int], cp_size: int, device):
        self.backend, self.params, self.cu = backend, params, cu_seqlens
        self.seq, self.heads = 0, 1
        positions = torch.cat([thd_positions_for_cp_rank(cu_seqlens, cp_size, r) for r in range(cp_size)])
        self.rank_order = positions.to(device)  # rank-order row j holds position rank_order[j]
        self.position_order = torch.argsort(positions).to(device)

    def to_positions(self, x: Tensor) -> Tensor:
        return x.index_select(0, self.position_order)

    def to_ranks(self, x: Tensor) -> Tensor:
        return x.index_select(0, self.rank_order)

    def attend(self, q, k, v) -> tuple[Tensor, Tensor]:
        out, lse = _FlashAttnVarlenFunction.apply(q, k, v, self.cu, self.cu, self.backend, self.params, None)
        return out, lse.t().unsqueeze(-1)  # [h, t] -> [t, h, 1]

    def lse_from_tokens(self, lse: Tensor) -> Tensor:
        return lse.squeeze(-1).t().contiguous()  # [t_local, h, 1] -> [h, t_local]


def _heads_of_rank(params: AttentionParams, group) -> AttentionParams:
    """``params`` for this rank's share of the heads after Ulysses' all-to-all (the
    ``rank``-th of ``cp`` equal head chunks): its columns of the ALiBi slopes."""
    slopes = params.alibi_slopes
    if slopes is None:
        return params
    share = slopes.shape[-1] // group.size()  # _ulysses refuses heads that do not divide
    rank = group.rank()
    return replace(params, alibi_slopes=slopes[..., rank * share : (rank + 1) * share].contiguous())


def _ulysses(q, k, v, group, sequence) -> tuple[Tensor, Tensor]:
    """All-to-all from sequence to heads, one kernel call, and back (``sequence``:
    :class:`_DenseSequence` or :class:`_PackedSequence`)."""
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
