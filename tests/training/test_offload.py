"""``--optimizer-cpu-offload``: megatron-core's ``HybridDeviceOptimizer`` steps the optimizer state
on the host, on the emulated NPU (the CPU path has no device to offload from: refused); and
``--grad-reduce-in-bf16``, the narrower gradients a one-node plan needs.

Oracle: the same run without offload (bf16 parameters, the distributed optimizer): losses and grad norms must be identical, the offloaded state must
really sit on the host (tensor devices), and the device's byte counter (exact in the emulation)
must fall by exactly the bytes of the state that moved there. With bf16 host moments
(``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``, :mod:`mcore_flash.optim.host_adam`) the
moments are bf16 on the host, the device holds what it holds with fp32 moments, the first step
is the same and training stays within bf16's precision of the fp32-moment run.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from mcore_flash.runtime.arguments import parse_config
from mcore_flash.training import offload

from _support.dist_utils import run_distributed
from _support.recipe_runs import TINY, w_recipe_runs

DISTRIBUTED = ["--use-distributed-optimizer", "--bf16"]
OFFLOAD = [*DISTRIBUTED, "--use-precision-aware-optimizer", "--optimizer-cpu-offload"]
BF16_MOMENTS = ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]


def _state_bytes(optimizer, scalars: bool = False) -> dict[str, int]:
    """Bytes of the optimizer's per-parameter state by device type: torch Adam's ``exp_avg``
    and ``exp_avg_sq``, the hybrid optimizer's fp32 ``master_param`` (the distributed
    optimizer's fp32 shards where nothing is offloaded: ``shard_fp32_from_float16_groups``),
    and with ``scalars`` the 0-dim ``step`` counters (on the device for megatron's fused
    device-side Adam)."""
    from collections import Counter

    totals = Counter()
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        tensors = [v for state in inner.optimizer.state.values() for v in state.values()]
        tensors += [
            p for group in getattr(inner, "shard_fp32_from_float16_groups", []) for p in group
        ]
        for value in tensors:
            if torch.is_tensor(value) and (scalars or value.dim() > 0):
                totals[value.device.type] += value.numel() * value.element_size()
    return dict(totals)


def _device_bytes() -> int:
    gc.collect()  # tensors left in reference cycles are no run's
    return torch.npu.memory_allocated()


def _device_and_state_bytes(recipe, bytes_before: int) -> dict:
    """The run's device bytes: those it added to what the launch held before it (the first
    run of a process also leaves what megatron allocates once: the warm-up run)."""
    grads = [buffer.grad_data for buffer in recipe.model_chunks[0].buffers]
    return {
        "grad_buffer": [(g.numel(), g.dtype) for g in grads],
        "device_bytes": _device_bytes() - bytes_before,
        "state_bytes": _state_bytes(recipe.optimizer),
        "state_bytes_with_steps": _state_bytes(recipe.optimizer, scalars=True),
        "placement": offload.state_placement(recipe.optimizer),
    }


RUNS = {
    "warm-up": DISTRIBUTED,  # what the first run of a process allocates once and keeps
    "resident": DISTRIBUTED,
    "offload": OFFLOAD,
    "offload-half": [*OFFLOAD, "--optimizer-offload-fraction", "0.5"],
    # as the planner's launch lines run it: the gradients reduced in the backward's hooks
    "offload-overlap": [*OFFLOAD, "--overlap-grad-reduce"],
    "bf16-grads": [*DISTRIBUTED, "--grad-reduce-in-bf16"],
    "offload-bf16-grads": [*OFFLOAD, "--grad-reduce-in-bf16"],
    "offload-bf16-moments": [*OFFLOAD, *BF16_MOMENTS],
}
# bf16 main gradients, against fp32 ones (set before measuring, from bf16's 8 significant bits:
# a gradient summed over 4 micro-batches and 2 ranks in bf16 is off by a few units of 2**-8)
BF16_GRAD_NORM_REL, BF16_LOSS_REL = 2**-6, 1e-3


def test_offloaded_optimizer_trains_alike_with_its_state_on_the_host(tmp_path):
    per_rank = run_distributed(
        w_recipe_runs,
        2,
        list(RUNS.items()),
        str(tmp_path),
        _device_and_state_bytes,
        _device_bytes,
        timeout=600,
        emulate_npu=True,
    )
    for rank, runs in enumerate(per_rank):
        resident = runs["resident"]
        assert set(resident["state_bytes"]) == {"npu"}
        placements = (("offload", {"cpu"}), ("offload-half", {"cpu", "npu"}))
        for name, where in (*placements, ("offload-overlap", {"cpu"})):
            run = runs[name]
            assert run["steps"] == resident["steps"], (rank, name)  # bit for bit
            assert set(run["state_bytes"]) == where, (rank, name)  # really on the host
            # the state is all there, and what left the device is exactly what it held
            assert sum(run["state_bytes"].values()) == resident["state_bytes"]["npu"]
            left_the_device = resident["device_bytes"] - run["device_bytes"]
            state_on_device = run["state_bytes_with_steps"].get("npu", 0)
            assert left_the_device == resident["state_bytes_with_steps"]["npu"] - state_on_device
        assert runs["offload-half"]["state_bytes"]["cpu"] < runs["offload"]["state_bytes"]["cpu"]
        _assert_bf16_gradients(runs, rank)
        _assert_bf16_moments(runs, rank)


def _assert_bf16_moments(runs: dict, rank: int) -> None:
    """bf16 host moments: the fp32 master copy (4 bytes a shard element) and m, v in bf16 (2 + 2)
    on the host, nothing of it on the device (its bytes those of the fp32-moment run); the first
    step the same (no update before it), the others within bf16's precision."""
    shard = runs["resident"]["state_bytes"]["npu"] // 12  # fp32 master + m + v per shard element
    narrow, offload = runs["offload-bf16-moments"], runs["offload"]
    assert narrow["placement"] == {"cpu": {"torch.float32": 4 * shard, "torch.bfloat16": 4 * shard}}
    assert offload["placement"] == {"cpu": {"torch.float32": 12 * shard}}
    assert narrow["device_bytes"] == offload["device_bytes"], rank
    assert narrow["steps"][0] == offload["steps"][0], rank
    assert narrow["steps"] != offload["steps"], rank  # the moments were rounded
    for (loss, norm), (want_loss, want_norm) in zip(narrow["steps"], offload["steps"]):
        assert loss == pytest.approx(want_loss, rel=BF16_LOSS_REL), rank
        assert norm == pytest.approx(want_norm, rel=BF16_GRAD_NORM_REL), rank


