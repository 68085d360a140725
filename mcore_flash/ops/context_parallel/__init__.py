"""Context-parallel attention: the sequence is split over the ranks of a process group.

Knows nothing of Megatron: it takes a ``torch.distributed`` ProcessGroup (Megatron's CP
group, or any other) and calls the backend kernels of :mod:`mcore_flash.ops.backends`.

    from mcore_flash.ops.context_parallel import context_parallel_attn_func, split_for_cp_rank

    q_local = split_for_cp_rank(q, seq_dim=1, cp_size=cp, cp_rank=rank)   # same for k, v
    out_local = context_parallel_attn_func(q_local, k_local, v_local, group, causal=True)

Layout (Megatron's ``get_batch_on_this_cp_rank``): of ``2*cp`` equal chunks rank ``r`` holds
chunks ``r`` and ``2*cp-1-r`` (packed: of every document, each padded to a multiple of ``2*cp``;
:func:`thd_positions_for_cp_rank`), in the layouts of :mod:`mcore_flash.ops.api`. ``comm_type``
``"p2p"`` is ring attention (:mod:`.ring`), ``"a2a"`` Ulysses (:mod:`.ulysses`); neither takes
an explicit mask. How they work: ``docs/megatron-spec.md``, "Context parallelism".

Modules, each importing only those before it: :mod:`.layout` (who holds which rows, no
communication), :mod:`.merge` (partial results and their statistics), :mod:`.ring_plan` (which
blocks a ring step computes), :mod:`.ring`, :mod:`.ulysses`, :mod:`.api` (re-exported here).
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
