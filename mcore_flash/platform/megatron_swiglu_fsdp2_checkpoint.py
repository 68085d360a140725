"""Every device: the checkpoint of a SwiGLU ``linear_fc1`` that torch FSDP2 shards over data
parallel ranks.

Answers ``transformer/mlp.py: apply_swiglu_sharded_factory`` of megatron-core 0.16-0.18
(0.19 takes the data-parallel group and maps the shards itself). ``linear_fc1.weight`` of a
tensor-parallel rank is ``[W; V]`` (gate rows, then up rows, ``H`` each); the checkpoint
holds all ranks' ``W`` rows, then all their ``V`` rows. megatron's factory cuts the local
tensor in two halves and places them as the ``W`` and ``V`` of this rank, which is right for
a tensor-parallel shard; FSDP2 hands it a data-parallel piece of ``[W; V]`` instead (``2H /
dp`` rows, ``make_tp_sharded_tensor_for_checkpoint`` numbers it ``tp_rank * dp + dp_rank``
of ``tp * dp``), so each piece's halves land in the wrong places: every ``linear_fc1`` of a
``--use-torch-fsdp2`` run at data x context parallel size > 1 reads back scrambled into any
other layout (resuming the same layout hides it; export and resharding do not).

Here such a piece is placed whole where its rows belong: with ``dp`` even each piece lies in
``W`` or in ``V``; piece ``d`` of tensor-parallel rank ``t`` is ``W`` piece ``t * dp/2 + d``
for ``d < dp/2`` and ``V`` piece ``t * dp/2 + d - dp/2`` after all ``W`` pieces otherwise. An
odd size would split a piece across the halves, which a checkpoint of equal pieces cannot
hold: refused with the fix.
"""

from __future__ import annotations

import functools
import inspect

from ._common import once


def _fsdp2_aware(factory):
    @functools.wraps(factory)
    def apply_swiglu_sharded_factory(original_sh_ten, sharded_offsets, *args, **kwargs):
        from megatron.core import parallel_state

        axis = len(sharded_offsets)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        if dp == 1 or original_sh_ten.axis_fragmentations[axis] != tp * dp:
            return factory(original_sh_ten, sharded_offsets, *args, **kwargs)
        return _data_parallel_piece(original_sh_ten, sharded_offsets, tp, dp)

    apply_swiglu_sharded_factory.__mcore_flash__ = True
    return apply_swiglu_sharded_factory


def _data_parallel_piece(original_sh_ten, sharded_offsets, tp: int, dp: int):
    """The ``ShardedTensor`` of this rank's FSDP2 piece of ``[W; V]`` at its place in the
    checkpoint's ``[W of every TP rank; V of every TP rank]`` (``tp * dp`` equal pieces)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    axis = len(sharded_offsets)
    rows = original_sh_ten.local_shape[0]
    if dp % 2 or original_sh_ten.global_offset[axis] % rows:
        raise ValueError(
            f"--use-torch-fsdp2 at data x context parallel size {dp} cuts {original_sh_ten.key} "
            "(a SwiGLU linear_fc1: gate rows, then up rows) into pieces that straddle the two "
            "halves, which megatron-core before 0.19 cannot checkpoint: use an even data-parallel "
            "size or megatron-core 0.19"
        )
    piece = original_sh_ten.global_offset[axis] // rows
    tp_rank, dp_rank = divmod(piece, dp)
    half = dp // 2
    is_up, index_in_half = divmod(dp_rank, half)
    place = is_up * tp * half + tp_rank * half + index_in_half
    return ShardedTensor.from_rank_offsets(
        original_sh_ten.key,
        original_sh_ten.data,
        *sharded_offsets,
        (axis, place, tp * dp),
        replica_id=original_sh_ten.replica_id,
        prepend_axis_num=axis,
    )


@once
def megatron_swiglu_fsdp2_checkpoint():
    """megatron's SwiGLU checkpoint factory places FSDP2's data-parallel pieces right
    (megatron-core 0.16-0.18; 0.19 maps them itself: nothing to adapt)."""
    try:
        from megatron.core.transformer import mlp
    except ImportError:
        return False
    factory = mlp.apply_swiglu_sharded_factory
    if "dp_group" in inspect.signature(factory).parameters:
        return False
    if not getattr(factory, "__mcore_flash__", False):
        mlp.apply_swiglu_sharded_factory = _fsdp2_aware(factory)
