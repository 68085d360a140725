"""The planner's Megatron-FSDP model (issue 30): its mirror of megatron's parameter grouping
and padding against megatron-core's own functions on models built on the meta device, the
bytes per strategy and the step-time terms against hand arithmetic, and the ladder's
ZeRO-3 rung in ``mcore-flash plan --search``."""

from __future__ import annotations

import json
from dataclasses import astuple, replace

import pytest

from mcore_flash.planning import (
    HARDWARE_PROFILES,
    Layout,
    get_model,
    plan_memory,
    predict_step_time,
    search_layouts,
)
from mcore_flash.planning.cli import main as plan_main
from mcore_flash.planning.fsdp import (
    FSDP_STRATEGIES,
    backward_moments,
    fsdp_bytes,
    gathered_parameter_bytes,
    gradient_transient_bytes,
    parameter_groups,
    prefetched_after_step,
    stage_groups,
)
from mcore_flash.planning.parallel_layout import pretrain_command
from mcore_flash.planning.parameters import ParameterShape, stage_parameter_shapes

from _support.dist_utils import init_megatron, run_distributed, teardown_megatron
from _support.models import TINY_TEST

TINY = TINY_TEST
# llama2-70b's TP8 rank at TP1 (hidden 8192, 8 heads, 1 KV group, FFN 3584, vocabulary 4000):
# its per-rank shapes are llama2-70b's at tp 8 (checked below); two layers keep the meta build small
RANK_70B = replace(
    get_model("llama2-70b"),
    name="llama2-70b-tp8-rank",
    num_layers=2,
    num_attention_heads=8,
    num_query_groups=1,
    ffn_hidden_size=3584,
    vocab_size=4000,
    kv_channels=128,
)
# LayerNorm with biases, q/k norms, learned positions, tied embeddings
VARIANT = replace(
    TINY,
    name="tiny-variant",
    normalization="LayerNorm",
    add_bias_linear=True,
    qk_layernorm=True,
    position_embedding_type="learned_absolute",
    untie_embeddings_and_output_weights=False,
)
SHAPES = {"tiny-test": TINY, "rank-70b": RANK_70B, "variant": VARIANT}
RANKS = (1, 2, 3, 4, 8, 16)


def _w_megatron_groups(rank, world_size, shapes, ranks, tie_split):
    """Megatron's own view of each model: named_parameters (name, shape), and per strategy
    its parameter groups (names, chunk_size_factor) and, per sharding size D, each group's
    bucket size, item offsets and every rank's real elements (its _get_item_slice_in_shard)."""
    import torch
    from megatron.core.distributed.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mcore_flash.benchmarks.models import build_flash_gpt

    init_megatron()
    try:
        out = {}
        for key, shape in shapes.items():
            with torch.device("meta"):
                gpt = build_flash_gpt(
                    shape, params_dtype=torch.bfloat16, bf16=True, perform_initialization=False
                )
            gpt = (
                gpt.bfloat16()
            )  # as megatron's Float16Module leaves it (learned positions are fp32)
            if key in tie_split:  # what megatron marks on a tied embedding split over stages
                gpt.embedding.word_embeddings.weight.shared_embedding = True
            names = {p: n for n, p in gpt.named_parameters()}
            result = {"named": [(n, tuple(p.shape)) for n, p in gpt.named_parameters()]}
            for strategy in FSDP_STRATEGIES:
                policy = pgb.BucketingPolicy(
                    suggested_bucket_size=None,
                    fsdp_unit_modules=[TransformerLayer, LanguageModelEmbedding],
                    data_parallel_sharding_strategy=strategy,
                )
                groups, _, _ = pgb._get_parameter_groups(gpt, policy, {})
                config = DistributedDataParallelConfig(
                    use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy
                )
                listed = []
                for bucket_id, group in enumerate(groups):
                    per_d = {}
                    for d in ranks:
                        local = []
                        for r in range(d):
                            items, bucket, shard = pgb.build_data_parallel_buffer_index(
                                [p.shape for p in group.params],
                                r,
                                d,
                                True,
                                config,
                                bucket_id=bucket_id,
                                chunk_size_factor=group.chunk_size_factor,
                            )
                            view = object.__new__(pgb.DataParallelBuffer)
                            view.item_index_map, view.shard_bucket_index = items, shard
                            slices = [view._get_item_slice_in_shard(i) for i in range(len(items))]
                            local.append(sum(end - start for start, end in slices))
                        offsets = [items[i].global_data_index for i in range(len(items))]
                        per_d[d] = (bucket.size, offsets, local)
                    listed.append(
                        ([names[p] for p in group.params], group.chunk_size_factor, per_d)
                    )
                result[strategy] = listed
            out[key] = result
        return out
    finally:
        teardown_megatron()


