"""Weight streaming, the memory ladder's top rung (torch FSDP2 + ``CPUOffloadPolicy``,
``--use-torch-fsdp2 --fsdp2-offload-to-cpu``): device and host bytes by hand from the tiny
model's weight shapes, the search's climb, the must-show searches, the launch line and the
plan flags.

Hand figures: the tests' tiny model (h 64, FFN 128, 4 heads of 16, 2 KV groups, vocabulary
128, 2 layers, untied) at TP1 over D = 3 data-parallel ranks. FSDP2 shards every parameter
on dim 0 into D chunks of ``ceil(rows / D)`` rows (padded alike on every rank).
"""

from __future__ import annotations

import json
import math

import pytest

from mcore_flash.planning import Layout, plan_memory, predict_step_time, search_layouts
from mcore_flash.planning.cli import main
from mcore_flash.planning.hardware import HARDWARE_PROFILES
from mcore_flash.planning.search import Candidate, sensitivity
from mcore_flash.planning.units import GiB
from mcore_flash.pretrain import planned_run

from _support.models import TINY_TEST

D = 3
H, F, HEADS, GROUPS, HEAD_DIM, VOCAB = 64, 128, 4, 2, 16, 128
# one layer's weights as megatron builds them: (rows = output features, columns)
LAYER_SHAPES = [
    (H, 1),  # input_layernorm
    ((HEADS + 2 * GROUPS) * HEAD_DIM, H),  # linear_qkv
    (H, HEADS * HEAD_DIM),  # linear_proj
    (H, 1),  # pre_mlp_layernorm
    (2 * F, H),  # linear_fc1 (SwiGLU: gate and up)
    (H, F),  # linear_fc2
]
EMBEDDING_SHAPES = [(VOCAB, H)]
ROOT_SHAPES = [(H, 1), (VOCAB, H)]  # final norm, output layer
NPU = HARDWARE_PROFILES["ascend-910b-64g"]
RUNTIME, RESERVED = 16 * GiB, 64 * GiB  # the profile's host assumptions
ONE_AND_A_HALF_TB = 1536 * GiB  # 24 x 64 GB DIMMs (binary, as DIMMs are)


def _elements(shapes) -> int:
    return sum(rows * cols for rows, cols in shapes)


