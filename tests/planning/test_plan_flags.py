"""``mcore-flash plan`` speaks the trainer's language: the trainer's flag names plan the same
bytes as plan's short ones, a one-layout plan takes the trainer's defaults, and
``--from-pretrain-args`` plans what ``pretrain --dry-run`` plans."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from mcore_flash.planning.cli import main
from mcore_flash.planning.models import get_model
from mcore_flash.planning.recipes import plan_for_pretrain_args
from mcore_flash.planning.report import format_search_header
from mcore_flash.pretrain import planned_run
from mcore_flash.runtime.arguments import parse_config

from _support.launch_lines import TRAINER_SWITCHES, pretrain_argv

RUN = "--model llama2-70b --seq-length 32768 --global-batch-size 16".split()  # the trainer's too
BASE = [*RUN, "--num-devices", "64"]
# (plan's own short names, the trainer's names for the same run)
PAIRS = [
    (
        "--tp 8 --pp 2 --cp 2 --vp 2 --recompute attention --dtype bf16",
        "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --context-parallel-size 2 "
        "--num-layers-per-virtual-pipeline-stage 20 --recompute-granularity selective "
        "--recompute-modules core_attn --bf16",
    ),
    (
        "--tp 4 --pp 4 --vp 2 --recompute full",
        "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 "
        "--virtual-pipeline-model-parallel-size 2 --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1",
    ),
    (
        "--tp 8 --pp 2 --recompute qkv --recompute-num-layers 4",
        "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --recompute-granularity full "
        "--recompute-method block --recompute-num-layers 4 --recompute-modules qkv",
    ),
    (
        "--tp 8 --pp 2 --recompute attention",
        "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 "
        "--recompute-granularity selective",
    ),
]


def _json(argv: list[str], reader=None) -> dict:
    """``plan ARGV --json``'s JSON (exit 0 or 1: fits or not)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--json", *argv], pretrain_reader=reader) in (0, 1)
    return json.loads(out.getvalue())


@pytest.mark.parametrize("ours,trainers", PAIRS)
def test_the_trainers_flag_names_plan_the_same_bytes_as_plans_own(ours, trainers):
    for switches in ([], TRAINER_SWITCHES):
        short = _json([*BASE, *ours.split(), *switches])
        long = _json([*BASE, *trainers.split(), *switches])
        assert long["per_device_bytes"] == short["per_device_bytes"]
        assert (
            long["layout"] == short["layout"] and long["launch_command"] == short["launch_command"]
        )


def test_a_one_layout_plan_takes_the_trainers_defaults_and_the_search_turns_them_on():
    """Without the switches a plan is the trainer's run without them (the trainer's defaults:
    off); each one the launch line carries is the trainer's flag."""
    argv = [*BASE, "--tp", "8", "--pp", "2", "--recompute", "full"]
    plain = _json(argv)
    off = [
        f"--no-{flag[2:]}".replace("use-distributed", "distributed") for flag in TRAINER_SWITCHES
    ]
    assert _json([*argv, *off])["per_device_bytes"] == plain["per_device_bytes"]
    lay = plain["layout"]
    assert not (
        lay["sequence_parallel"] or lay["distributed_optimizer"] or lay["overlap_grad_reduce"]
    )
    switched = _json([*argv, *TRAINER_SWITCHES])
    assert switched["total_bytes_per_device"] < plain["total_bytes_per_device"]
    assert all(flag in switched["launch_command"] for flag in TRAINER_SWITCHES)
    assert not any(flag in plain["launch_command"] for flag in TRAINER_SWITCHES)
    searched = _json(["--search", *BASE, "--top", "3"])["layouts"]
    assert searched and all(
        all(flag in layout["launch_command"] for flag in TRAINER_SWITCHES) for layout in searched
    )


@pytest.mark.parametrize("ours,trainers", PAIRS)
def test_from_pretrain_args_plans_what_the_dry_run_plans(ours, trainers):
    """The trainer's parser reads the flags (its defaults: fp32 unless --bf16, each switch
    off unless given); the bytes equal the dry run's plan and plan's own flags' plan."""
    for switches in ([], TRAINER_SWITCHES):
        flags = [*RUN, *trainers.split(), *switches]
        planned = _json(["--num-devices", "64", "--from-pretrain-args", *flags], planned_run)
        dry_run = plan_for_pretrain_args(parse_config([*flags, "--dry-run"], world_size=64))
        assert planned["per_device_bytes"] == dry_run.per_device
        dtype = ["--dtype", "bf16" if "--bf16" in flags else "fp32"]
        own = _json([*BASE, *ours.split(), *switches, *dtype])
        assert planned["per_device_bytes"] == own["per_device_bytes"]


