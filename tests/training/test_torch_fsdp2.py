"""``--use-torch-fsdp2`` (torch FSDP2 through megatron-core's wrapper) trains what the distributed
optimizer trains; with ``--fsdp2-offload-to-cpu`` the model state is on the host.

Oracle: the same run with ``--use-distributed-optimizer`` (megatron's DDP and distributed
optimizer), fp32: the loss and grad norm of every iteration and every final weight, gathered
whole (1e-5). On the CPU FSDP2 runs without offload (host and device are one: offload is
refused there); on the emulated NPU with it, where host and device differ and the HCCL-strict
groups refuse AVG reductions and host tensors in a collective. DP2 exercises the gradient
reduction (FSDP2 would average on top of the per-token division), TP2 + SP the sum of the
norms' gradients over the tensor-parallel ranks (on the device, from host shards).
"""

from __future__ import annotations

import pytest
import torch

from mcore_flash.planning.parallel_layout import RECOMPUTE_FLAGS
from mcore_flash.runtime.arguments import parse_config

from _support.device_bytes import allocated
from _support.dist_utils import run_distributed
from _support.exports import assert_exports
from _support.recipe_runs import (
    TINY,
    assert_same_training,
    assert_stopped_as_without_a_wrapper,
    full_weights,
    refusal,
    w_recipe_runs,
    w_stops,
)

ORACLE = ["--use-distributed-optimizer"]
FSDP2 = ["--use-torch-fsdp2"]
OFFLOAD = [*FSDP2, "--fsdp2-offload-to-cpu"]
TP2SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _measure(recipe, baseline) -> dict:
    """The gathered weights, and where this rank's model state lives: ``{kind: device types}``
    of the parameters' and optimizer state's local shards, and the device's bytes above what
    the launch's earlier runs left (``baseline``)."""
    from torch.distributed.tensor import DTensor

    def local(tensor):
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    model = recipe.model_chunks[0]
    inner = recipe.optimizer.optimizer
    placement = {
        "parameters": {local(p).device.type for p in model.parameters()},
        "gradients": {
            local(p.grad if p.grad is not None else p.main_grad).device.type
            for p in model.parameters()
        },
        "optimizer": {
            local(v).device.type
            for state in inner.state.values()
            for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0
        },
    }
    device_bytes = None if baseline is None else allocated() - baseline
    parameter_bytes = sum(local(p).numel() * 4 for p in model.parameters())
    return {
        "weights": full_weights(model),
        "placement": placement,
        "device_bytes": device_bytes,
        "parameter_bytes": parameter_bytes,
    }


TILES = ["--loss-compute-mode", "chunk", "--loss-chunk-size", "24", "--mlp-chunk-size", "16"]
PACKED = ["--reset-attention-mask", "--reset-position-ids"]
CP2_QKV_PACKED = ["--context-parallel-size", "2", *RECOMPUTE_FLAGS["qkv"], *PACKED]
ACTIVATIONS = ["--activation-offload-layers", "1", *TILES]


def _pairs(layouts: dict, fsdp2: list) -> list:
    """``(name, flags)`` runs: each layout with the oracle's flags, then with ``fsdp2``'s."""
    runs = []
    for name, flags in layouts.items():
        runs += [(name, [*ORACLE, *flags]), (f"{name}-fsdp2", [*fsdp2, *flags])]
    return runs


@pytest.mark.slow  # CI's Python 3.11 job: the emulated NPU's test below runs on both
def test_fsdp2_equals_the_distributed_optimizer_on_the_cpu(tmp_path):
    layouts = {
        "dp2": [],
        "tp2sp": TP2SP,
        "dp2-full": RECOMPUTE_FLAGS["full"],
        "cp2-qkv-packed": CP2_QKV_PACKED,
        "dp2-tiles": TILES,
    }
    per_rank = run_distributed(
        w_recipe_runs, 2, _pairs(layouts, FSDP2), str(tmp_path), _measure, timeout=600
    )
    for rank, results in enumerate(per_rank):
        for name in layouts:
            assert_same_training(results[f"{name}-fsdp2"], results[name], f"rank {rank} {name}")