@pytest.fixture(scope="module")
def megatron_groups():
    return run_distributed(_w_megatron_groups, 1, SHAPES, RANKS, ("variant",), timeout=300)[0]


def _mirror_shapes(key):
    shapes = stage_parameter_shapes(SHAPES[key])
    if key == "variant":
        shapes[0] = shapes[0]._replace(shared_embedding=True)
    return shapes


def test_stage_parameter_shapes_are_megatrons_named_parameters(megatron_groups):
    for key in SHAPES:
        mirror = [(p.name, p.shape) for p in stage_parameter_shapes(SHAPES[key])]
        assert mirror == megatron_groups[key]["named"], key
    tp8 = [p.shape for p in stage_parameter_shapes(get_model("llama2-70b"), tp=8)]
    rank = [p.shape for p in stage_parameter_shapes(RANK_70B)]
    assert tp8[:13] + tp8[-2:] == rank  # embedding, two layers of 6, final norm, output layer


@pytest.mark.parametrize("strategy", FSDP_STRATEGIES)
def test_parameter_groups_and_padding_are_megatrons(megatron_groups, strategy):
    """Groups (members in buffer order, chunk_size_factor), and per D each bucket's padded
    size, every item's offset and every rank's real elements equal megatron-core's
    _get_parameter_groups, build_data_parallel_buffer_index and _get_item_slice_in_shard."""
    for key in SHAPES:
        buckets = parameter_groups(_mirror_shapes(key), strategy)
        expected = megatron_groups[key][strategy]
        assert [(list(b.names), b.chunk_size_factor) for b in buckets] == [
            (names, factor) for names, factor, _ in expected
        ], key
        for bucket, (_, _, per_d) in zip(buckets, expected):
            for d, (size, offsets, local) in per_d.items():
                assert bucket.size(d, strategy) == size, (key, bucket.names[0], d)
                assert list(bucket.offsets) == offsets, (key, bucket.names[0])
                if strategy != "no_shard":
                    assert [bucket.local_elements(d, r, strategy) for r in range(d)] == local


def test_the_variant_has_its_shared_embedding_alone_and_a_chunk_gap_filled():
    """What the comparison above covers: a shared embedding in its own bucket, and a layer
    whose chunk_size_factor (lcm 64, 128 = 128) leaves 64-element norms as fragments."""
    buckets = parameter_groups(_mirror_shapes("variant"), "optim_grads_params")
    assert buckets[0].names == ("embedding.word_embeddings.weight",)
    assert buckets[1].names == ("embedding.position_embeddings.weight",)
    assert buckets[2].chunk_size_factor == 128


def _toy():
    """Two units of a (6, 4) weight and a (4,) norm, and a non-unit (4,) norm + (10, 4) output."""
    unit = [((6, 4), "w"), ((4,), "n")]
    shapes = [ParameterShape(f"u{i}.{n}", s, f"u{i}") for i in (0, 1) for s, n in unit]
    return shapes + [ParameterShape("norm", (4,), None), ParameterShape("out", (10, 4), None)]


