"""Host offload, the memory ladder's 4th rung: device and host bytes by hand arithmetic,
the step-time terms, the search's climb and the CLI's refusals.

Hand figures: a TP8 rank of Llama-2-70B (h 8192, 64 heads, 8 KV groups of 128, FFN 28672,
vocabulary 32000, 80 layers) holds per layer 8192*1280 (QKV) + 1024*8192 (proj) +
8192*7168 (fc1) + 3584*8192 (fc2) + 2*8192 (norms) = 106,971,136 parameters; with the
embedding and the output layer (4000*8192 each) and the final norm, 8,623,235,072, in
80 * 6 + 3 = 483 parameters. Every one is a multiple of 8192 elements, so megatron's DDP
buffer pads nothing here (parameters start at multiples of 64, the bucket ends at a multiple
of lcm(dp, 128)): at dp = 1, 2, 4 each rank's shard is exactly P / dp.

Offloading F of a shard, megatron's ``HybridDeviceOptimizer`` moves whole parameters in the
optimizer's order (the weight-decay group, then the norms, each in buffer order: the reverse
of ``named_parameters``: the output layer, then per layer from the last fc2, fc1, QKV,
proj, ..., the embedding) while fewer than F x shard elements have moved; each parameter has
a 4-byte step counter where its Adam runs (the host, or with offload the device).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mcore_flash.planning import Layout, plan_memory, predict_step_time, search_layouts
from mcore_flash.planning.cli import main
from mcore_flash.planning.ddp_state import offloaded_parameters
from mcore_flash.planning.hardware import HARDWARE_PROFILES
from mcore_flash.planning.models import get_model
from mcore_flash.planning.parallel_layout import pretrain_command
from mcore_flash.planning.parameters import (
    ParameterShape,
    ddp_buffer,
    optimizer_order,
    stage_parameter_shapes,
)
from mcore_flash.planning.search import Candidate, closest_offload, sensitivity
from mcore_flash.planning.units import GiB

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.launch_lines import TRAINER_SWITCHES
from _support.models import TINY_TEST

SEQ = 131072
LAYER_TP8 = 8192 * 1280 + 1024 * 8192 + 8192 * 7168 + 3584 * 8192 + 2 * 8192
P_TP8 = 80 * LAYER_TP8 + 2 * 4000 * 8192 + 8192  # one TP8 rank, all 80 layers
INPUT_TP8 = SEQ // 8 * 8192 * 2  # a layer's bf16 input under SP: what full recompute keeps
NPU = HARDWARE_PROFILES["ascend-910b-64g"]
RUNTIME, RESERVED = 16 * GiB, 64 * GiB  # the profile's host assumptions


PARAMS_TP8 = 80 * 6 + 3  # parameters (tensors) of one TP8 rank
FC2, FC1, QKV, PROJ = 8192 * 3584, 7168 * 8192, 1280 * 8192, 8192 * 1024
OUTPUT = 4000 * 8192
LAYER_WEIGHTS = FC2 + FC1 + QKV + PROJ  # a layer's weight-decay parameters, buffer order
STEP = 4  # a parameter's fp32 step counter


def one_node(**offload) -> Layout:
    return Layout(tp=8, recompute="full", global_batch_size=32, **offload)


def plan(layout: Layout, **kwargs):
    return plan_memory("llama2-70b", SEQ, layout, device_memory="64GB", **kwargs)


def test_hand_parameter_count():
    assert P_TP8 == 8_623_235_072
    assert plan(one_node()).worst_stage.parameters == P_TP8


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_optimizer_offload_moves_the_shard(fraction):
    p = plan(one_node(optimizer_offload_fraction=fraction))
    host = p.stages[0].host_bytes
    offloaded = host["host_gradient_copy"] // 4  # the pinned fp32 gradient copy: 4 B an element
    moved = (host["host_optimizer_state"] - 12 * offloaded) // STEP  # and a step per parameter
    # whole parameters: at least F of the shard (D = 1: all of P), less than F + the largest
    assert fraction * P_TP8 <= offloaded < fraction * P_TP8 + FC1
    assert 12 * offloaded + STEP * moved == host["host_optimizer_state"]
    kept_steps = STEP * (PARAMS_TP8 - moved) if fraction else 0  # on the host without offload
    assert p.per_device["optimizer_state"] == 12 * (P_TP8 - offloaded) + kept_steps
    if fraction == 1.0:
        assert (offloaded, moved) == (P_TP8, PARAMS_TP8)
    assert p.per_device["gradients"] == 4 * P_TP8  # fp32 main gradients stay
    assert p.per_device["weights"] == 2 * P_TP8  # no padding (above)


def test_half_the_optimizer_offloads_in_the_optimizers_order():
    # the threshold P/2 falls after the output layer and the last 40 layers' weights, inside
    # layer 39's: its fc2 is the last parameter moved
    half = P_TP8 / 2
    assert OUTPUT + 40 * LAYER_WEIGHTS < half <= OUTPUT + 40 * LAYER_WEIGHTS + FC2
    offloaded, moved = OUTPUT + 40 * LAYER_WEIGHTS + FC2, 1 + 40 * 4 + 1
    p = plan(one_node(optimizer_offload_fraction=0.5))
    assert p.stages[0].host_bytes["host_optimizer_state"] == 12 * offloaded + STEP * moved
    assert p.stages[0].host_bytes["host_gradient_copy"] == 4 * offloaded
    kept = 12 * (P_TP8 - offloaded) + STEP * (PARAMS_TP8 - moved)
    assert p.per_device["optimizer_state"] == kept == 51_395_003_652


def test_ddp_buffer_pads_and_shards_as_megatron():
    # named_parameters order: a tied embedding split over stages (its own bucket), a 1-D
    # weight, a 200-element weight; at D = 2 buckets end at multiples of lcm(2, 128) = 128
    params = [
        ParameterShape("embedding.word_embeddings.weight", (10, 10), "embedding", True),
        ParameterShape("decoder.final_layernorm.weight", (3,), None),
        ParameterShape("output_layer.weight", (20, 10), None),
    ]
    buffer = ddp_buffer(params, 2)
    # reverse order: output 0..200; the norm starts at 256 (a multiple of 64), ends at 259;
    # the embedding closes that bucket at 320 -> 384 and fills 384..484 -> 512 alone
    assert [(s.name.split(".")[0], s.start, s.elements) for s in buffer.slots] == [
        ("output_layer", 0, 200),
        ("decoder", 256, 3),
        ("embedding", 384, 100),
    ]
    assert buffer.buckets == ((0, 384), (384, 512)) and buffer.elements == 512
    # rank 0 owns 0..192 and 384..448, rank 1 192..384 and 448..512 (each bucket halved)
    shards = [[(s.name.split(".")[0], held) for s, held in shard] for shard in buffer.shards()]
    assert shards == [
        [("output_layer", 192), ("embedding", 64)],
        [("output_layer", 8), ("decoder", 3), ("embedding", 36)],
    ]
    # the optimizer: weight-decay parameters first, the 1-D norm last
    order = optimizer_order([buffer.shards()[1]])
    assert [s.name.split(".")[0] for s, _ in order] == ["output_layer", "embedding", "decoder"]
    # a fraction moves whole parameters while fewer than F x the shard (47) have moved
    assert offloaded_parameters([8, 36, 3], 0.1) == 1  # 0 < 4.7: 8 moved, 8 >= 4.7
    assert offloaded_parameters([8, 36, 3], 0.5) == 2  # 8 < 23.5: 44 moved
    assert offloaded_parameters([8, 36, 3], 1.0) == 3


def _w_megatron_buckets(rank, world_size, bucket_sizes):
    """megatron's own DDP buffer of :data:`TINY_TEST` under the distributed optimizer with
    ``--overlap-grad-reduce`` and each bucket size: its buckets and each parameter's start."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from mcore_flash.benchmarks.models import build_flash_gpt

    init_megatron()
    try:
        out = {}
        for bucket_size in bucket_sizes:
            gpt = build_flash_gpt(TINY_TEST, params_dtype=torch.bfloat16, bf16=True)
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=bucket_size
            )
            ddp = DistributedDataParallel(gpt.config, ddp_config, gpt)
            (buffer,) = ddp.buffers
            names = {p: n for n, p in gpt.named_parameters()}
            starts = {names[p]: index[0] for p, index in buffer.param_index_map.items()}
            out[bucket_size] = (list(buffer.bucket_indices), starts)
        return out
    finally:
        teardown_megatron()