def test_fsdp2_offload_keeps_the_model_on_the_host_of_the_emulated_npu(tmp_path):
    layouts = {
        "dp2": [],
        "tp2sp": TP2SP,
        "dp2-activations": ACTIVATIONS,
        "dp2-full": RECOMPUTE_FLAGS["full"],
        "cp2-qkv": ["--context-parallel-size", "2", *RECOMPUTE_FLAGS["qkv"]],
    }
    per_rank = run_distributed(
        w_recipe_runs,
        2,
        _pairs(layouts, OFFLOAD),
        str(tmp_path),
        _measure,
        allocated,
        timeout=600,
        emulate_npu=True,
    )
    on = {"parameters", "gradients", "optimizer"}
    for rank, results in enumerate(per_rank):
        for name in layouts:
            oracle, streamed, label = results[name], results[f"{name}-fsdp2"], f"rank {rank} {name}"
            assert_same_training(streamed, oracle, label)
            assert oracle["placement"] == dict.fromkeys(on, {"npu"}), label
            assert streamed["placement"] == dict.fromkeys(on, {"cpu"}), label
            # the oracle holds weights, gradients and Adam's state on the device
            assert oracle["device_bytes"] > 2 * oracle["parameter_bytes"], label


def _w_resume(rank, world_size, root, fsdp2):
    """Worker: ``{save dir: [(iteration, loss, grad norm) per logged iteration]}`` of a
    4-iteration run with the flags ``fsdp2``, one stopped after 2 and resumed, and a run without
    FSDP2 (megatron's DDP and plain optimizer) stopped after 2 and resumed with ``fsdp2``."""
    import json

    from megatron.core import parallel_state

    from mcore_flash.runtime import distributed
    from mcore_flash.training import loop

    def run(save, *flags):
        argv = [*TINY, "--train-iters", "4", "--log-interval", "1", "--save", f"{root}/{save}"]
        config = parse_config([*argv, *flags])
        distributed.init_distributed(config)
        try:
            loop.train(config)
        finally:
            parallel_state.destroy_model_parallel()

    run("whole", *fsdp2)
    run("stopped", *fsdp2, "--exit-interval", "2")
    run("stopped", *fsdp2, "--load", f"{root}/stopped")
    run("from-ddp", "--exit-interval", "2")
    run("from-ddp", *fsdp2, "--load", f"{root}/from-ddp")
    logged = {}
    for save in ("whole", "stopped", "from-ddp"):
        with open(f"{root}/{save}/metrics.jsonl") as lines:
            records = [json.loads(line) for line in lines]
        logged[save] = [(r["iteration"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]
    return logged


@pytest.mark.parametrize(
    "device, fsdp2", [pytest.param("cpu", FSDP2, marks=pytest.mark.slow), ("npu", OFFLOAD)]
)
def test_fsdp2_resumes_exactly_and_from_a_checkpoint_without_fsdp(tmp_path, device, fsdp2):
    """Save after 2 of 4 iterations, resume: the same losses and grad norms as without a stop
    (megatron's dist checkpointing of the FSDP2 shards, and the Adam state made DTensors
    again); a checkpoint of megatron's DDP and plain optimizer resumes under FSDP2 to the same
    run (1e-5: the two wrappers sum gradients in other orders). On the emulated NPU with the
    host offload: the loaded Adam state goes back to the host beside its parameters."""
    (logged,) = run_distributed(
        _w_resume, 1, str(tmp_path), fsdp2, timeout=300, emulate_npu=device == "npu"
    )
    assert [entry[0] for entry in logged["stopped"]] == [1, 2, 3, 4]
    assert logged["stopped"] == logged["whole"]
    assert [entry[0] for entry in logged["from-ddp"]] == [1, 2, 3, 4]
    for (_, loss, norm), (_, want_loss, want_norm) in zip(logged["from-ddp"], logged["whole"]):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-5)


def _w_saved_weights(rank, world_size, root):
    """Worker: train 2 iterations with FSDP2 at DP2, saving into ``root``; the gathered weights."""
    from megatron.core import parallel_state

    from mcore_flash.runtime import distributed
    from mcore_flash.training import loop

    config = parse_config([*TINY, *FSDP2, "--train-iters", "2", "--save", root])
    distributed.init_distributed(config)
    recipe = loop.PretrainRecipe(config)
    try:
        recipe.train()
        return full_weights(recipe.model_chunks[0])
    finally:
        recipe.cleanup()
        parallel_state.destroy_model_parallel()


def test_a_dp2_fsdp2_checkpoint_exports_the_weights_it_trained(tmp_path):
    """Each rank's FSDP2 piece of a SwiGLU linear_fc1 lies in its gate or its up half: the
    checkpoint must put it there (megatron-core 0.16-0.18 cut it in two as if it were a
    tensor-parallel shard: every gate and up weight scrambled in any other layout)."""
    weights, _ = run_distributed(_w_saved_weights, 2, str(tmp_path / "run"), timeout=300)
    assert_exports(str(tmp_path / "run"), str(tmp_path / "hf"), weights, 2)


@pytest.mark.parametrize(
    "argv, names",
    [
        ([*FSDP2, "--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size"]),
        ([*FSDP2, *ORACLE], ["--use-distributed-optimizer"]),
        ([*FSDP2, "--use-megatron-fsdp"], ["--use-megatron-fsdp"]),
        ([*FSDP2, "--fp16"], ["--fp16", "--bf16"]),
        ([*FSDP2, "--bf16", "--grad-reduce-in-bf16"], ["--grad-reduce-in-bf16", "reduce_dtype"]),
        (
            [*FSDP2, "--model", "llama3.2-1b"],
            ["--untie-embeddings-and-output-weights"],
        ),
        (["--fsdp2-offload-to-cpu"], ["--use-torch-fsdp2"]),
        (["--fsdp2-config-path", "x.yaml"], ["--use-torch-fsdp2"]),
    ],
)
def test_what_fsdp2_cannot_combine_is_refused_by_name(argv, names):
    message = refusal(argv)
    assert all(name in message for name in names), message


@pytest.mark.parametrize(
    "text, names",
    [
        ("offload_to_cpu: true\nsharding_size: 8\n", ["'sharding_size'", "offload_to_cpu"]),
        ("pin_memory: 'yes'\n", ["pin_memory", "bool"]),
        ("param_dtype: fp16\n", ["param_dtype", "bf16, fp32"]),
        ("- offload_to_cpu\n", ["mapping"]),
    ],
)
def test_a_bad_fsdp2_config_file_is_refused_naming_the_key(tmp_path, text, names):
    path = tmp_path / "fsdp2.yaml"
    path.write_text(text)
    message = refusal([*FSDP2, "--fsdp2-config-path", str(path)])
    assert str(path) in message and all(name in message for name in names), message


def test_the_config_file_sets_what_mindspeed_names(tmp_path):
    path = tmp_path / "fsdp2.yaml"
    path.write_text("offload_to_cpu: true\npin_memory: false\nreshard_after_forward: false\n")
    settings = parse_config([*TINY, *FSDP2, "--fsdp2-config-path", str(path)], world_size=2).fsdp2
    assert (settings.offload_to_cpu, settings.pin_memory, settings.reshard_after_forward) == (
        True,
        False,
        False,
    )
    assert (settings.param_dtype, settings.reduce_dtype) == ("fp32", "fp32")
    flag = parse_config([*TINY, *OFFLOAD, "--bf16"], world_size=2).fsdp2
    assert flag.offload_to_cpu and flag.pin_memory and flag.param_dtype == "bf16"


def test_offload_on_the_cpu_is_refused_by_name():
    from mcore_flash.training.fsdp2 import check_offload_device

    settings = parse_config([*TINY, *OFFLOAD], world_size=2).fsdp2
    with pytest.raises(ValueError, match="--fsdp2-offload-to-cpu.*--emulate-npu"):
        check_offload_device(settings, torch.device("cpu"))


def test_sigterm_divergence_and_the_watchdog_under_streaming_as_without_it(tmp_path):
    """On the emulated NPU with the host offload: SIGTERM on one rank stops every rank after the
    iteration and saves it, an infinite loss stops the run naming --lr, and the watchdog's
    hooks (on the decoder inside FSDP2's wrapper, its gradient reduction and the host
    optimizer's step) mark every phase of an iteration."""
    for outcome in run_distributed(
        w_stops, 2, str(tmp_path), OFFLOAD, timeout=300, emulate_npu=True
    ):
        assert_stopped_as_without_a_wrapper(outcome)
