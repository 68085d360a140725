"""The HCCL communicators the trainer opens equal the planner's (issue 47, HCCL's buffers).

Each communicator holds 2 x ``HCCL_BUFFSIZE`` (point-to-point ones 2 x
``P2P_HCCL_BUFFSIZE``) of device memory outside the allocator, so the planner counts them:
:func:`~mcore_flash.planning.communicators.stage_communicators`. Here the trainer runs on
the emulated NPU, whose HCCL-strict groups record every communicator the way torch_npu's
``ProcessGroupHCCL`` keys them (:func:`mcore_flash.emulation.hccl.communicators`: one
collective communicator per group, one point-to-point communicator per peer pair of a group
for a send/recv outside ``batch_isend_irecv``). Per run and rank, from before megatron's
groups are made to the end of the first iteration (set-up, ``train_step``, the loop's stop
agreement), the groups of each kind, by megatron's names, equal the planner's for that
rank's pipeline stage; the worst rank's counts equal :func:`hccl_communicators`'; a checkpoint
save after it opens none more.

Two launches, each a few runs in one process (start-up dominates on 2 cores): 4 ranks for
TP2 x DP2 (distributed optimizer) and TP2 x CP2 with sequence parallelism (ring attention,
no distributed optimizer), 2 ranks for PP2 (1F1B) and Megatron-FSDP at DP2. Measured on
2 cores shared with other work (load ~14): 20 s and 7 s; the recorder's own check 3 s.
"""

from __future__ import annotations

import pytest

from mcore_flash.planning import Layout, get_model
from mcore_flash.planning.communicators import hccl_communicators, stage_communicators

from _support.dist_utils import retried_after_a_lost_rank, run_distributed
from _support.pretrain_flags import tiny_flags

TINY = tiny_flags(micro_batch_size=1, train_iters=2)  # one iteration runs; warm-up needs 2
MODEL = get_model("tiny")  # the trainer's default preset: untied embeddings
TP2 = ["--tensor-model-parallel-size", "2"]

# name -> (ranks, the layout, its flags on top of TINY)
LAYOUTS = {
    "tp2-dp2": (
        4,
        Layout(tp=2, dp=2, sequence_parallel=False),
        [*TP2, "--use-distributed-optimizer"],
    ),
    "tp2-cp2-sp": (
        4,
        Layout(tp=2, cp=2, distributed_optimizer=False),
        [*TP2, "--context-parallel-size", "2", "--sequence-parallel"],
    ),
    "pp2": (2, Layout(pp=2, distributed_optimizer=False), ["--pipeline-model-parallel-size", "2"]),
    "fsdp-dp2": (2, Layout(dp=2, fsdp="optim_grads_params"), ["--use-megatron-fsdp"]),
}


def _names(communicators) -> dict:
    """The recorded communicators as the planner names them: the sorted ``group_desc`` of
    each collective one and of each point-to-point one's group."""
    return {
        "collective": sorted(group.desc for group in communicators.collective),
        "p2p": sorted(group.desc for group, _pair in communicators.p2p),
    }


def w_communicators(rank, world_size, runs, save_root):
    """Worker: ``{name: {"stage", "step", "saved"}}`` of this rank, each run's communicators
    (:func:`_names`) after its first iteration and after a save, recorded from before its
    megatron groups were made; ``stage`` is the rank's pipeline stage."""
    from megatron.core import parallel_state

    from mcore_flash.emulation import hccl
    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training import loop

    results = {}
    for name, flags in runs:
        hccl.reset_communicators()
        config = parse_config([*TINY, *flags, "--save", f"{save_root}/{name}"])
        distributed.init_distributed(config)
        recipe = loop.PretrainRecipe(config)
        try:
            loss, _, _ = recipe.train_step()
            recipe._agree_after_step(loss)  # what train() runs after every step
            step = _names(hccl.communicators())
            recipe.save()
            results[name] = {
                "stage": parallel_state.get_pipeline_model_parallel_rank(),
                "step": step,
                "saved": _names(hccl.communicators()),
            }
        finally:
            recipe.cleanup()
            parallel_state.destroy_model_parallel()
            del recipe
    return results


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """``measured(name)``: every rank's result (rank order) of the launch that runs
    ``name``; one launch per world size, on first need."""
    launches = {}

    def per_rank(name: str) -> list:
        world_size = LAYOUTS[name][0]
        if world_size not in launches:
            runs = [(n, flags) for n, (size, _, flags) in LAYOUTS.items() if size == world_size]
            root = str(tmp_path_factory.mktemp(f"ranks{world_size}"))
            launches[world_size], _ = retried_after_a_lost_rank(
                lambda at: run_distributed(
                    w_communicators, world_size, runs, at, emulate_npu=True, timeout=600
                ),
                root,
            )
        return [ranks[name] for ranks in launches[world_size]]

    return per_rank


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planned_hccl_communicators_equal_those_a_training_step_opens(name, measured):
    _, layout, _ = LAYOUTS[name]
    per_rank = measured(name)
    for rank, result in enumerate(per_rank):
        planned = stage_communicators(layout, MODEL, result["stage"])
        want = {"collective": list(planned.collective), "p2p": list(planned.p2p)}
        assert result["step"] == want, f"{name}, rank {rank} (stage {result['stage']})"
        assert result["saved"] == result["step"], f"{name}, rank {rank}: the save opened more"
    worst = max(
        (len(r["step"]["collective"]), len(r["step"]["p2p"])) for r in per_rank
    )  # the rank with the most collective communicators, then point-to-point ones
    planned = hccl_communicators(layout, MODEL)
    assert worst == (planned.num_collective, planned.num_p2p), name


def w_recorded(rank, world_size):
    """Worker: the communicators (:func:`_names`) of a send/recv pair, of the same pair in a
    ``batch_isend_irecv``, and of a send/recv pair with ``P2P_HCCL_BUFFSIZE=0``, each on a
    group of its own (``group_desc`` "SINGLE", "BATCHED", "ZERO") recorded from a reset."""
    import os

    import torch
    import torch.distributed as dist

    from mcore_flash.emulation import hccl

    peer = 1 - rank
    tensor = torch.ones(4, device="npu")

    def exchange(group):
        for op in (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send):
            op(tensor, peer, group=group)

    def batched(group):
        ops = [
            dist.P2POp(dist.isend, tensor, peer, group),
            dist.P2POp(dist.irecv, tensor.clone(), peer, group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    recorded = {}
    for desc, run in (("SINGLE", exchange), ("BATCHED", batched), ("ZERO", exchange)):
        group = dist.new_group([0, 1], group_desc=desc)
        if desc == "ZERO":
            os.environ["P2P_HCCL_BUFFSIZE"] = "0"
        hccl.reset_communicators()
        run(group)
        recorded[desc] = _names(hccl.communicators())
    return recorded


def test_the_emulated_hccl_records_communicators_as_torch_npu_keys_them():
    """torch_npu's ``ProcessGroupHCCL``: a send/recv outside a batch opens a point-to-point
    communicator (``pointToPoint``, ``HcclCommType::P2P``); in ``batch_isend_irecv`` and with
    ``P2P_HCCL_BUFFSIZE=0`` it runs on the group's collective communicator."""
    for recorded in run_distributed(w_recorded, 2, emulate_npu=True):
        assert recorded == {
            "SINGLE": {"collective": [], "p2p": ["SINGLE"]},
            "BATCHED": {"collective": ["BATCHED"], "p2p": []},
            "ZERO": {"collective": ["ZERO"], "p2p": []},
        }