def test_ddp_buckets_are_megatrons():
    """With ``--overlap-grad-reduce`` megatron closes a bucket once it holds ``bucket_size``
    elements (each bucket end padded to lcm(D, 128)): the planner's buffer has megatron's
    buckets and parameter starts, at D = 2 (:data:`TINY_TEST`, 123200 parameters; 30000 splits it
    into several buckets, 40M, megatron's default, leaves one)."""
    sizes = (30000, 40_000_000)
    megatron = run_distributed(_w_megatron_buckets, 2, sizes, timeout=300)[0]
    for bucket_size in sizes:
        mirror = ddp_buffer(stage_parameter_shapes(TINY_TEST), 2, bucket_size=bucket_size)
        buckets, starts = megatron[bucket_size]
        assert [tuple(b) for b in buckets] == list(mirror.buckets), bucket_size
        assert starts == {slot.name: slot.start for slot in mirror.slots}, bucket_size
    assert len(megatron[30000][0]) > 2 and len(megatron[40_000_000][0]) == 1


def test_activation_offload_moves_the_layer_inputs():
    base = plan(one_node(optimizer_offload_fraction=1.0))
    p = plan(one_node(optimizer_offload_fraction=1.0, activation_offload_layers=80))
    # full recompute keeps one layer input per layer; one micro-batch in flight (PP1)
    assert base.per_device["activations"] - p.per_device["activations"] == 80 * INPUT_TP8
    assert p.per_device["activation_offload_buffers"] == 2 * INPUT_TP8  # own + prefetched
    assert p.stages[0].host_bytes["host_activations"] == 80 * INPUT_TP8
    half = plan(one_node(optimizer_offload_fraction=1.0, activation_offload_layers=40))
    assert half.stages[0].host_bytes["host_activations"] == 40 * INPUT_TP8
    # the 40 layers not offloaded are freed before layer 39's backward fetches it and
    # prefetches layer 38: two inputs at once, fewer than the 40 they replace
    assert half.per_device["activation_offload_buffers"] == 0
    assert base.per_device["activations"] - half.per_device["activations"] == 40 * INPUT_TP8
    # 79 layers offloaded: one layer input stays, the backward's two fetched ones top it by one
    most = plan(one_node(optimizer_offload_fraction=1.0, activation_offload_layers=79))
    assert most.per_device["activation_offload_buffers"] == INPUT_TP8