def _assert_bf16_gradients(runs: dict, rank: int) -> None:
    """--grad-reduce-in-bf16: the gradient buffers are bf16 (2 bytes an element less), training
    stays within bf16's precision of the fp32 run. Without offload the distributed optimizer
    then gives its fp32 master shard fp32 gradients on the device (4 bytes per shard element,
    ``_copy_model_grads_to_main_grads``), which at DP2 eat the whole saving; offloaded, the
    gradients go to the host as they are and the device keeps the 2 bytes an element."""
    resident, narrow = runs["resident"], runs["bf16-grads"]
    assert {dtype for _, dtype in resident["grad_buffer"]} == {torch.float32}
    assert {dtype for _, dtype in narrow["grad_buffer"]} == {torch.bfloat16}
    elements = sum(n for n, _ in narrow["grad_buffer"])
    assert elements == sum(n for n, _ in resident["grad_buffer"])
    shard = resident["state_bytes"]["npu"] // 12  # fp32 master + m + v per shard element
    saved = resident["device_bytes"] - narrow["device_bytes"]
    assert saved == 2 * elements - 4 * shard, rank
    offload = runs["offload"]
    assert offload["device_bytes"] - runs["offload-bf16-grads"]["device_bytes"] == 2 * elements
    for name in ("bf16-grads", "offload-bf16-grads"):
        for (loss, norm), (want_loss, want_norm) in zip(runs[name]["steps"], resident["steps"]):
            assert loss == pytest.approx(want_loss, rel=BF16_LOSS_REL), (rank, name)
            assert norm == pytest.approx(want_norm, rel=BF16_GRAD_NORM_REL), (rank, name)