# Hand arithmetic (docs/planner.md "Megatron-FSDP"): each unit has chunk factor 4, 28 elements,
# padded at D=2 to 32 (shards of 16: rank 0 holds 16 real, rank 1 12); the non-unit group:
# factor 4, out at 0..40, norm at 40..44, padded to 48 (rank 0: 24 real, rank 1: 20).
# Padded 112, shards 56, real 100, rank 0 real 56. Layer elements 28: communication unit 56.
# The backward, bucket by bucket (BackwardMoment: gathered, queued, size, largest, kept, shard):
# the non-unit group gathers itself and prefetches u1 (0 < 28; then 32 >= 28 stops), no queue;
# u1 gathers u1 + u0 + the non-unit 48, 48 queued (48 <= 56: kept); u0 gathers u0 + 48, 80
# queued, trimmed to 56 or less only at its last gradient: 48 freed, 32 kept.
TOY_MOMENTS = [
    (None, 80, 0, 48, 40, 0, 24),
    ("u1", 112, 48, 32, 24, 48, 16),
    ("u0", 80, 80, 32, 24, 32, 16),
]
# The gradient buckets alone peak when u0's first gradient arrives: (80 + 32) * 4 + 24 * 2,
# and with the gathered units (80 * 2) that is also the worst moment of the two together
# (the non-unit group's 80 * 2 + 48 * 4 + 40 * 2 = 432, u1's 112 * 2 + 80 * 4 + 24 * 2 = 592).
GRAD_TRANSIENT = (48 + 32 + 32) * 4 + 24 * 2
HAND = {
    "optim_grads_params": (56 * 2, 56 * 4, 56 * 4 + 56 * 8, 80 * 2, GRAD_TRANSIENT),
    "optim_grads": (112 * 2, 56 * 4, 56 * 4 + 56 * 8, 0, GRAD_TRANSIENT),
    "optim": (112 * 2, 112 * 4, 56 * 4 + 56 * 8, 0, 0),
    "no_shard": (100 * 2, 100 * 4, 100 * 4 + 100 * 8, 0, 0),
}


def test_backward_moments_by_hand():
    buckets = parameter_groups(_toy())
    moments = backward_moments(buckets, "optim_grads_params", 2, 56)
    assert [astuple(m) for m in moments] == TOY_MOMENTS
    assert [m.held_bytes() for m in moments] == [
        80 * 2 + 48 * 4,
        112 * 2 + 80 * 4,
        80 * 2 + 112 * 4,
    ]
    # each alone: the gathered units in u1's backward, the gradients in u0's
    assert gathered_parameter_bytes(buckets, "optim_grads_params", 2, 56) == 112 * 2
    assert gradient_transient_bytes(buckets, "optim_grads_params", 2, 56) == GRAD_TRANSIENT
    # megatron-core 0.16's new reduce-scatter shard, after the wait: the non-unit group's
    # (0 + 48 + 24) * 4 = 288 > 48 * 4 + 40 * 2, u1's (48 + 32 + 16) * 4 = 384 > 80 * 4 + 48
    old = [m.gradient_bytes(megatron_release=(0, 16)) for m in moments]
    assert old == [288, 384, GRAD_TRANSIENT]
    # optim_grads gathers nothing; optim, no_shard and one rank have no moments
    assert [m.gathered for m in backward_moments(buckets, "optim_grads", 2, 56)] == [0, 0, 0]
    assert backward_moments(buckets, "optim", 2, 56) == []
    assert backward_moments(buckets, "optim_grads_params", 1, 56) == []


@pytest.mark.parametrize("strategy", FSDP_STRATEGIES)
def test_fsdp_bytes_by_hand(strategy):
    got = fsdp_bytes(parameter_groups(_toy(), strategy), strategy, 2, 28)
    keys = (
        "weights",
        "gradients",
        "optimizer_state",
        "fsdp_gathered_parameters",
        "fsdp_gradient_buckets",
    )
    assert tuple(got[k] for k in keys) == HAND[strategy]


def test_one_rank_shards_nothing():
    """D = 1: megatron shards no buffer (group size 1): the padded (to the chunk factor)
    buckets whole, 100 elements, and no temporary buckets."""
    got = fsdp_bytes(parameter_groups(_toy()), "optim_grads_params", 1, 28)
    assert got == {
        "weights": 200,
        "gradients": 400,
        "optimizer_state": 1200,
        "fsdp_gathered_parameters": 0,
        "fsdp_gradient_buckets": 0,
    }


# TINY by hand: a layer's factor is 128 (fc2 [64, 128]); fc2, proj, qkv, fc1 = 36864
# elements, the two 64-element norms after them: 36992, padded at D=2 to 37120; the
# embedding [128, 64]: 8192; the final norm + output layer: 8256, padded to 8320.
TINY_UNITS, TINY_LOOSE = (8192, 37120, 37120), 8320