def test_host_bytes_per_node():
    p = plan(one_node(optimizer_offload_fraction=1.0, activation_offload_layers=80))
    per_rank = 16 * P_TP8 + STEP * PARAMS_TP8 + 80 * INPUT_TP8 + RUNTIME
    assert p.host.ranks_per_node == 8
    assert p.host.per_node == 8 * per_rank + RESERVED
    assert p.host.host_memory == 2 * 1024 * GiB  # the profile's default (an assumption)


def test_host_bytes_of_a_pipeline_span_nodes():
    # TP8 PP2 on 16 devices: node 0 holds stage 0, node 1 stage 1 (ranks TP, CP, DP, PP)
    layout = Layout(
        tp=8, pp=2, recompute="full", global_batch_size=32, optimizer_offload_fraction=1.0
    )
    p = plan(layout)
    stage0 = 40 * LAYER_TP8 + 4000 * 8192  # in 40 * 6 + 1 parameters
    stage1 = 40 * LAYER_TP8 + 4000 * 8192 + 8192  # in 40 * 6 + 2 (final norm, output layer)
    assert stage1 > stage0
    assert p.host.per_node == 8 * (16 * stage1 + STEP * (40 * 6 + 2) + RUNTIME) + RESERVED


def test_bf16_host_moments_take_8_bytes_an_element_and_show_in_the_command():
    # fp32 master 4 + m 2 + v 2 (instead of 4 + 4 + 4); the gradient copy, activations,
    # runtime and the device unchanged
    fp32 = plan(one_node(optimizer_offload_fraction=1.0, activation_offload_layers=80))
    bf16 = plan(
        one_node(
            optimizer_offload_fraction=1.0, activation_offload_layers=80, host_moment_dtype="bf16"
        )
    )
    per_rank = 12 * P_TP8 + STEP * PARAMS_TP8 + 80 * INPUT_TP8 + RUNTIME
    assert bf16.host.per_node == 8 * per_rank + RESERVED
    assert fp32.host.per_node - bf16.host.per_node == 8 * 4 * P_TP8
    assert bf16.per_device == fp32.per_device
    command = pretrain_command(get_model("llama2-70b"), SEQ, bf16.layout)
    assert "--optimizer-offload-fraction 1 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16" in command


