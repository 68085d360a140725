"""``--use-megatron-fsdp`` (ZeRO-3 by megatron-core's Megatron-FSDP) trains what the distributed
optimizer trains.

Oracle: the same run with ``--use-distributed-optimizer`` and no FSDP (megatron's own DDP and
distributed optimizer), fp32. Compared per iteration: the loss and the grad norm (a doubled
gradient hides in the loss, since Adam and clipping are scale-free: megatron-core 0.16's
Megatron-LM issue 6660 does exactly that), and after the last iteration every weight, this
gathered whole. One launch per world size runs
every configuration (process start-up dominates); the 4-rank one is ``slow``. What megatron-core
gets wrong, and flags that do not combine, are refused by name (the tests at the bottom).
"""

from __future__ import annotations

import pytest

from mcore_flash.planning.parallel_layout import RECOMPUTE_FLAGS
from mcore_flash.runtime.arguments import parse_config
from mcore_flash.runtime.config_checks import upstream_defect

from _support.dist_utils import retried_after_a_lost_rank, run_distributed
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
ZERO3 = ["--use-megatron-fsdp"]  # default strategy: optim_grads_params
ZERO2 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]
PACKED = ["--reset-attention-mask", "--reset-position-ids"]
TP2 = ["--tensor-model-parallel-size", "2"]
ATTENTION = RECOMPUTE_FLAGS["attention"]


def _fsdp_runs(world_size: int, runs: list, save_root: str, measure, **kwargs):
    """``run_distributed(w_recipe_runs, ...)``, retried once (into fresh ``--save``
    directories) after a lost rank (``dist_utils.LaunchFailed.lost_rank``)."""

    def launch(root):
        return run_distributed(w_recipe_runs, world_size, runs, root, measure, **kwargs)

    return retried_after_a_lost_rank(launch, save_root)[0]


def _weights(recipe, _) -> dict:
    return {"weights": full_weights(recipe.model_chunks[0])}


def _check(per_rank, cases):
    """``cases``: ``{run: oracle run}``; every rank's run equals its oracle."""
    for rank, results in enumerate(per_rank):
        for name, oracle in cases.items():
            assert_same_training(results[name], results[oracle], f"rank {rank} {name}")


TWO_RANKS = {
    # (run name, flags), oracle runs first; at 2 ranks DP2, and CP2 (FSDP shards over DP x CP)
    "dp2": ORACLE,
    "dp2-zero3": ZERO3,
    "dp2-zero2": ZERO2,
    "dp2-qkv": [*ORACLE, *RECOMPUTE_FLAGS["qkv"]],
    "dp2-qkv-zero3": [*ZERO3, *RECOMPUTE_FLAGS["qkv"]],
    "dp2-attention": [*ORACLE, *ATTENTION],
    "dp2-attention-zero3": [*ZERO3, *ATTENTION],
    "dp2-packed": [*ORACLE, *PACKED],
    "dp2-packed-zero3": [*ZERO3, *PACKED],
    "cp2": [*ORACLE, "--context-parallel-size", "2"],
    "cp2-zero3": [*ZERO3, "--context-parallel-size", "2"],
}
TWO_RANK_CASES = {
    "dp2-zero3": "dp2",
    "dp2-zero2": "dp2",
    "dp2-qkv-zero3": "dp2-qkv",
    "dp2-attention-zero3": "dp2-attention",
    "dp2-packed-zero3": "dp2-packed",
    "cp2-zero3": "cp2",
}


# At data x context parallel size 1 (TP2 at 2 ranks) megatron-core 0.19 trains right and
# 0.16-0.18 double the gradients (refused: test_what_megatron_core_gets_wrong_is_refused_by_name)
DP1_TRAINS = upstream_defect("optim_grads_params", 1) is None
if DP1_TRAINS:
    TWO_RANKS.update(
        {"tp2-dp1": [*ORACLE, *TP2], "tp2-dp1-zero3": [*ZERO3, *TP2]},
    )
    TWO_RANK_CASES["tp2-dp1-zero3"] = "tp2-dp1"


def test_fsdp_equals_the_distributed_optimizer_at_two_ranks(tmp_path):
    per_rank = _fsdp_runs(2, list(TWO_RANKS.items()), str(tmp_path), _weights, timeout=600)
    _check(per_rank, TWO_RANK_CASES)


NPU_RUNS = {
    name: TWO_RANKS[name]
    for name in (
        *("dp2", "dp2-zero3", "dp2-zero2", "cp2", "cp2-zero3"),
        *("dp2-qkv", "dp2-qkv-zero3", "dp2-packed", "dp2-packed-zero3"),
    )
}


def test_fsdp_equals_the_distributed_optimizer_on_the_emulated_npu(tmp_path):
    """npu tensors, HCCL-strict groups (which refuse AVG and PREMUL_SUM, and any CPU tensor in
    a collective), the npu attention backend's op doubles."""
    per_rank = _fsdp_runs(
        2,
        list(NPU_RUNS.items()),
        str(tmp_path),
        _weights,
        timeout=600,
        emulate_npu=True,
    )
    _check(per_rank, {name: TWO_RANK_CASES[name] for name in NPU_RUNS if name in TWO_RANK_CASES})