def _shard(shapes) -> int:
    return sum(-(-rows // D) * cols for rows, cols in shapes)


def _tiny_streamed(**changes) -> Layout:
    return Layout(
        dp=D,
        global_batch_size=D,
        distributed_optimizer=False,
        stream_weights=True,
        **changes,
    )


def test_streamed_device_bytes_by_hand():
    """At the backward's largest moment (layer 0's backward, the embedding prefetched; FSDP2's
    allocations as torch 2.13's ``_fully_shard`` makes them, measured on the emulated NPU by
    tests/emulation/test_fsdp2_memory.py): weights, the gathered bf16 weights (D padded shards
    each) of the root, layer 0 and the embedding (each fp32 shard copy dies at its cast);
    gradients, the root's and layer 0's unsharded bf16 gradients and layer 1's fp32
    reduce-scatter input, kept until the next reduce-scatter; no optimizer state."""
    root = _shard(ROOT_SHAPES)
    plan = plan_memory(TINY_TEST, 128, _tiny_streamed(), device_memory="64GB")
    assert plan.per_device["weights"] == 2 * D * (
        root + _shard(LAYER_SHAPES) + _shard(EMBEDDING_SHAPES)
    )
    assert plan.per_device["gradients"] == (
        2 * _elements(ROOT_SHAPES) + 2 * _elements(LAYER_SHAPES) + 4 * D * _shard(LAYER_SHAPES)
    )
    assert plan.per_device["optimizer_state"] == 0
    resident = plan_memory(
        TINY_TEST,
        128,
        Layout(dp=D, global_batch_size=D, distributed_optimizer=False),
        device_memory="64GB",
    )
    assert resident.per_device["activations"] == plan.per_device["activations"]


def test_streamed_host_bytes_per_node():
    """Every rank: fp32 master, Adam m and v (12 B) and the fp32 gradient (4 B) of its shard
    of every unit and the root, a 4-byte Adam step per parameter tensor; the node's 3 ranks
    with their runtime and the node's reserve."""
    shards = _shard(EMBEDDING_SHAPES) + 2 * _shard(LAYER_SHAPES) + _shard(ROOT_SHAPES)
    tensors = 1 + 2 * len(LAYER_SHAPES) + 2
    plan = plan_memory(TINY_TEST, 128, _tiny_streamed(), device_memory="64GB")
    per_rank = 16 * shards + 4 * tensors
    assert plan.host.by_category["host_optimizer_state"] == D * (12 * shards + 4 * tensors)
    assert plan.host.per_node == D * (per_rank + RUNTIME) + RESERVED
    assert plan.host.host_memory == NPU.host_memory_bytes


@pytest.mark.parametrize(
    "changes,flag",
    [
        ({"pp": 2}, "--pipeline-model-parallel-size"),
        ({"distributed_optimizer": True}, "--use-distributed-optimizer"),
        ({"optimizer_offload_fraction": 1.0}, "--optimizer-cpu-offload"),
        ({"grad_reduce_in_bf16": True}, "--grad-reduce-in-bf16"),
    ],
)
def test_streaming_refuses_what_the_trainer_refuses(changes, flag):
    base = dict(global_batch_size=4, distributed_optimizer=False, stream_weights=True)
    with pytest.raises(ValueError, match=flag):
        Layout(**{**base, **changes})


# the tiny model deeper: 16 layers, of which streaming keeps 2 (with 2 layers it keeps all)
DEEP = TINY_TEST.with_(name="tiny-test-16", num_layers=16)


def _tiny_search(device_memory: int):
    """:data:`DEEP` on 2 devices without the fixed reserves (so that its bytes decide)."""
    return search_layouts(
        DEEP,
        128,
        2,
        device_memory,
        hardware=NPU.with_(communicator_buffer_bytes=0),
        runtime_reserve=0,
    )


def _least(**layout) -> int:
    """The least device total of :data:`DEEP` on 2 devices with ``layout``'s fields, full
    recompute and every layer's activations on the host, over TP 1 and 2."""
    return min(
        plan_memory(
            DEEP,
            128,
            Layout(
                tp=tp,
                dp=2 // tp,
                global_batch_size=2,
                recompute="full",
                activation_offload_layers=16,
                **layout,
            ),
            runtime_reserve=0,
            hardware=NPU.with_(communicator_buffer_bytes=0),
        ).total
        for tp in (1, 2)
    )


def test_the_search_climbs_to_streaming_only_when_nothing_fits_below():
    """Oracle: the plans' own totals. A device that holds the least streamed plan with 10%
    free, but not the least offloaded one (the whole optimizer, every layer, bf16 gradients)
    gets streamed layouts only; one that holds an offloaded plan gets none."""
    streamed = _least(distributed_optimizer=False, stream_weights=True)
    offloaded = _least(optimizer_offload_fraction=1.0, grad_reduce_in_bf16=True)
    device = math.ceil(streamed / 0.9) + 1024
    assert offloaded > device
    roomy = _tiny_search(2 * offloaded)
    assert roomy and all(c.rung != "streaming" for c in roomy)
    tight = _tiny_search(device)
    assert tight and {c.rung for c in tight} == {"streaming"}
    for candidate in tight:
        command = candidate.launch_command
        assert "--use-torch-fsdp2 --fsdp2-offload-to-cpu" in command
        assert "--use-distributed-optimizer" not in command
        assert "--optimizer-cpu-offload" not in command
        assert "--pipeline-model-parallel-size 1" in command
        assert candidate.plan.headroom >= 0.1 * candidate.plan.device_memory


def _search_json(argv, capsys) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", ["llama3.1-70b", "qwen2.5-72b"])
def test_must_show_one_node_at_128k_keeps_10_percent_free_within_1_5_tb(model, capsys):
    """The issue's must-shows: one 8-NPU 910B node at 131072 tokens, 1.5 TiB of host."""
    argv = (
        f"--search --model {model} --seq-length 131072 --num-devices 8 --top 3 --host-memory 1.5TB"
    )
    out = _search_json(argv.split(), capsys)
    assert out["layouts"]
    for layout in out["layouts"]:
        assert layout["fits"] and layout["headroom_bytes"] >= 0.1 * layout["device_memory_bytes"]
        assert layout["host"]["host_bytes_per_node"] <= ONE_AND_A_HALF_TB
        assert layout["step_time"]["tokens_per_s_per_device"] > 0


def test_must_show_256k_tokens_fit_one_node_within_1_5_tb(capsys):
    """``plan --longest`` reaches 262144 tokens: the search finds a layout there (the longest
    is the largest length the search fits, tests/planning/test_longest.py)."""
    argv = "--search --model llama3.1-70b --seq-length 262144 --num-devices 8 --top 1"
    out = _search_json([*argv.split(), "--host-memory", "1.5TB"], capsys)
    [best] = out["layouts"]
    assert best["fits"] and best["host"]["host_bytes_per_node"] <= ONE_AND_A_HALF_TB


def test_the_plan_flags_plan_the_same_streamed_bytes_as_the_api(capsys):
    """``--use-torch-fsdp2 --fsdp2-offload-to-cpu`` with plan's and the trainer's layout names
    plan the Layout's bytes; one without the other is refused by name."""
    layout = Layout(tp=8, global_batch_size=4, recompute="full", sequence_parallel=True)
    api = plan_memory(
        "llama2-70b",
        32768,
        Layout(**{**layout.__dict__, "distributed_optimizer": False, "stream_weights": True}),
        device_memory=NPU.capacity,
    )
    common = "--model llama2-70b --seq-length 32768 --global-batch-size 4 --sequence-parallel"
    streamed = "--use-torch-fsdp2 --fsdp2-offload-to-cpu --recompute-granularity full"
    streamed += " --recompute-method uniform --recompute-num-layers 1"
    for names in ("--tp 8", "--tensor-model-parallel-size 8"):
        code = main([*f"{common} {names} {streamed} --json".split()])
        out = json.loads(capsys.readouterr().out)
        assert code == (0 if api.fits else 1)
        assert out["per_device_bytes"] == api.per_device
        assert out["host"] == api.host.to_dict()
        assert "--use-torch-fsdp2 --fsdp2-offload-to-cpu" in out["launch_command"]
    main([*f"{common} --tp 8 {streamed}".split()])
    text = capsys.readouterr().out
    assert "weight_streaming_exposed" in text and "host_optimizer_step" in text
    assert "assumption: host-device copies at 25 GB/s (host_device_bandwidth)" in text
    assert main([*f"{common} --tp 8 --use-torch-fsdp2".split()]) == 2
    assert "give both" in capsys.readouterr().err


# Llama-2-70B on one TP8 rank (hand counts as tests/planning/test_offload_plan.py's)
SEQ = 131072
LAYER_TP8 = 8192 * 1280 + 1024 * 8192 + 8192 * 7168 + 3584 * 8192 + 2 * 8192
EMBEDDING_TP8 = 4000 * 8192
ROOT_TP8 = 4000 * 8192 + 8192  # output layer, final norm
P_TP8 = 80 * LAYER_TP8 + EMBEDDING_TP8 + ROOT_TP8


def test_streamed_step_time_terms_and_their_sensitivity():
    """At D = 1 a shard is the whole TP rank. The node's 8 ranks step 8 x P on the host at the
    profile's 2e9 parameters/s (an assumption); per micro-batch the embedding's fp32 shard goes
    up twice and its gradient down, the root's too (FSDP2 reshards it after the forward and
    gathers it again for the backward), and the first layer of each
    pass waits for its copy: the rest hide behind a layer's compute (about a second). From
    the second micro-batch on FSDP2 copies each layer's gradient down blocking and the host
    adds the rank's shard (at the Adam step's rate shared by the 8 ranks). The sensitivity
    rows halve and double those assumptions: halving the bandwidth doubles the copies'
    exposed time, halving the host's speed the host step and the adds."""
    layout = Layout(
        tp=8,
        recompute="full",
        global_batch_size=32,
        distributed_optimizer=False,
        stream_weights=True,
    )
    step = predict_step_time("llama2-70b", SEQ, layout, NPU)
    assert step.breakdown["host_optimizer_step"] == pytest.approx(8 * P_TP8 / 2e9)
    assert "optimizer_offload_copies" not in step.breakdown
    assert step.breakdown["dp_grad_reduce_exposed"] == 0
    copy = 4 / 25e9  # seconds per fp32 element, one direction
    exposed = 32 * copy * (3 * EMBEDDING_TP8 + 3 * ROOT_TP8 + 2 * LAYER_TP8)
    assert step.breakdown["weight_streaming_exposed"] == pytest.approx(exposed)
    blocking = 31 * copy * 80 * LAYER_TP8  # micro-batches 2-32: each layer's gradient
    adds = 31 * P_TP8 / (2e9 / 8)
    assert step.breakdown["host_gradient_accumulation"] == pytest.approx(blocking + adds)
    plan = plan_memory("llama2-70b", SEQ, layout, device_memory=NPU.capacity)
    rows = {(r["field"], r["factor"]): r for r in sensitivity(Candidate(plan, step))}
    halved = rows[("host_device_bandwidth", 0.5)]["step_time_change"]
    assert halved == pytest.approx((exposed + blocking) / step.step_time_s)
    slower = rows[("host_optimizer_elements_per_s", 0.5)]["step_time_change"]
    assert slower == pytest.approx((8 * P_TP8 / 2e9 + adds) / step.step_time_s)
    # the node's 8 x 16 B x P = 1.0 TiB of state and 192 GiB besides: 1 TiB does not hold it
    assert plan.host.per_node > NPU.host_memory_bytes // 2
    assert rows[("host_memory_bytes", 0.5)]["fits"] is False


def test_from_pretrain_args_plans_the_streamed_layout(capsys):
    """The trainer's ``--use-torch-fsdp2 --fsdp2-offload-to-cpu`` reach the plan through
    ``planned_run_for_pretrain_args`` (``pretrain --dry-run``'s) as through plan's flags."""
    run = "--model llama2-70b --seq-length 32768 --global-batch-size 4 --sequence-parallel --bf16"
    run += " --use-torch-fsdp2 --fsdp2-offload-to-cpu --recompute-granularity full"
    run += " --recompute-method uniform --recompute-num-layers 1"
    main(
        [
            "--json",
            "--num-devices",
            "8",
            "--from-pretrain-args",
            *f"{run} --tensor-model-parallel-size 8".split(),
        ],
        pretrain_reader=planned_run,
    )
    planned = json.loads(capsys.readouterr().out)
    main(["--json", *f"{run} --tp 8 --num-devices 8".split()])
    ours = json.loads(capsys.readouterr().out)
    assert planned["layout"]["stream_weights"] is True
    assert planned["per_device_bytes"] == ours["per_device_bytes"]
    assert planned["host"] == ours["host"] and planned["layout"] == ours["layout"]