def test_search_keeps_bf16_host_moments_for_a_node_too_small_for_fp32_state():
    # the one-node layout needs 1294 GiB of host with fp32 state, 1037 with bf16 moments
    node = int(1.2 * 1024 * GiB)
    found = search_layouts("llama2-70b", SEQ, 8, "64GB", host_memory=node)
    assert found and all(c.plan.layout.host_moment_dtype == "bf16" for c in found)
    best = found[0].plan
    assert best.fits and best.layout.optimizer_offload_fraction == 1.0
    fp32 = plan(replace(best.layout, host_moment_dtype="fp32"), host_memory=node)
    assert fp32.device_fits and not fp32.fits  # the host is what the bf16 moments free
    assert fp32.host.per_node - best.host.per_node == 8 * 4 * P_TP8


def test_host_memory_refuses_a_plan():
    layout = one_node(optimizer_offload_fraction=1.0, activation_offload_layers=80)
    needed = 8 * (16 * P_TP8 + STEP * PARAMS_TP8 + 80 * INPUT_TP8 + RUNTIME) + RESERVED
    layout = one_node(
        optimizer_offload_fraction=1.0, activation_offload_layers=80, grad_reduce_in_bf16=True
    )
    refused = plan(layout, host_memory=needed - 1)
    held = plan(layout, host_memory=needed)
    assert refused.device_fits and not refused.fits
    assert held.fits


def test_no_offload_plans_keep_their_verdict():
    # the host of a plan without offload: the runtime per rank and the reserve only
    p = plan(Layout(tp=8, pp=2, cp=16, recompute="attention", global_batch_size=32))
    assert p.host.per_node == 8 * RUNTIME + RESERVED
    assert p.fits == p.device_fits


def test_offload_flags_of_the_command():
    layout = one_node(optimizer_offload_fraction=0.5, activation_offload_layers=3)
    command = pretrain_command(get_model("llama2-70b"), SEQ, layout)
    assert (
        "--use-distributed-optimizer --overlap-grad-reduce --use-precision-aware-optimizer "
        "--optimizer-cpu-offload --optimizer-offload-fraction 0.5 --activation-offload-layers 3"
    ) in command
    assert command.endswith("--bf16")
    assert "offload" not in pretrain_command(get_model("llama2-70b"), SEQ, one_node())


@pytest.mark.parametrize(
    "changes, flag",
    [
        (
            dict(fsdp="optim_grads_params", dp=2, optimizer_offload_fraction=1.0),
            "--use-megatron-fsdp",
        ),
        (dict(fsdp="optim_grads_params", dp=2, activation_offload_layers=1), "--use-megatron-fsdp"),
        (dict(optimizer_offload_fraction=1.5), "--optimizer-offload-fraction"),
        (
            dict(optimizer_offload_fraction=1.0, distributed_optimizer=False),
            "--use-distributed-optimizer",
        ),
        (dict(activation_offload_layers=-1), "--activation-offload-layers"),
        (dict(overlap_cpu_optimizer=True), "--overlap-cpu-optimizer-d2h-h2d"),
        (dict(host_moment_dtype="bf16"), "--optimizer-offload-fraction 1"),
        (
            dict(host_moment_dtype="bf16", optimizer_offload_fraction=0.5),
            "--optimizer-offload-fraction 1",
        ),
        (dict(host_moment_dtype="fp16", optimizer_offload_fraction=1.0), "--exp-avg-dtype"),
    ],
)
def test_refused_layouts_name_the_flag(changes, flag):
    with pytest.raises(ValueError, match=flag):
        Layout(tp=8, **changes)


