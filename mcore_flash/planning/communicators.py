"""The HCCL communicators a training rank opens, and the device memory they hold outside
any allocator (issue 47).

:func:`stage_communicators` names the groups a rank of a pipeline stage opens a collective
communicator on and those of its point-to-point communicators (its docstring: each rule
with the megatron-core 0.16.1 or ``mcore_flash/training`` code it answers to);
:func:`hccl_communicators` picks the layout's worst rank; :meth:`HcclCommunicators.buffer_bytes`
gives the device bytes they hold: 2 x ``HCCL_BUFFSIZE`` per collective communicator, 2 x
``P2P_HCCL_BUFFSIZE`` per point-to-point one (bytes; MB = 2**20 bytes). Groups count by
name (megatron's ``group_desc``), not by ranks: two process groups of the same ranks hold
communicators of their own. The rules are measured on the emulated NPU, whose HCCL-strict
groups record each communicator as torch_npu keys it (``mcore_flash/emulation/hccl.py``,
tests/emulation/test_hccl_communicators.py). Pure Python: no torch, no megatron. The
sources (CANN's HCCL guide, torch_npu's ``ProcessGroupHCCL``) and the assumptions:
docs/planner.md ("HCCL's buffers").
"""

from __future__ import annotations

from dataclasses import dataclass

from .models import ModelShape
from .parallel_layout import Layout
from .units import MiB

__all__ = [
    "P2P_HCCL_BUFFSIZE_BYTES",
    "HcclCommunicators",
    "stage_communicators",
    "hccl_communicators",
]

# P2P_HCCL_BUFFSIZE's default: OptionsManager::GetP2PBufferSize (20 MB; torch_npu's
# core/npu/register/OptionsManager.cpp). HCCL_BUFFSIZE's (200 MB: the HCCL guide and
# OptionsManager::GetHcclBufferSize) is the 910B profile's communicator_buffer_bytes / 2
P2P_HCCL_BUFFSIZE_BYTES = 20 * MiB

WORLD = "default_pg"  # torch's group_desc of the default group; megatron's own below
TP = "TENSOR_MODEL_PARALLEL_GROUP"
PP = "PIPELINE_MODEL_PARALLEL_GROUP"
CP = "CONTEXT_PARALLEL_GROUP"
DP_CP = "DATA_PARALLEL_GROUP_WITH_CP"
MP = "MODEL_PARALLEL_GROUP"
DIST_OPT = "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP"
EMBEDDING = "EMBEDDING_GROUP"


@dataclass(frozen=True)
class HcclCommunicators:
    """The HCCL communicators of one rank of pipeline stage ``stage``: ``collective`` names
    each group with a collective communicator (``HCCL_BUFFSIZE``), ``p2p`` the group of
    each point-to-point communicator (``P2P_HCCL_BUFFSIZE``; a group appears once per peer
    pair). Names are the groups' ``group_desc`` (megatron's ``parallel_state`` names;
    ``"default_pg"`` the world), both sorted. Every ``p2p`` group is also in ``collective``,
    so with ``P2P_HCCL_BUFFSIZE=0`` (point-to-point on the collective communicators) the
    communicators are ``collective`` alone."""

    stage: int
    collective: tuple[str, ...]
    p2p: tuple[str, ...]

    @property
    def num_collective(self) -> int:
        return len(self.collective)

    @property
    def num_p2p(self) -> int:
        return len(self.p2p)

    def buffer_bytes(self, hccl_buffsize_bytes: int, p2p_buffsize_bytes: int) -> int:
        """Device bytes these communicators hold: 2 x ``HCCL_BUFFSIZE`` each collective one,
        2 x ``P2P_HCCL_BUFFSIZE`` each point-to-point one (0 bytes: none are opened)."""
        return 2 * (self.num_collective * hccl_buffsize_bytes + self.num_p2p * p2p_buffsize_bytes)