def test_tiny_fsdp_plan_by_hand():
    layout = Layout(dp=2, fsdp="optim_grads_params", global_batch_size=4)
    plan = plan_memory(TINY, 128, layout, profile="cpu")
    padded = sum(TINY_UNITS) + TINY_LOOSE
    assert plan.per_device["weights"] == padded // 2 * 2
    assert plan.per_device["gradients"] == padded // 2 * 4
    # the worst moment for both: layer 0's backward (layer 0, the prefetched embedding and
    # the non-unit group gathered), the gradient buckets of the non-unit group and both layers
    assert plan.per_device["fsdp_gathered_parameters"] == (37120 + 8192 + TINY_LOOSE) * 2
    assert plan.per_device["fsdp_gradient_buckets"] == (TINY_LOOSE + 2 * 37120) * 4 + 16384 * 2
    assert set(plan.categories) >= {"fsdp_gathered_parameters", "fsdp_gradient_buckets"}


def test_weights_gathered_between_steps_by_hand():
    """optim_grads_params: after the optimizer step megatron all-gathers the embedding (bucket
    0, 8192) and prefetches while less than one layer (36992) is prefetched: layer 0 (37120
    at D=2, 37376 at D=4), bf16. From megatron-core 0.18 on the non-unit group (final norm +
    output layer: 8256 elements, chunk factor 64, padded to 8320 at D=2 and 8448 at D=4)
    stays gathered too (``reset(preserve_non_fsdp_units=True)``); 0.16 and 0.17 release it.
    Unsharded weights (optim_grads) and D = 1 gather nothing."""
    layer = 36992
    groups = stage_groups(TINY, 1, 1, 0, "optim_grads_params")
    for ranks, layer_bucket, loose in ((2, 37120, 8320), (4, 37376, 8448)):
        for release in ((0, 16), (0, 17)):
            got = prefetched_after_step(
                groups, "optim_grads_params", ranks, layer, megatron_release=release
            )
            assert got == (8192 + layer_bucket) * 2
        for release in ((0, 18), (0, 19), (1, 0)):
            got = prefetched_after_step(
                groups, "optim_grads_params", ranks, layer, megatron_release=release
            )
            assert got == (8192 + layer_bucket + loose) * 2
        # the default: the newest release modelled, 0.19
        assert prefetched_after_step(groups, "optim_grads_params", ranks, layer) == (
            (8192 + layer_bucket + loose) * 2
        )
    # toy at D=2: units of 28 padded to 32, then the non-unit 48; one layer = 28 elements:
    # unit 0, and unit 1 prefetched (0 < 28), then 32 >= 28 stops; 0.18+ adds the non-unit 48
    toy = parameter_groups(_toy())
    assert prefetched_after_step(toy, "optim_grads_params", 2, 28, megatron_release=(0, 16)) == 128
    assert prefetched_after_step(toy, "optim_grads_params", 2, 28, megatron_release=(0, 19)) == 224
    # one unit only: the prefetch reaches the non-unit group (32 + 48), counted once on 0.19
    one_unit = parameter_groups([p for p in _toy() if p.unit != "u1"])
    for release in ((0, 16), (0, 19)):
        got = prefetched_after_step(one_unit, "optim_grads_params", 2, 28, megatron_release=release)
        assert got == (32 + 48) * 2
    for strategy, ranks in (("optim_grads", 2), ("optim_grads_params", 1)):
        groups = stage_groups(TINY, 1, 1, 0, strategy)
        for release in ((0, 16), (0, 19)):
            assert (
                prefetched_after_step(groups, strategy, ranks, layer, megatron_release=release) == 0
            )


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_fsdp_step_time_terms_by_hand(strategy):
    """With a 1 kB/s link the collectives dwarf the compute: every all-gather (forward and
    backward, optim_grads_params) and reduce-scatter is exposed, (n-1)/n x bytes / bandwidth,
    per micro-batch (2 here)."""
    slow = replace(HARDWARE_PROFILES["h100-80g"], intra_node_bandwidth=1e3)
    layout = Layout(dp=2, fsdp=strategy, global_batch_size=4)
    step = predict_step_time(TINY, 128, layout, slow)
    ring = 0.5 / 1e3  # (n-1)/n per byte over 1e3 B/s
    gathers = 2 * (sum(TINY_UNITS) + TINY_LOOSE) * 2 if strategy == "optim_grads_params" else 0
    reduces = (sum(TINY_UNITS) + TINY_LOOSE) * 4
    assert step.breakdown["fsdp_param_gather_exposed"] == pytest.approx(
        2 * gathers * ring, rel=1e-3
    )
    assert step.breakdown["fsdp_grad_reduce_exposed"] == pytest.approx(2 * reduces * ring, rel=1e-3)
    assert step.breakdown["dp_grad_reduce_exposed"] == 0
    if strategy == "optim_grads":  # the unsharded weights are gathered after the step
        params = 8192 + 2 * 36992 + 8256  # real parameters
        assert step.breakdown["dp_param_gather_exposed"] == pytest.approx(params * 2 * ring)
    assert (
        "fsdp_param_gather_exposed"
        not in predict_step_time(TINY, 128, Layout(dp=2), slow).breakdown
    )