def test_more_offloaded_layers_than_a_stage_holds():
    with pytest.raises(ValueError, match="--activation-offload-layers 41"):
        plan(Layout(tp=8, pp=2, activation_offload_layers=41))


def test_host_optimizer_step_and_copies():
    step = predict_step_time("llama2-70b", SEQ, one_node(optimizer_offload_fraction=1.0), NPU)
    assert step.breakdown["host_optimizer_step"] == pytest.approx(8 * P_TP8 / 2e9)
    assert step.breakdown["optimizer_offload_copies"] == pytest.approx(6 * P_TP8 / 25e9)
    overlapped = predict_step_time(
        "llama2-70b", SEQ, one_node(optimizer_offload_fraction=1.0, overlap_cpu_optimizer=True), NPU
    )
    assert overlapped.breakdown["host_optimizer_step"] == pytest.approx(8 * P_TP8 / 2e9)
    assert overlapped.breakdown["optimizer_offload_copies"] == 0
    assert (
        "host_optimizer_step" not in predict_step_time("llama2-70b", SEQ, one_node(), NPU).breakdown
    )


def test_activation_copies_exposed_beyond_the_compute():
    layout = one_node(activation_offload_layers=80)
    hidden = predict_step_time("llama2-70b", SEQ, layout, NPU)  # 268 MB at 25 GB/s: hidden
    assert hidden.breakdown["activation_offload_exposed"] == 0
    slow = NPU.with_(host_device_bandwidth=1e6)  # 268 s a copy: beyond any layer's compute
    exposed = predict_step_time("llama2-70b", SEQ, layout, slow).breakdown[
        "activation_offload_exposed"
    ]
    copy = INPUT_TP8 / 1e6
    assert 32 * 80 * 2 * (copy - 10) < exposed < 32 * 80 * 2 * copy  # 32 micro-batches


def test_search_climbs_to_offload_on_16_devices():
    found = search_layouts("llama2-70b", SEQ, 16, "64GB")
    assert found and all(c.rung == "offload" for c in found)
    for c in found:
        assert c.plan.fits and c.plan.total <= 64 * GiB
        assert c.plan.host.per_node <= c.plan.host.host_memory
        assert c.plan.layout.fsdp is None


def test_search_stays_on_zero3_on_32_devices():
    found = search_layouts("llama2-70b", SEQ, 32, "64GB")
    assert found and {c.rung for c in found} == {"ZeRO-3"}


def test_one_node_gap_with_fp32_gradients():
    # fp32 main gradients: 6 B/parameter of 8.62 B on the device leave too little below the
    # streaming rung, even with the sequence tiles (which fitted them beside activation
    # offload while the host rungs kept 5% free, not 10%); streaming the weights fits them
    assert search_layouts("llama2-70b", SEQ, 8, "64GB", bf16_gradients=False, streaming=False) == []
    streamed = search_layouts("llama2-70b", SEQ, 8, "64GB", bf16_gradients=False)
    assert streamed and all(
        c.rung == "streaming" and not c.plan.layout.grad_reduce_in_bf16 for c in streamed
    )
    gap = closest_offload(get_model("llama2-70b"), SEQ, 8, 64 * GiB)
    assert gap.plan.layout.tp == 8 and gap.device_over > 0 and gap.host_over < 0
    assert not gap.plan.layout.grad_reduce_in_bf16 and gap.bf16_gradients.layout.grad_reduce_in_bf16
    # bf16 gradients save 2 B/parameter (and the fragmentation on them: none, they are static)
    assert gap.plan.total - gap.bf16_gradients.total == 2 * P_TP8
    assert gap.bf16_gradients.fits


