"""Sequence tiling in the planner (#49): the tiled loss (``--loss-compute-mode chunk
--loss-chunk-size N``) and the tiled MLP (``--mlp-chunk-size N``) as layout dimensions.

Oracles: bytes and seconds written out by hand below from the shapes of what
``mcore_flash.transformer.linear_cross_entropy`` and ``.tiled_mlp`` keep and compute (never
the planner's own functions), the trainer's own flag checks (``runtime/config_checks.py``),
and the search's answers for the issue's models. The peaks' moments written out here are the
ones tests/emulation/test_tiling_memory.py finds exact on the emulated NPU's byte counter.

Hand shape: TINY_TEST (L 2, h 64, f 128 SwiGLU, a 4, g 2, d 16, V 128) at s = 512, TP2 with
sequence parallelism, CP2, micro-batch b = 2, bf16 (B = 2): s_c = 256 tokens per CP rank,
s_t = 128 rows per TP rank, V/t = f/t = 64; a loss tile of N = 96 tokens, an MLP tile of
M = 64 tokens.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from mcore_flash.planning import Layout, plan_memory, predict_step_time, search_layouts
from mcore_flash.planning import activation_bytes as act
from mcore_flash.planning.cli import main
from mcore_flash.planning.hardware import HARDWARE_PROFILES, HardwareProfile
from mcore_flash.planning.parallel_layout import DEFAULT_LOSS_CHUNK_SIZE
from mcore_flash.planning.search import Candidate, sensitivity, tile_choices
from mcore_flash.planning.step_time import TILING_BREAKDOWN_KEYS

from _support.launch_lines import TRAINER_SWITCHES, pretrain_argv
from _support.models import TINY_TEST

S, TP, CP, MB, B = 512, 2, 2, 2, 2
S_C, S_T = S // CP, S // CP // TP  # 256, 128
H, F, V, D = 64, 128, 128, 16
N, M = 96, 64  # loss tile, MLP tile (tokens)
BIG = 2**40  # device memory: the verdicts do not matter here
HAND = HardwareProfile("hand", 1e-3, 0.5, 2**30, 1e6, 1e5, 4)  # 5e8 FLOP/s; 1 MB/s in a node

# one layer under "none", the npu profile (RMSNorm rstd 4 B a row, statistics 64 B a row)
NORM = S_T * MB * H * B + S_T * MB * 4  # a norm's input and fp32 rstd
ATTENTION = (
    NORM  # input_layernorm
    + S_T * MB * H * B  # linear_qkv input
    + 4 * S_C * D * B  # RoPE cos/sin for q and k
    + S_C * MB * (2 + 1 + 1 + 2) * D * B  # q (a/t = 2 heads), k, v (g/t = 1), out
)
STATISTICS = MB * 2 * S_C * 64  # b * a/t * s_c * 64
MLP_KEPT = NORM + S_T * MB * H * B  # pre-MLP norm, fc1 input (tiled: the tiles' inputs)
INTERMEDIATES = 3 * MB * (F // TP) * B  # per token: fc1 output 2f/t, fc2 input f/t (fused SwiGLU)


def layout(**changes) -> Layout:
    return replace(Layout(tp=TP, cp=CP, micro_batch_size=MB, global_batch_size=MB), **changes)


def plan(**changes):
    return plan_memory(TINY_TEST, S, layout(**changes), device_memory=BIG)


def test_the_tiled_loss_keeps_two_fp32_statistics_per_token_not_the_softmax():
    untiled, tiled = plan(), plan(loss_chunk_size=N)
    outside = (
        MB * S_C * 8  # token ids (int64)
        + MB * S_C  # vocab-range mask (TP > 1)
        + NORM  # final norm
        + S_T * MB * H * B  # the output layer's input
    )
    megatron = S_C * MB * (V // TP) * 4 + S_C * MB + S_C * MB * 8  # softmax, target mask, targets
    ours = 2 * S_C * MB * 4 + S_C * MB * 8  # max and sum of exponentials; the labels' copy (b > 1)
    assert untiled.per_device["embeddings_and_loss"] == outside + megatron
    assert tiled.per_device["embeddings_and_loss"] == outside + ours
    # at b = 1 the labels' transpose is a view of the batch: the statistics alone
    one = plan_memory(
        TINY_TEST, S, layout(micro_batch_size=1, global_batch_size=1, loss_chunk_size=N)
    )
    assert one.per_device["embeddings_and_loss"] == (
        S_C * 8 + S_C + (S_T * H * B + S_T * 4) + S_T * H * B + 2 * S_C * 4
    )


TOKENS = S_C * MB  # tokens of the loss: [s_c, b]
LOGITS = TOKENS * (V // TP)  # elements of a rank's [s_c, b, V/t] logits
MEGATRON_KEPT = 4 * LOGITS + 9 * TOKENS  # fp32 softmax, target mask, masked targets


def test_megatrons_loss_peaks_at_its_forward_beside_the_kept_fp32_softmax():
    """megatron's loss peaks as its forward's last per-token vector is allocated: the bf16
    logits beside the fp32 softmax (which is the logits' fp32 copy, its gradient computed in
    place), five fp32 per-token vectors (maximum, target logit, sum of exponentials, its log,
    the loss) and GPTModel's int64 copy of the labels (b > 1); its output layer's backward
    (the logits' bf16 gradient, the input's gradient and its scattered rows, the weight's
    bf16 gradient, the kept tensors freed) is smaller here."""
    forward = LOGITS * B + 5 * 4 * TOKENS + 8 * TOKENS
    backward = LOGITS * B + TOKENS * H * B + S_T * MB * H * B + (V // TP) * H * B - MEGATRON_KEPT
    assert forward > backward
    assert plan().per_device["logits_buffers"] == forward
    # a vocabulary narrower than the hidden size: the output layer's backward is the peak
    wide = TINY_TEST.with_(hidden_size=256, num_attention_heads=4, kv_channels=16, vocab_size=32)
    logits = TOKENS * 16  # V/t = 16
    backward = logits * B + TOKENS * 256 * B + S_T * MB * 256 * B + 16 * 256 * B
    backward -= 4 * logits + 9 * TOKENS
    assert backward > logits * B + 28 * TOKENS
    assert plan_memory(wide, S, layout(), device_memory=BIG).per_device["logits_buffers"] == (
        backward
    )


def test_the_tiled_loss_peaks_in_a_tiles_backward():
    """The tiled loss's peak is in the backward of a tile after the first: the loss's fp32
    gradient, the hidden states' gradient and the output weight's fp32 gradient (alive through
    the backward), under SP the gathered tile, the tile's positions and per-token vectors
    (labels, masked targets, megatron's arange, all int64; the target mask; the fp32 softmax
    update), the previous tile's hidden-state gradient, and the largest of the tile's logits
    in bf16 and fp32, its logit gradient with its new hidden-state gradient, and its logit
    gradient with the weight-gradient product."""
    n = N * MB  # a tile's tokens
    v = V // TP
    common = (
        4 * TOKENS  # the per-token loss's gradient
        + S_T * MB * H * B  # the hidden states' gradient
        + v * H * 4  # the output weight's gradient, fp32
        + n * H * B  # the tile's hidden states gathered over the TP ranks
        + 8 * N
        + (8 + 8 + 8 + 1 + 4) * n  # positions; labels, targets, arange, mask, update
        + n * H * B  # the previous tile's hidden-state gradient
    )
    copy, gemm, product = n * v * (B + 4), n * v * B + n * H * B, n * v * B + v * H * B
    assert copy > max(gemm, product)
    assert plan(loss_chunk_size=N).per_device["logits_buffers"] == common + copy
    # without SP the tile is a view of the hidden states
    no_sp = plan(loss_chunk_size=N, sequence_parallel=False).per_device["logits_buffers"]
    assert no_sp == common + copy - n * H * B + (S_C - S_T) * MB * H * B
    # a tile of the whole sequence: one tile, no previous one
    one = TOKENS
    whole = plan(loss_chunk_size=1024).per_device["logits_buffers"]
    assert whole == (
        4 * TOKENS
        + S_T * MB * H * B
        + v * H * 4
        + one * H * B
        + 8 * S_C
        + 29 * one
        + one * v * (B + 4)
    )
    # only the last stage holds them
    stages = plan(loss_chunk_size=N, pp=2, global_batch_size=4).stages
    assert stages[0].bytes["logits_buffers"] == 0
    assert stages[1].bytes["logits_buffers"] == common + copy


def test_the_tiled_mlp_keeps_its_input_not_its_intermediates():
    untiled, tiled = plan(), plan(mlp_chunk_size=M)
    layer = ATTENTION + MLP_KEPT  # no intermediates, the statistics apart
    assert tiled.per_device["activations"] == TINY_TEST.num_layers * layer
    assert untiled.per_device["activations"] == TINY_TEST.num_layers * (layer + S_C * INTERMEDIATES)
    assert tiled.per_device["attention_statistics"] == TINY_TEST.num_layers * STATISTICS
    modules = {t.module for t in tiled.layer_terms}
    assert "mlp" in modules and not modules & {"mlp.linear_fc1", "mlp.linear_fc2"}
    assert "mlp.activation_func" not in modules


def _mlp_moments(tokens: int, rows: int) -> tuple[int, int, int]:
    """An MLP backward's three moments over ``tokens`` of the fc1 GEMM (``rows`` of this rank's
    input), TP2 with SP, beyond its kept tensors: fc2's (the output gradient gathered, fc2's
    input gradient, its bf16 weight gradient), the activation's (fc1's output gradient, fc2's
    input gradient beside it and fc2's input freed), fc1's (its output and input gradients,
    the input gradient's scattered rows, its bf16 weight gradient, the intermediates freed)."""
    f, w = F // TP, 2 * F // TP  # the fc2 input's and the fc1 output's width on a rank
    fc2 = tokens * MB * H * B + tokens * MB * f * B + H * f * B
    activation = tokens * MB * w * B
    fc1 = tokens * MB * w * B + tokens * MB * H * B + rows * MB * H * B + w * H * B
    return fc2, activation, fc1 - tokens * INTERMEDIATES


@pytest.mark.parametrize("recompute", ["none", "qkv", "attention", "full"])
def test_the_recompute_workspace_holds_the_mlps_backward_at_its_peak(recompute):
    tiled = plan(mlp_chunk_size=M, recompute=recompute).per_device["recompute_workspace"]
    untiled = plan(recompute=recompute).per_device["recompute_workspace"]
    incoming = S_T * MB * H * B  # the layer's output gradient, held through its backward
    megatron = max(_mlp_moments(S_C, S_T))  # fc2's here
    assert megatron == _mlp_moments(S_C, S_T)[0]
    # the tiles, last first: the others' input gradients and the recomputed output of the
    # first (a full one), its intermediates rebuilt and its largest moment, or at the end the
    # concatenated input gradient
    first = M * INTERMEDIATES + max(_mlp_moments(M, M // TP))
    ours = S_T * MB * H * B + max(first, S_T * MB * H * B)
    full_layer = S_C * INTERMEDIATES if recompute == "full" else 0  # full rebuilds them all
    assert tiled - untiled == ours - megatron - full_layer
    rebuilt = {  # what the layer's recompute rebuilds besides the MLP's intermediates
        "none": 0,
        "attention": ATTENTION + STATISTICS,  # the attention sub-block
        "full": ATTENTION + STATISTICS + MLP_KEPT,  # the layer (its MLP input under the tiles)
    }
    if recompute in rebuilt:
        assert tiled == rebuilt[recompute] + incoming + ours
        assert untiled == rebuilt[recompute] + full_layer + incoming + megatron


def test_an_mlp_tile_of_the_whole_sequence_runs_untiled():
    untiled, whole = plan(), plan(mlp_chunk_size=S_C)
    assert whole.per_device == untiled.per_device
    assert any("runs untiled" in note for note in whole.notes)
    step = predict_step_time(TINY_TEST, S, whole.layout, HAND)
    assert not set(TILING_BREAKDOWN_KEYS) & set(step.breakdown)
    assert "tile_efficiency" not in step.details  # nothing rests on the assumption
    assert "--mlp-chunk-size 256" in whole.to_dict()["launch_command"]


# ---- the step time, by hand ---------------------------------------------------------------

X = 5e8
MICRO = 4  # micro-batches of 1 sequence per step
LOGITS_FWD = 2 * S * H * V / (TP * CP) / X  # one output-layer GEMM pass of one micro-batch
MLP_FWD = 2 * S * H * F * 3 / (TP * CP) / X  # one MLP forward of one layer (fc1 2f, fc2 f)
COLLECTIVE = 0.5 * S_C * H * B / 1e6  # one SP all-gather / reduce-scatter of [s_c, 1, h]


def steps(efficiency=1.0, **changes):
    base = Layout(tp=TP, cp=CP, global_batch_size=MICRO, **changes)
    tiled = replace(base, loss_chunk_size=N, mlp_chunk_size=M)
    return (
        predict_step_time(TINY_TEST, S, base, HAND),
        predict_step_time(TINY_TEST, S, tiled, HAND, tile_efficiency=efficiency),
    )


@pytest.mark.parametrize("recompute,full_share", [("none", 0), ("full", 1)])
@pytest.mark.parametrize("efficiency", [1.0, 0.5])
def test_the_tiles_add_their_recomputed_gemms_at_the_assumed_efficiency(
    recompute, full_share, efficiency
):
    base, tiled = steps(efficiency, recompute=recompute)
    # the loss: 4 output-layer passes (forward, recomputed forward, backward's 2) at the
    # tiles' speed, where megatron runs 3
    assert tiled.breakdown["loss_tiling"] == pytest.approx(
        MICRO * LOGITS_FWD * (4 / efficiency - 3), rel=1e-12
    )
    # the MLP: forward, backward (2), full recompute's forward and the tile's recomputed forward
    runs = 3 + full_share
    assert tiled.breakdown["mlp_tiling"] == pytest.approx(
        MICRO * 2 * MLP_FWD * ((runs + 1) / efficiency - runs), rel=1e-12
    )
    # the tile's recomputed forward repeats fc1's all-gather and fc2's reduce-scatter
    assert tiled.breakdown["tp_communication"] - base.breakdown["tp_communication"] == (
        pytest.approx(MICRO * 2 * 2 * COLLECTIVE, rel=1e-9)
    )
    extra = sum(tiled.breakdown[k] for k in TILING_BREAKDOWN_KEYS) + MICRO * 2 * 2 * COLLECTIVE
    assert tiled.step_time_s - base.step_time_s == pytest.approx(extra, rel=1e-9)
    assert tiled.details["tile_efficiency"] == efficiency
    assert not set(TILING_BREAKDOWN_KEYS) & set(base.breakdown)


def test_the_plans_compute_overhead_counts_the_tiles_forward_passes():
    base, tiled = plan(), plan(loss_chunk_size=N, mlp_chunk_size=M)
    # per sequence: projections 2s(h(a+2g)d + adh), kernel 2s^2 a d, MLP 2s h f 3, logits 2s h V
    projections = 2 * S * (H * 8 * D + 4 * D * H)
    kernel = 2 * S * S * 4 * D
    step = 3 * (2 * (projections + 2 * S * H * F * 3) + 2 * S * H * V) + 3.5 * 2 * kernel
    extra = 2 * S * H * V + 2 * 2 * S * H * F * 3  # one logits forward, one MLP forward a layer
    assert tiled.recompute_overhead - base.recompute_overhead == pytest.approx(extra / step)


def test_the_tile_efficiency_is_an_assumption_in_the_sensitivity():
    tiled_layout = Layout(tp=TP, cp=CP, global_batch_size=MICRO, loss_chunk_size=N)
    p = plan_memory(TINY_TEST, S, tiled_layout, device_memory=BIG)
    step = predict_step_time(TINY_TEST, S, tiled_layout, HAND)
    rows = [r for r in sensitivity(Candidate(p, step)) if r["field"] == "tile_efficiency"]
    assert [(r["factor"], r["value"], r["fits"]) for r in rows] == [
        (0.5, 0.5, True),
        (2.0, 1.0, True),
    ]
    # halved: the four output-layer passes take twice as long
    assert rows[0]["step_time_change"] == pytest.approx(
        MICRO * 4 * LOGITS_FWD / step.step_time_s, rel=1e-9
    )
    assert rows[1]["step_time_change"] == 0  # at most the untiled speed
    untiled = replace(tiled_layout, loss_chunk_size=None)
    npu = HARDWARE_PROFILES["ascend-910b-64g"]
    plain = Candidate(
        plan_memory(TINY_TEST, S, untiled), predict_step_time(TINY_TEST, S, untiled, npu)
    )
    fields = {r["field"] for r in sensitivity(plain)}
    assert "achievable_fraction" in fields and "tile_efficiency" not in fields


# ---- flags, refusals and the launch line ---------------------------------------------------


def test_the_launch_line_carries_the_trainers_flags():
    command = plan(loss_chunk_size=N, mlp_chunk_size=M).to_dict()["launch_command"]
    assert "--loss-compute-mode chunk --loss-chunk-size 96 --mlp-chunk-size 64" in command
    data = plan().to_dict()
    assert "chunk" not in data["launch_command"]
    assert "loss_chunk_size" not in data["layout"] and "mlp_chunk_size" not in data["layout"]
    assert plan(mlp_chunk_size=M).to_dict()["layout"]["mlp_chunk_size"] == M


@pytest.mark.parametrize(
    "model,seq,tiled",
    [
        (  # the one-node answer for Llama-3.1-70B (below)
            "llama3.1-70b",
            131072,
            Layout(
                tp=8,
                recompute="full",
                global_batch_size=32,
                optimizer_offload_fraction=1.0,
                activation_offload_layers=55,
                grad_reduce_in_bf16=True,
                loss_chunk_size=4096,
            ),
        ),
        (  # both tiles, under Megatron-FSDP and partial recompute
            "llama3.1-8b",
            262144,
            Layout(
                cp=8,
                recompute="qkv",
                recompute_num_layers=18,
                global_batch_size=16,
                fsdp="optim_grads_params",
                loss_chunk_size=4096,
                mlp_chunk_size=4096,
            ),
        ),
    ],
)
def test_the_trainer_parses_the_launch_line_into_the_same_plan(model, seq, tiled):
    """The launch line through the trainer's own parser, planned as ``pretrain --dry-run``
    plans it (:func:`.recipes.plan_for_pretrain_args`): the same tiles, the same bytes."""
    from mcore_flash.planning.recipes import plan_for_pretrain_args
    from mcore_flash.runtime.arguments import parse_config

    capacity = HARDWARE_PROFILES["ascend-910b-64g"].capacity
    ours = plan_memory(model, seq, tiled, device_memory=capacity)
    step = predict_step_time(model, seq, tiled, HARDWARE_PROFILES["ascend-910b-64g"])
    argv = pretrain_argv(Candidate(ours, step).launch_command)
    config = parse_config(argv, world_size=tiled.num_devices)
    assert (config.loss_chunk_size, config.mlp_chunk_size) == (
        tiled.loss_chunk_size,
        tiled.mlp_chunk_size,
    )
    dry_run = plan_for_pretrain_args(config)
    assert dry_run.per_device == ours.per_device and dry_run.fits == ours.fits


def _trainer_refuses(tp, sp, mode, loss, mlp, offload=0) -> bool:
    """Whether the trainer's own check (``runtime/config_checks.py``) refuses these flags."""
    from mcore_flash.runtime.config_checks import _loss_chunk_size

    args = SimpleNamespace(
        loss_compute_mode=mode,
        loss_chunk_size=loss,
        mlp_chunk_size=mlp,
        sequence_parallel=sp,
        activation_offload_layers=offload,
    )
    try:
        _loss_chunk_size(args, tp)
    except ValueError:
        return True
    return False


CHUNK = ["--loss-compute-mode", "chunk", "--loss-chunk-size"]


@pytest.mark.parametrize(
    "flags,trainer,problem",
    [
        (["--loss-chunk-size", "4096"], ("default", 4096, None, 0), "--loss-chunk-size applies to"),
        ([*CHUNK, "0"], ("chunk", 0, None, 0), "--loss-chunk-size must be a positive"),
        (
            ["--mlp-chunk-size", "-8"],
            ("default", None, -8, 0),
            "--mlp-chunk-size must be a positive",
        ),
        (
            [*CHUNK, "1020"],
            ("chunk", 1020, None, 0),
            "--loss-chunk-size 1020: under --sequence-parallel",
        ),
        (["--mlp-chunk-size", "8191"], ("default", None, 8191, 0), "--mlp-chunk-size 8191: under"),
    ],
)
def test_bad_tiles_are_refused_by_name_as_the_trainer_refuses_them(capsys, flags, trainer, problem):
    base = ["--model", "llama3.1-70b", "--tp", "8", "--recompute", "full", *TRAINER_SWITCHES]
    assert main(base + flags) == 2
    assert problem in capsys.readouterr().err
    assert _trainer_refuses(8, True, *trainer)
    if "must be a positive" in problem or "applies to" in problem:  # no tile at any TP
        assert main(["--search", "--num-devices", "8"] + flags) == 2
        assert problem in capsys.readouterr().err


def test_good_tiles_plan_and_default_to_the_trainers_loss_tile(capsys):
    args = ["--model", "llama3.1-8b", "--seq-length", "32K", "--tp", "8", "--json"]
    assert main(args + ["--loss-compute-mode", "chunk", "--mlp-chunk-size", "4096"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["loss_chunk_size"] == DEFAULT_LOSS_CHUNK_SIZE == 1024
    assert (
        "--loss-compute-mode chunk --loss-chunk-size 1024 --mlp-chunk-size 4096"
        in data["launch_command"]
    )
    assert set(TILING_BREAKDOWN_KEYS) <= set(data["step_time"]["breakdown_s"])
    assert not _trainer_refuses(8, True, "chunk", None, 4096)
    # without sequence parallelism any positive size goes, as in the trainer
    assert main(args + ["--no-sequence-parallel", "--mlp-chunk-size", "1001"]) in (0, 1)
    capsys.readouterr()
    assert not _trainer_refuses(8, False, "default", None, 1001)
    text = [
        "--model",
        "llama3.1-8b",
        "--seq-length",
        "32K",
        "--tp",
        "8",
        "--loss-compute-mode",
        "chunk",
    ]
    assert main(text) in (0, 1)
    out = capsys.readouterr().out
    assert "loss tiles of 1024 tokens" in out and "loss_tiling" in out
    assert "assumption: the tiles' GEMMs at 1 x the untiled speed" in out


def test_layout_refuses_bad_tiles():
    with pytest.raises(ValueError, match="--loss-chunk-size must be a positive number of tokens"):
        Layout(loss_chunk_size=0)
    with pytest.raises(ValueError, match="use a multiple of 4"):
        Layout(tp=4, mlp_chunk_size=6)
    Layout(tp=4, sequence_parallel=False, mlp_chunk_size=6)  # no SP: any tile


def test_activation_offload_parks_the_mlp_tiles_with_the_layer(capsys):
    """The trainer takes the tiled MLP with activation offload (the tiles are megatron's
    checkpoints, their inputs saved with ``save_for_backward``), and so does the planner: an
    offloaded tiled layer parks and fetches back what it keeps, the MLP input (the tiles'
    views of it, copied once in all) with the rest; qkv recompute leaves the layer input."""
    assert not _trainer_refuses(8, True, "default", None, 8192, offload=4)
    flags = ["--model", "llama3.1-70b", "--tp", "8", "--recompute", "full", "--mlp-chunk-size"]
    flags += ["8192", "--optimizer-cpu-offload", "--activation-offload-layers", "4"]
    flags += TRAINER_SWITCHES
    assert main(flags) in (0, 1)
    assert "--mlp-chunk-size 8192" in capsys.readouterr().out
    out = S_C * MB * 2 * D * B  # the kernel's output, saved twice (linear_proj's input)
    kept = {  # a tiled layer keeps no MLP intermediates
        "none": ATTENTION + STATISTICS + MLP_KEPT,
        "qkv": S_T * MB * H * B + out + STATISTICS + MLP_KEPT,  # the layer input left
    }
    for recompute, left in (("none", 0), ("qkv", S_T * MB * H * B)):
        base = layout(recompute=recompute, mlp_chunk_size=M)
        resident = plan_memory(TINY_TEST, S, base, device_memory=BIG)
        assert act.sum_terms(resident.layer_terms) == kept[recompute]
        offloaded = plan_memory(
            TINY_TEST,
            S,
            replace(base, optimizer_offload_fraction=1.0, activation_offload_layers=1),
            device_memory=BIG,
        )
        assert offloaded.stages[0].host_bytes["host_activations"] == kept[recompute] - left + out
        # the layer leaves the kept categories (what stays of it is an offload buffer)
        drop = sum(
            plan.per_device[k] * sign
            for plan, sign in ((resident, 1), (offloaded, -1))
            for k in ("activations", "attention_statistics")
        )
        assert drop == kept[recompute], recompute


# ---- the search ------------------------------------------------------------------------------


def test_tile_choices_are_multiples_of_tp_and_skip_an_mlp_tile_of_the_whole_sequence():
    assert tile_choices(TINY_TEST, 512, 1, 1) == [(4096, None), (4096, 64)]
    odd = TINY_TEST.with_(hidden_size=100, num_attention_heads=4, kv_channels=25)
    assert tile_choices(odd, 4096, 8, 1) == [(4096, None), (4096, 104)]
    assert tile_choices(TINY_TEST, 512, 2, 8) == [(4096, None)]  # 64 tokens per CP rank


def test_search_with_given_tiles_plans_every_layout_with_them():
    found = search_layouts(
        TINY_TEST, 512, 4, BIG, tp_choices=(1, 2, 4), loss_chunk_size=6, mlp_chunk_size=64
    )
    # 6 tokens split over TP1 and TP2 ranks, not TP4 (sequence parallelism)
    assert {c.plan.layout.tp for c in found} == {1, 2}
    assert all(
        (c.plan.layout.loss_chunk_size, c.plan.layout.mlp_chunk_size) == (6, 64) for c in found
    )
    assert all(c.rung == "sequence tiling" for c in found)
    assert all("--loss-compute-mode chunk --loss-chunk-size 6" in c.launch_command for c in found)


SEQ = 131072
SLOW = pytest.mark.slow  # a search or two of a 70B model, 10 to 20 s each


def _tiled(candidate) -> bool:
    return candidate.plan.layout.tiled


def test_llama31_70b_on_16_devices_fits_with_offload_and_fp32_gradients():
    """Megatron's loss holds its bf16 logits beside the kept fp32 softmax, not an fp32 gradient
    on top (7.8 GiB at TP8): 16 devices fit on the offload rung, without tiles or bf16 main
    gradients (before: only with the tiled loss)."""
    capacity = HARDWARE_PROFILES["ascend-910b-64g"].capacity
    found = search_layouts("llama3.1-70b", SEQ, 16, capacity, global_batch_size=32)
    assert found and all(c.rung == "offload" and not _tiled(c) for c in found)
    best = found[0].plan
    assert best.fits and best.total <= 0.95 * capacity
    assert not best.layout.grad_reduce_in_bf16 and best.layout.activation_offload_layers


@SLOW
def test_qwen25_72b_on_16_devices_fits_with_offload_and_fp32_gradients():
    capacity = HARDWARE_PROFILES["ascend-910b-64g"].capacity
    found = search_layouts("qwen2.5-72b", SEQ, 16, capacity, global_batch_size=32)
    # with the 10% the host rungs keep free (5% before) the offload needs the tiles beside it
    assert found and all(_tiled(c) and not c.plan.layout.grad_reduce_in_bf16 for c in found)
    assert found[0].plan.fits and found[0].plan.total <= 0.90 * capacity


@SLOW
def test_llama31_70b_fits_one_node_only_with_the_tiles():
    """One node: nothing fits without the tiles; with them the loss and the MLP tiles beside
    activation offload (the MLP's tiles parked with their layers) and bf16 main gradients."""
    capacity = HARDWARE_PROFILES["ascend-910b-64g"].capacity
    assert (  # below the streaming rung, which fits without the tiles (test_streaming_plan.py)
        search_layouts(
            "llama3.1-70b",
            SEQ,
            8,
            capacity,
            global_batch_size=32,
            sequence_tiling=False,
            streaming=False,
        )
        == []
    )
    found = search_layouts("llama3.1-70b", SEQ, 8, capacity, global_batch_size=32)
    assert found and all(_tiled(c) for c in found)
    lay = found[0].plan.layout
    assert (lay.loss_chunk_size, lay.mlp_chunk_size) == (4096, 8192)
    assert lay.activation_offload_layers and lay.optimizer_offload_fraction == 1.0
    assert lay.grad_reduce_in_bf16
    # the tiled loss frees at least megatron's kept fp32 softmax [s, b, V/t] (V = 128256)
    untiled = plan_memory(
        "llama3.1-70b", SEQ, replace(lay, loss_chunk_size=None), device_memory=capacity
    )
    assert not untiled.fits and untiled.total - found[0].plan.total > 4 * SEQ * 128256 // lay.tp


@SLOW
def test_the_tiling_rung_comes_before_offload_and_tiles_the_mlp_where_needed():
    capacity = HARDWARE_PROFILES["ascend-910b-64g"].capacity
    found = search_layouts("llama3.1-8b", 262144, 8, capacity, global_batch_size=16)
    assert found and all(c.rung == "sequence tiling" for c in found)
    assert any(c.plan.layout.mlp_chunk_size == 4096 for c in found)
    assert not any(c.plan.layout.offloads for c in found)
    # without the tiles only host offload fits: a rank's kept fp32 softmax [s_c, b, V/t] is
    # 15.7 GiB and its bf16 logits 7.8 GiB at every TP x CP of 8 devices
    untiled = search_layouts(
        "llama3.1-8b", 262144, 8, capacity, global_batch_size=16, sequence_tiling=False
    )
    assert untiled and {c.rung for c in untiled} == {"offload"}