@pytest.mark.parametrize(
    "argv, names",
    [
        (
            ["--optimizer-cpu-offload", "--bf16", "--use-precision-aware-optimizer"],
            ["--use-distributed-optimizer"],
        ),
        ([*DISTRIBUTED, "--optimizer-cpu-offload"], ["--use-precision-aware-optimizer"]),
        (
            [
                "--use-distributed-optimizer",
                "--use-precision-aware-optimizer",
                "--optimizer-cpu-offload",
            ],
            ["--bf16"],
        ),
        (
            [*OFFLOAD, "--optimizer-offload-fraction", "1.5"],
            ["--optimizer-offload-fraction", "[0, 1]"],
        ),
        (["--optimizer-offload-fraction", "0.5"], ["--optimizer-cpu-offload"]),
        ([*OFFLOAD, "--use-megatron-fsdp"], ["--use-megatron-fsdp"]),
        ([*DISTRIBUTED, *BF16_MOMENTS], ["--exp-avg-dtype bf16", "--optimizer-cpu-offload"]),
        (
            [*OFFLOAD, "--exp-avg-sq-dtype", "bf16", "--optimizer-offload-fraction", "0.5"],
            ["--exp-avg-sq-dtype bf16", "--optimizer-offload-fraction 1"],
        ),
        (["--use-precision-aware-optimizer"], ["--use-distributed-optimizer"]),
        (["--use-distributed-optimizer", "--grad-reduce-in-bf16"], ["--bf16"]),
        (
            [*DISTRIBUTED, "--use-precision-aware-optimizer"],
            ["Transformer Engine", "--optimizer-cpu-offload"],
        ),
    ],
)
def test_offload_flags_that_do_not_combine_are_refused_by_name(argv, names):
    with pytest.raises(ValueError) as error:
        parse_config([*TINY, *argv], world_size=2)
    assert all(name in str(error.value) for name in names), error.value


def _w_cpu(rank, world_size, save):
    from mcore_flash.runtime import distributed
    from mcore_flash.training import loop

    config = parse_config([*TINY, *OFFLOAD, "--save", save])
    distributed.init_distributed(config)
    with pytest.raises(ValueError) as error:
        loop.PretrainRecipe(config)
    return str(error.value)


def test_offload_on_the_cpu_path_is_refused_by_name(tmp_path):
    message = run_distributed(_w_cpu, 1, str(tmp_path))[0]
    assert "--optimizer-cpu-offload" in message and "CPU" in message


def _w_pretrain(rank, world_size, argv):
    from mcore_flash.pretrain import main

    return main(argv)


def _metrics(save) -> list[tuple]:
    with open(save / "metrics.jsonl") as f:
        return [(r["iteration"], r["loss"], r["grad_norm"]) for r in map(json.loads, f)]


@pytest.mark.slow
def test_offloaded_optimizer_with_bf16_moments_resumes_exactly(tmp_path):
    """Save at iteration 2 with the state on the host and its moments in bf16, resume:
    iterations 3-4 equal the uninterrupted run's bit for bit (the host state and its step
    count came back; the byte items naming the optimizer classes, ours among them, pass the
    checkpoint's pickle check). fp32 moments: the offload fault drill
    (test_fault_tolerance.py) resumes them at every fault point."""
    argv = [*TINY, *OFFLOAD, *BF16_MOMENTS, "--emulate-npu", "--train-iters", "4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    def pretrain(*extra):
        return run_distributed(_w_pretrain, 2, [*argv, *extra], timeout=300, emulate_npu=True)

    assert pretrain("--save", str(straight)) == [0, 0]
    assert pretrain("--save", str(resumed), "--exit-interval", "2") == [0, 0]
    assert pretrain("--save", str(resumed), "--load", str(resumed)) == [0, 0]
    assert _metrics(resumed) == _metrics(straight) and len(_metrics(straight)) == 4


@pytest.mark.parametrize(
    "saved, now, flag",
    [
        ({}, {"exp_avg_dtype": "bf16"}, "--exp-avg-dtype fp32"),
        ({"exp_avg_sq_dtype": "bf16"}, {}, "--exp-avg-sq-dtype bf16"),
    ],
)
def test_moments_of_another_dtype_are_refused_by_name(saved, now, flag):
    """Adam moments saved in one dtype do not load as another: refused before any tensor is
    read, naming the flag and --no-load-optim (a checkpoint without the record: fp32)."""
    from mcore_flash.checkpoint import compatibility

    fp32 = {"exp_avg_dtype": "fp32", "exp_avg_sq_dtype": "fp32"}
    with pytest.raises(ValueError, match=flag) as error:
        compatibility.check_moment_dtypes("/ckpt", saved, {**fp32, **now})
    assert "--no-load-optim" in str(error.value), error.value
    compatibility.check_moment_dtypes("/ckpt", {**fp32, **now}, {**fp32, **now})