def test_layout_flags_and_errors():
    layout = Layout(tp=8, cp=4, dp=1, fsdp="optim_grads")
    command = pretrain_command(get_model("llama2-70b"), 131072, layout)
    assert "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads" in command
    assert layout.to_dict()["fsdp"] == "optim_grads" and layout.rung == "ZeRO-3"
    assert Layout(recompute="qkv").rung == "recompute" and Layout().rung == "flash attention"
    with pytest.raises(ValueError, match="--data-parallel-sharding-strategy"):
        Layout(fsdp="optim-grads")
    with pytest.raises(ValueError, match="--no-distributed-optimizer"):
        Layout(fsdp="optim_grads", distributed_optimizer=False)


def test_cli_fsdp_flags(capsys):
    argv = "--model llama2-70b --tp 8 --cp 4 --num-devices 32 --device-memory 64GB --json".split()
    rc = plan_main(argv + ["--use-megatron-fsdp"])
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["fsdp"] == "optim_grads_params" and rc in (0, 1)
    assert out["fsdp_flags"][-1] == "optim_grads_params"
    assert "fsdp_param_gather_exposed" in out["step_time"]["breakdown_s"]
    assert plan_main(argv + ["--data-parallel-sharding-strategy", "optim_grads"]) == 2
    assert "needs --use-megatron-fsdp" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main(argv + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grad"])


def test_70b_128k_on_32_devices_fits_with_zero3(capsys):
    """Issue 30's must-show: 32 x 64 GB, nothing fitted without sharding; with the ZeRO-3
    rung layouts fit, with their step time and rung, each with dp x cp > 1 and a strategy
    the trainer runs on megatron-core 0.16.1."""
    argv = "--search --model llama2-70b --seq-length 131072 --num-devices 32 --device-memory 64GB".split()
    assert plan_main(argv) == 0
    text = capsys.readouterr().out
    assert "(rung: ZeRO-3)" in text and "--use-megatron-fsdp" in text
    assert plan_main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_fitting"] > 0
    for layout in out["layouts"]:
        assert layout["fits"] and layout["rung"] == "ZeRO-3"
        assert layout["layout"]["fsdp"] in ("optim_grads_params", "optim_grads")
        assert layout["layout"]["dp"] * layout["layout"]["cp"] > 1
        assert layout["step_time"]["step_time_s"] > 0
    no_zero3 = search_layouts("llama2-70b", 131072, 32, "64GB", fsdp_choices=())
    assert no_zero3 == []


def test_16_devices_fit_nowhere_honestly(capsys):
    """16 x 64 GB: 16 bytes of weights, gradients and optimizer state per parameter over at
    most 16 ranks is already 69e9 x 16 / 16 B = 64.2 GiB per device: nothing fits up to
    ZeRO-3 (--no-offload); the ladder's next rung, host offload, is tests/planning/test_offload_plan.py's."""
    argv = "--search --model llama2-70b --seq-length 131072 --num-devices 16 --device-memory 64GB --no-offload"
    assert plan_main(argv.split()) == 1
    assert "nothing fits" in capsys.readouterr().out


def test_ladder_climbs_only_when_nothing_fits_below():
    """256 devices fit without sharding: the default search stays on the lower rungs (its
    best is the recipe); climb='each' also offers ZeRO-3 layouts."""
    found = search_layouts("llama2-70b", 131072, 256, "64GB", global_batch_size=32)
    assert {c.rung for c in found} <= {"flash attention", "recompute"}
    each = search_layouts(
        "llama2-70b", 131072, 256, "64GB", global_batch_size=32, tp_choices=[8], climb="each"
    )
    assert "ZeRO-3" in {c.rung for c in each}