def test_one_node_fits_with_bf16_gradients():
    # before --grad-reduce-in-bf16 was a Layout choice nothing fitted here; now the offload
    # rung's narrower state does, on what torch_npu can allocate of a 910B with 5% of it free
    # and HCCL's buffers counted (37 layers offloaded on 64 GiB with none of that, then 68; 51
    # since the loss's and the MLP backward's transient bytes are exact: 2.57 GiB less
    # workspace, 1.60 GiB less logits buffers; 63 since the host rungs keep 10% free)
    capacity = HARDWARE_PROFILES["ascend-910b-64g"].capacity
    found = search_layouts("llama2-70b", SEQ, 8, capacity)
    assert found and {c.rung for c in found} == {"offload"}
    assert all(c.plan.layout.grad_reduce_in_bf16 for c in found)
    best = found[0]
    lay = best.plan.layout
    assert (lay.tp, lay.pp, lay.cp, lay.dp, lay.recompute) == (8, 1, 1, 1, "full")
    assert lay.optimizer_offload_fraction == 1.0 and lay.activation_offload_layers == 63
    assert best.plan.per_device["gradients"] == 2 * P_TP8  # the whole shard on the host
    assert best.plan.fits and best.plan.total <= 0.90 * capacity
    assert best.plan.host.per_node <= 2 * 1024 * GiB
    command = best.to_dict()["launch_command"]
    assert "--grad-reduce-in-bf16" in command and "--bf16 --distributed-timeout-minutes" in command
    assert best.to_dict()["layout"]["grad_reduce_in_bf16"] is True


# --grad-reduce-in-bf16: N = the rank's gradient-buffer elements, S = N / D its optimizer
# shard (D = dp x cp); bf16 buffer 2N, plus 4 B per shard element kept on the device


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_bf16_gradients_without_offload_save_2n_minus_4s(dp):
    n, s = P_TP8, P_TP8 // dp  # P_TP8 is divisible by 4
    fp32 = plan(Layout(tp=8, dp=dp, recompute="full", global_batch_size=32))
    bf16 = plan(
        Layout(tp=8, dp=dp, recompute="full", global_batch_size=32, grad_reduce_in_bf16=True)
    )
    assert fp32.per_device["gradients"] == 4 * n
    assert bf16.per_device["gradients"] == 2 * n + 4 * s
    assert fp32.total - bf16.total == 2 * n - 4 * s  # static: no fragmentation on it
    assert {k: v for k, v in bf16.per_device.items() if k != "gradients"} == {
        k: v for k, v in fp32.per_device.items() if k != "gradients"
    }
    saved = {1: -2 * n, 2: 0, 4: n}[dp]  # costs 2N at D = 1, saves nothing at D = 2
    assert fp32.total - bf16.total == saved