def stage_communicators(layout: Layout, model: ModelShape, stage: int) -> HcclCommunicators:
    """The communicators a rank of pipeline stage ``stage`` (0 .. ``layout.pp - 1``) opens by
    the end of its first training iteration (set-up, forward and backward of every
    micro-batch, the optimizer step, the loop's stop agreement) and holds for the process's
    life; a checkpoint save opens none more (measured). ValueError for a stage outside the
    pipeline.

    Collective communicators, each rule with the code it answers to:

    * ``default_pg``: every rank; the loop's stop agreement, a MAX all-reduce each iteration
      (``training/loop.py: _StopSignal.agreed``; with the built-in task also the barrier
      around writing its dataset, ``training/data.py``).
    * ``PIPELINE_MODEL_PARALLEL_GROUP``: every rank, at any ``pp`` (a 1-rank group at pp 1):
      ``finalize_model_grads`` broadcasts the token count over it
      (``megatron/core/distributed/finalize_model_grads.py``; the trainer's per-token loss,
      ``training/model.py: calculate_per_token_loss=True``).
    * ``DATA_PARALLEL_GROUP_WITH_CP``: every rank, at any ``dp x cp``: ``finalize_model_grads``
      all-reduces the token count over it; the gradient all-reduce (DDP), reduce-scatter and
      all-gather (distributed optimizer, Megatron-FSDP) run on the same group object
      (``parallel_state.initialize_model_parallel``: the intra-partial group IS it with one
      distributed-optimizer instance, the trainer's only setting), and so does the loss
      report (``training/loop.py: _reduce_loss``).
    * the gradient-statistics group of the norm's all-reduce
      (``optimizer/clip_grads.py: get_grad_norm_fp32``):
      ``INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP`` with the distributed optimizer or
      Megatron-FSDP, ``MODEL_PARALLEL_GROUP`` without
      (``optimizer/__init__.py: _get_megatron_optimizer_based_on_param_groups``).
    * ``TENSOR_MODEL_PARALLEL_GROUP``: every rank when ``tp > 1`` (the layers' collectives,
      ``tensor_parallel/mappings.py``, which skip a 1-rank group), and the last stage at
      any ``tp``: the vocab-parallel cross entropy all-reduces over it unconditionally
      (``tensor_parallel/cross_entropy.py: _VocabParallelCrossEntropy``).
    * ``CONTEXT_PARALLEL_GROUP`` when ``cp > 1``: ring attention's ``batch_isend_irecv`` or
      Ulysses' all-to-all (``ops/context_parallel/ring.py``, ``ulysses.py``) - batched, so
      on the collective communicator.
    * ``EMBEDDING_GROUP`` on the first and last stages when ``pp > 1`` and the embeddings
      are tied: the initial weight sync (``LanguageModule.setup_embeddings_and_output_layer``)
      and the gradient all-reduce (``finalize_model_grads._allreduce_word_embedding_grads``;
      skipped at pp 1, a 1-rank group). NOT MEASURED: megatron's ``weight.data =
      weight.data.cuda()`` there fails on the emulated NPU (a CPU parameter cannot take an
      emulated npu tensor's data), so this rule is megatron's code alone.

    Point-to-point communicators, the pipeline's only ones (the trainer sets
    ``batch_p2p_comm=False``: megatron's ``p2p_communication._p2p_ops`` posts single
    ``isend``/``irecv``; the shape exchange of packed documents is batched, on the pipeline
    group's collective communicator): none at ``pp`` 1. At ``pp`` 2 one pair on the pipeline
    group and one on ``default_pg``: ``_p2p_ops`` sends one direction over the world group
    when the pipeline group has 2 ranks. From ``pp`` 3 one per neighbour in the pipeline
    group: the first and last stages have one, except with the interleaved schedule
    (``vp > 1``), whose first stage also receives from the last (a ring).

    Not modelled: expert parallelism, several distributed-optimizer instances (the layout
    has neither), evaluation (``--eval-interval``: a forward on the groups above).
    """
    if not 0 <= stage < layout.pp:
        raise ValueError(
            f"stage {stage}: a pipeline stage of pp {layout.pp} is 0 .. {layout.pp - 1}"
        )
    first, last = stage == 0, stage == layout.pp - 1
    distributed_optimizer = layout.distributed_optimizer or layout.fsdp is not None
    collective = {WORLD, PP, DP_CP, DIST_OPT if distributed_optimizer else MP}
    if layout.tp > 1 or last:
        collective.add(TP)
    if layout.cp > 1:
        collective.add(CP)
    tied = not model.untie_embeddings_and_output_weights
    if tied and layout.pp > 1 and (first or last):
        collective.add(EMBEDDING)
    if layout.pp == 1:
        p2p = []
    elif layout.pp == 2:
        p2p = [PP, WORLD]
    elif (first or last) and layout.vp == 1:
        p2p = [PP]
    else:
        p2p = [PP, PP]
    return HcclCommunicators(stage, tuple(sorted(collective)), tuple(sorted(p2p)))


def hccl_communicators(layout: Layout, model: ModelShape) -> HcclCommunicators:
    """The communicators of the layout's worst rank: the stage with the most collective
    communicators, then the most point-to-point ones (the first such stage). Stages differ
    by at most one point-to-point communicator, so this rank holds the most bytes whenever
    ``HCCL_BUFFSIZE`` >= ``P2P_HCCL_BUFFSIZE`` (the defaults, 200 and 20 MB);
    the plan (:func:`.memory.collective_library_bytes`) counts each stage's own bytes."""
    stages = [stage_communicators(layout, model, stage) for stage in range(layout.pp)]
    return max(stages, key=lambda c: (c.num_collective, c.num_p2p, -c.stage))