@pytest.mark.parametrize(
    "argv,problem",
    [
        (
            "--recompute full --recompute-granularity full",
            "--recompute and --recompute-granularity",
        ),
        ("--recompute-granularity full", "needs --recompute-method uniform or block"),
        ("--recompute-granularity full --recompute-method block", "needs --recompute-num-layers"),
        ("--recompute-method uniform", "need --recompute-granularity"),
        ("--pp 2 --vp 2 --num-layers-per-virtual-pipeline-stage 20", "say the same thing twice"),
        ("--pp 2 --num-layers-per-virtual-pipeline-stage 3", "not whole chunks of it"),
        ("--tp 8 --from-pretrain-args --bf16", "--tp before --from-pretrain-args"),
        ("--model llama3-70b --from-pretrain-args --bf16", "--model before --from-pretrain-args"),
    ],
)
def test_refusals_name_the_flag(capsys, argv, problem):
    assert main(argv.split(), pretrain_reader=planned_run) == 2
    assert problem in capsys.readouterr().err


def test_from_pretrain_args_needs_the_trainers_parser(capsys):
    assert main(["--from-pretrain-args", "--bf16"]) == 2
    assert "run it as `mcore-flash plan`" in capsys.readouterr().err


@pytest.mark.parametrize(
    "found,shown,verdict",
    [
        (0, 0, "no layout fits"),
        (1, 1, "1 layout fits:"),
        (3, 3, "3 layouts fit, fastest predicted step first:"),
        (47, 5, "47 layouts fit; the 5 with the fastest predicted step, fastest first:"),
        (5, 1, "5 layouts fit; the one with the fastest predicted step:"),
    ],
)
def test_the_search_header_counts_in_words(found, shown, verdict):
    header = format_search_header("llama2-70b", 32768, None, "8 x npu", found, shown)
    assert header == f"llama2-70b at 32,768 tokens on 8 x npu: {verdict}"


@pytest.mark.parametrize(
    "shape",
    [
        "--model llama3.1-70b --num-layers 8 --hidden-size 4096 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --ffn-hidden-size 11008",
        "--model tiny --num-layers 4 --hidden-size 256 --num-attention-heads 4",
        "--model llama2-7b --num-layers 4 --add-qkv-bias --qk-layernorm --kv-channels 64",
    ],
)
def test_a_launch_line_keeps_the_shape_flags(shape):
    """A plan of a preset changed by the trainer's shape flags prints them in its header and
    launch line; the launch line read back by the trainer's parser is the same shape, and
    plans the same bytes."""
    flags = [*shape.split(), "--seq-length", "4096", "--micro-batch-size", "1", "--bf16"]
    run = planned_run(flags, 8)
    planned = _json(["--num-devices", "8", "--from-pretrain-args", *flags], planned_run)
    again = planned_run(pretrain_argv(planned["launch_command"]), 8)
    assert again.model == run.model != get_model(run.model.name)
    assert (
        _json(
            [
                "--num-devices",
                "8",
                "--from-pretrain-args",
                *pretrain_argv(planned["launch_command"]),
            ],
            planned_run,
        )["per_device_bytes"]
        == planned["per_device_bytes"]
    )


def test_from_pretrain_args_plans_the_host_moments_dtype():
    """bf16 host moments (both flags) reach the plan from the trainer's flags, as from plan's."""
    run = "--model llama2-70b --seq-length 32768 --global-batch-size 16 --sequence-parallel "
    run += "--use-distributed-optimizer --optimizer-cpu-offload --bf16"
    trainer = f"{run} --tensor-model-parallel-size 8 --use-precision-aware-optimizer".split()
    own = [*f"{run} --tp 8 --num-devices 8".split()]
    for moments in ([], ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]):
        planned = _json(
            ["--num-devices", "8", "--from-pretrain-args", *trainer, *moments], planned_run
        )
        ours = _json([*own, *moments])
        assert planned["per_device_bytes"] == ours["per_device_bytes"]
        assert planned["host"] == ours["host"] and planned["layout"] == ours["layout"]
    assert planned["layout"]["host_moment_dtype"] == "bf16"
