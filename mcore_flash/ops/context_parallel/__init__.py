"""Context-parallel attention: the sequence is split over the ranks of a process group.

Knows nothing of Megatron: it takes a ``torch.distributed`` ProcessGroup (Megatron's CP
group, or any other) and calls the backend kernels of :mod:`mcore_flash.ops.backends`.

    from mcore_flash.ops.context_parallel import context_parallel_attn_func, split_for_cp_rank

    q_local = split_for_cp_rank(q, seq_dim=1, cp_size=cp, cp_rank=rank)   # same for k, v
    out_local = context_parallel_attn_func(q_local, k_local, v_local, group, causal=True)

Layout (:mod:`.layout`, Megatron's ``get_batch_on_this_cp_rank``): the sequence is cut into
``2*cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2*cp-1-r``, concatenated, so
every rank gets the same causal work. Tensors use the layouts of :mod:`mcore_flash.ops.api`:
``"bshd"`` (``q [b, s_local, hq, d]``, ``k``/``v`` ``[b, s_local, hkv, d]``) or Megatron's
``"sbhd"`` (sequence first: the ring's row blocks are then contiguous slices).

Two algorithms (``comm_type``), each with a dense and a packed strategy behind one
``typing.Protocol``:

``"p2p"`` -- ring attention (:mod:`.ring`; :class:`~.ring.RingBlocks`): K/V blocks travel
around the ring while the current block is computed; each step's blocks (the chunk pairs a
causal mask, a sliding window or ALiBi's distances need, :mod:`.ring_plan`) run one kernel
call each, and the partial results merge in fp32 (:mod:`.merge`). Saved bytes per rank are
``1/cp`` of the unsplit ones.

``"a2a"`` -- Ulysses (:mod:`.ulysses`; :class:`~.ulysses.UlyssesSequence`): an all-to-all
turns ``[b, s_local, h, d]`` into ``[b, s_total, h/cp, d]``, one fused kernel call runs, and
the inverse all-to-all returns ``[b, s_local, h, d]``.

Packed documents (THD, :func:`context_parallel_varlen_attn_func`): every document is split
into ``2*cp`` chunks and rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of EVERY document
(:func:`thd_positions_for_cp_rank`, Transformer Engine's scheme), so the rule above holds per
document: the ring's halves become index sets and every block is one varlen kernel call over
all documents (with a window or ALiBi: one per group of documents whose cut pairs share a
band and shift); Ulysses gathers the rows and puts them in position order by one index map.
Documents must be padded to multiples of ``2*cp``. Neither algorithm takes an explicit
attention mask.

Modules, each importing only modules listed before it: :mod:`.layout` (who holds which rows,
no communication), :mod:`.merge` (partial results and their statistics), :mod:`.ring_plan`
(which blocks a ring step computes), :mod:`.ring` and :mod:`.ulysses` (the algorithms),
:mod:`.api` (the entry points, re-exported here).
"""

from .api import COMM_TYPES, context_parallel_attn_func, context_parallel_varlen_attn_func
from .layout import (
    check_thd_cp_lengths,
    concat_ranges,
    cp_chunk_ids,
    gather_from_cp_ranks,
    split_for_cp_rank,
    thd_positions_for_cp_rank,
)

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