FOUR_RANKS = {
    "dp4": ORACLE,
    "dp4-zero3": ZERO3,
    "dp4-zero2": ZERO2,
    "dp4-full": [*ORACLE, *RECOMPUTE_FLAGS["full"]],
    "dp4-full-zero3": [*ZERO3, *RECOMPUTE_FLAGS["full"]],
    "tp2sp-dp2": [*ORACLE, *TP2, "--sequence-parallel"],
    "tp2sp-dp2-zero3": [*ZERO3, *TP2, "--sequence-parallel"],
    "cp2-dp2": [*ORACLE, "--context-parallel-size", "2"],
    "cp2-dp2-zero3": [*ZERO3, "--context-parallel-size", "2"],
}
FOUR_RANK_CASES = {
    "dp4-zero3": "dp4",
    "dp4-zero2": "dp4",
    "dp4-full-zero3": "dp4-full",
    "tp2sp-dp2-zero3": "tp2sp-dp2",
    "cp2-dp2-zero3": "cp2-dp2",
}


@pytest.mark.slow
def test_fsdp_equals_the_distributed_optimizer_at_four_ranks(tmp_path):
    per_rank = _fsdp_runs(4, list(FOUR_RANKS.items()), str(tmp_path), _weights, timeout=900)
    _check(per_rank, FOUR_RANK_CASES)


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--data-parallel-sharding-strategy", "optim_grads"], ["--use-megatron-fsdp"]),
        ([*ZERO3, "--ckpt-format", "torch_dist"], ["--ckpt-format fsdp_dtensor"]),
        (["--ckpt-format", "fsdp_dtensor"], ["--use-megatron-fsdp", "torch_dist"]),
        ([*ZERO3, "--fp16"], ["--fp16", "--bf16"]),
        ([*ZERO3, "--pipeline-model-parallel-size", "2"], ["--pipeline-model-parallel-size"]),
    ],
)
def test_flags_that_do_not_combine_with_fsdp_are_refused_by_name(argv, names):
    message = refusal(argv)
    assert all(name in message for name in names), message


def test_what_megatron_core_gets_wrong_is_refused_by_name():
    """Measured against the oracle on megatron-core 0.16.1 and 0.19.2: no_shard and optim train
    wrong gradients on both; size 1 doubles them before 0.19 (Megatron-LM issue 6660)."""
    for strategy in ("no_shard", "optim"):
        message = refusal(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy])
        assert f"--data-parallel-sharding-strategy {strategy}" in message, message
    if DP1_TRAINS:
        config = parse_config([*ZERO3, *TP2, *TINY], world_size=2)
        assert config.data_parallel_size == 1 and config.use_megatron_fsdp
    else:
        message = refusal([*ZERO3, *TP2])
        assert "6660" in message and "--use-distributed-optimizer" in message, message


def test_fsdp_implies_the_distributed_optimizer_and_its_checkpoint_format():
    config = parse_config([*TINY, *ZERO3], world_size=2)
    assert config.use_distributed_optimizer and config.ckpt_format == "fsdp_dtensor"
    assert config.data_parallel_sharding_strategy == "optim_grads_params"
    plain = parse_config(TINY, world_size=2)
    assert plain.ckpt_format == "torch_dist" and plain.data_parallel_sharding_strategy is None


def test_a_strategy_typo_names_the_choices(capsys):
    from mcore_flash.pretrain import main

    with pytest.raises(SystemExit):
        main([*TINY, *ZERO3, "--data-parallel-sharding-strategy", "optim_grad"])
    err = capsys.readouterr().err
    assert "--data-parallel-sharding-strategy" in err and "optim_grads_params" in err


def test_sigterm_and_divergence_stop_an_fsdp_run_as_without_it(tmp_path):
    outcomes, _ = retried_after_a_lost_rank(
        lambda root: run_distributed(w_stops, 2, root, ZERO3, timeout=300), str(tmp_path)
    )
    for outcome in outcomes:
        assert_stopped_as_without_a_wrapper(outcome)


NPU_FOUR_RANKS = {
    name: FOUR_RANKS[name]
    for name in ("dp4", "dp4-zero3", "tp2sp-dp2", "tp2sp-dp2-zero3", "cp2-dp2", "cp2-dp2-zero3")
}


@pytest.mark.slow
def test_fsdp_equals_the_distributed_optimizer_at_four_ranks_on_the_emulated_npu(tmp_path):
    per_rank = _fsdp_runs(
        4,
        list(NPU_FOUR_RANKS.items()),
        str(tmp_path),
        _weights,
        timeout=900,
        emulate_npu=True,
    )
    _check(per_rank, {name: FOUR_RANK_CASES[name] for name in NPU_FOUR_RANKS if "zero" in name})