def test_bf16_gradients_count_cp_in_the_shard():
    layout = Layout(tp=8, cp=2, dp=2, recompute="full", global_batch_size=32)
    bf16 = plan(Layout(**{**layout.__dict__, "grad_reduce_in_bf16": True}))
    assert bf16.per_device["gradients"] == 2 * P_TP8 + 4 * (P_TP8 // 4)


@pytest.mark.parametrize("dp", [1, 2])
def test_bf16_gradients_with_optimizer_offload_save_2n(dp):
    base = dict(tp=8, dp=dp, recompute="full", global_batch_size=32, optimizer_offload_fraction=1.0)
    fp32, bf16 = plan(Layout(**base)), plan(Layout(**base, grad_reduce_in_bf16=True))
    assert bf16.per_device["gradients"] == 2 * P_TP8
    assert fp32.total - bf16.total == 2 * P_TP8
    # the host keeps its fp32 gradient copy: host bytes do not change
    assert bf16.stages[0].host_bytes == fp32.stages[0].host_bytes
    assert bf16.stages[0].host_bytes["host_gradient_copy"] == 4 * P_TP8 // dp
    assert bf16.host.per_node == fp32.host.per_node


def test_bf16_gradients_with_part_of_the_optimizer_offloaded():
    # 4 B of fp32 gradient per element kept on the device (S = N at D = 1): the threshold P/4
    # falls after the output layer, the last 19 layers' weights and layer 60's fc2 and fc1,
    # before its QKV, the last parameter moved
    quarter = P_TP8 / 4
    before = OUTPUT + 19 * LAYER_WEIGHTS + FC2 + FC1
    assert before < quarter <= before + QKV
    kept = P_TP8 - (before + QKV)
    bf16 = plan(one_node(optimizer_offload_fraction=0.25, grad_reduce_in_bf16=True))
    assert bf16.per_device["gradients"] == 2 * P_TP8 + 4 * kept


def test_bf16_gradients_without_the_distributed_optimizer():
    layout = Layout(tp=8, dp=2, recompute="full", global_batch_size=32, distributed_optimizer=False)
    bf16 = plan(Layout(**{**layout.__dict__, "grad_reduce_in_bf16": True}))
    assert bf16.per_device["gradients"] == 2 * P_TP8 + 4 * P_TP8  # fp32 main grads of all


def test_bf16_gradients_are_not_preferred_where_they_cost():
    # D = 1 without offload: bf16 gradients take 2N more; the search's bf16 layouts at D = 1
    # all offload the optimizer, and a search that fits with fp32 gradients never takes them
    found = search_layouts("llama2-70b", SEQ, 8, "64GB")
    assert found
    for c in found:
        if c.plan.layout.sharding_ranks <= 2:
            assert c.plan.layout.optimizer_offload_fraction > 0
    for devices in (16, 32):
        assert not any(
            c.plan.layout.grad_reduce_in_bf16
            for c in search_layouts("llama2-70b", SEQ, devices, "64GB")
        )


def test_bf16_gradients_under_megatron_fsdp():
    # modelled, not measured: the main-gradient buffer and the gradient buckets at 2 B
    from mcore_flash.planning.fsdp import fsdp_bytes, stage_groups
    from mcore_flash.planning.parameters import layer_parameters

    model = get_model("llama2-70b")
    layout = Layout(tp=8, dp=4, recompute="full", global_batch_size=32, fsdp="optim_grads_params")
    bf16 = plan(Layout(**{**layout.__dict__, "grad_reduce_in_bf16": True}))
    groups = stage_groups(model, 8, 1, 0, "optim_grads_params")
    layer = sum(layer_parameters(model, 8).values())
    fp32_bytes = fsdp_bytes(groups, "optim_grads_params", 4, layer)
    bf16_bytes = fsdp_bytes(groups, "optim_grads_params", 4, layer, grad_bytes=2)
    assert bf16.per_device["gradients"] == bf16_bytes["gradients"] == fp32_bytes["gradients"] // 2
    assert bf16.per_device["fsdp_gradient_buckets"] == bf16_bytes["fsdp_gradient_buckets"]
    assert bf16_bytes["fsdp_gradient_buckets"] < fp32_bytes["fsdp_gradient_buckets"]


def test_bf16_gradients_need_bf16():
    layout = one_node(grad_reduce_in_bf16=True)
    with pytest.raises(ValueError, match="--grad-reduce-in-bf16 needs"):
        plan(layout, param_bytes=4)
    with pytest.raises(ValueError, match="--grad-reduce-in-bf16 needs --bf16"):
        pretrain_command(get_model("llama2-70b"), SEQ, layout, dtype_bytes=4)
    assert "--grad-reduce-in-bf16" in pretrain_command(get_model("llama2-70b"), SEQ, layout)
    assert "--grad-reduce-in-bf16" not in pretrain_command(get_model("llama2-70b"), SEQ, one_node())
    assert layout.rung == "offload"


def test_bf16_gradients_halve_the_gradient_reduction():
    base = dict(tp=8, dp=4, recompute="full", global_batch_size=32, overlap_grad_reduce=False)
    fp32 = predict_step_time("llama2-70b", SEQ, Layout(**base), NPU)
    bf16 = predict_step_time("llama2-70b", SEQ, Layout(**base, grad_reduce_in_bf16=True), NPU)
    key = "dp_grad_reduce_exposed"
    assert bf16.breakdown[key] == pytest.approx(fp32.breakdown[key] / 2)


def test_cli_grad_reduce_in_bf16(capsys):
    args = ["--tp", "8", "--recompute", "full", "--global-batch-size", "32", *TRAINER_SWITCHES]
    args += [
        "--optimizer-cpu-offload",
        "--activation-offload-layers",
        "68",
    ]
    assert main(args) == 1  # fp32 gradients: over
    capsys.readouterr()
    assert main(args + ["--grad-reduce-in-bf16"]) == 0
    out = capsys.readouterr().out
    assert (
        "bf16 main gradients (--grad-reduce-in-bf16)" in out
        and "--grad-reduce-in-bf16 --recompute" in out
    )
    assert main(args + ["--grad-reduce-in-bf16", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["grad_reduce_in_bf16"] is True
    assert data["gradient_flags"] == ["--grad-reduce-in-bf16"]
    assert data["per_device_bytes"]["gradients"] == 2 * P_TP8
    assert main(args + ["--grad-reduce-in-bf16", "--dtype", "fp32"]) == 2
    assert "--grad-reduce-in-bf16 needs --bf16" in capsys.readouterr().err


def test_sensitivity_halves_and_doubles_each_assumption():
    layout = one_node(optimizer_offload_fraction=1.0)
    p = plan(layout)
    step = predict_step_time("llama2-70b", SEQ, layout, NPU)
    rows = sensitivity(Candidate(p, step))
    fields = {r["field"] for r in rows}
    assert {"host_device_bandwidth", "host_optimizer_elements_per_s", "host_memory_bytes"} <= fields
    assert {"peak_bf16_tflops", "hbm_bytes"}.isdisjoint(fields)  # sourced, not assumed
    halved = next(
        r for r in rows if r["field"] == "host_optimizer_elements_per_s" and r["factor"] == 0.5
    )
    # the host step doubles: + 8 P / 2e9 seconds
    assert halved["step_time_change"] == pytest.approx(8 * P_TP8 / 2e9 / step.step_time_s)


def test_cli_search_and_refusals(capsys):
    assert main(["--search", "--num-devices", "16", "--device-memory", "64GB", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "(rung: offload)" in out and "--optimizer-cpu-offload" in out and "host" in out
    # 8 devices fit now, with activation offload and bf16 main gradients (with fp32 ones and
    # the sequence tiles while the host rungs kept 5% free, not 10%); 4 only by streaming the
    # weights (test_streaming_plan.py), and with 1 TB of host not even so
    assert main(["--search", "--num-devices", "8", "--device-memory", "64GB", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "optimizer offload 1, activation offload 52 layers/stage, bf16 main gradients" in out
    assert "--grad-reduce-in-bf16" in out
    assert main(["--search", "--num-devices", "4", "--device-memory", "64GB", "--top", "1"]) == 0
    assert "(rung: streaming)" in capsys.readouterr().out
    assert (
        main(["--tp", "8", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"]) == 2
    )
    assert "--optimizer-offload-fraction" in capsys.readouterr().err
    assert main(["--tp", "8", "--dp", "2", "--use-megatron-fsdp", "--optimizer-cpu-offload"]) == 2
    assert "--use-megatron-fsdp" in capsys.readouterr().err
    assert main(["--tp", "8", "--optimizer-offload-fraction", "0.5"]) == 2
    assert "needs --optimizer-cpu-offload" in capsys.readouterr().err
    moments = ["--tp", "8", "--optimizer-cpu-offload", "--exp-avg-dtype", "bf16"]
    assert main(moments) == 2
    assert "plans both moments in one dtype" in capsys.readouterr().err
    assert (
        main([*moments, "--exp-avg-sq-dtype", "bf16", "--optimizer-offload-fraction", "0.5"]) == 2
    )
    assert "--optimizer-offload-fraction 1" in capsys.readouterr().err
    four = ["--search", "--num-devices", "4", "--device-memory", "64GB", "--host-memory", "1TB"]
    assert main(four) == 1
    out = capsys.readouterr().out
    assert "with bf16 main gradients (--grad-reduce-in-bf16, which the search tried too)" in out
    assert "still over" in out
    assert "bf16 host moments (--exp-avg-dtype bf16" in out


def test_cli_host_memory_refusal(capsys):
    args = [
        *TRAINER_SWITCHES,
        "--tp",
        "8",
        "--recompute",
        "full",
        "--optimizer-cpu-offload",
        "--device-memory",
        "64GB",
    ]
    assert main(args + ["--host-memory", "256GB"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "per node" in out and "over" in out
