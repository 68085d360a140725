"""Every launch line ``mcore-flash plan --search`` prints is accepted by ``mcore-flash pretrain``.

The grid: llama2-70b on 910Bs (the default hardware profile, its capacity and headroom) at :data:`SEQ_LENGTHS` x
:data:`DEVICES`, with the search's defaults, plus :data:`OPTIONS` (the interleaved schedule
and packed documents, which the defaults never print) at 32K tokens. The lines come from the
planner's Python API (what the CLI prints, checked against the CLI at one point); each is
fed, as the string the CLI prints, to ``pretrain --dry-run`` for its device count, which
validates the flags for that many ranks and builds every stage's model, DDP / Megatron-FSDP
and optimizer from them (:mod:`mcore_flash.training.dry_run`); and the lines grouped by their
flag names (values ignored) each train one real iteration of a tiny model with those flags.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import shlex
import time

import pytest

from mcore_flash.planning import cli as plan_cli
from mcore_flash.planning.models import get_model
from mcore_flash.planning.parameters import total_parameters
from mcore_flash.planning.report import launch_line, verdict
from mcore_flash.pretrain import planned_run
from mcore_flash.runtime.arguments import parse_config

from _support.dist_utils import run_distributed
from _support.hf_models import make_tokenized_data
from _support.launch_lines import pretrain_argv
from _support.recipe_runs import TINY

MODEL = "llama2-70b"
TOKENIZER_VOCAB = (
    300  # make_tokenized_data's (make_hf_tokenizer's default), the placeholders' filling
)
DEVICES = (8, 16, 32, 64, 128, 256)
SEQ_LENGTHS = (4096, 32768, 131072)
OPTIONS = ("--interleave", "1,2", "--mean-document-length", "4K")
# (sequence length, devices, extra `plan --search` options)
GRID = (
    [(seq, n, ()) for seq in SEQ_LENGTHS for n in DEVICES]
    + [(32768, n, OPTIONS) for n in DEVICES]
    + [(131072, 4, ())]
)
# as found: every point fits; 4 devices hold llama2-70b at 128K tokens only with the weights,
# gradients and optimizer on the host, streamed layer by layer (the streaming rung)
FITS = dict.fromkeys(GRID, True)
# what the grid must cover: every rung of the memory ladder, and the flags of each kind
RUNGS = {"flash attention", "recompute", "ZeRO-3", "offload", "streaming"}
FLAG_KINDS = {
    "--sequence-parallel",
    "--overlap-grad-reduce",
    "--num-layers-per-virtual-pipeline-stage",
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "--use-precision-aware-optimizer",
    "--optimizer-cpu-offload",
    "--optimizer-offload-fraction",
    "--activation-offload-layers",
    "--grad-reduce-in-bf16",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--recompute-modules",
    "--reset-attention-mask",
    "--reset-position-ids",
    "--use-torch-fsdp2",
    "--fsdp2-offload-to-cpu",
}
# ... and the values of each kind: both recompute granularities, methods and our modules
FLAG_VALUES = {
    ("--recompute-granularity", "full"),
    ("--recompute-granularity", "selective"),
    ("--recompute-method", "uniform"),
    ("--recompute-method", "block"),
    ("--recompute-modules", "qkv"),
    ("--recompute-modules", "core_attn"),
    ("--data-parallel-sharding-strategy", "optim_grads_params"),
}
# the flags of each rung above the first (the rung's own flags: one of them at least)
RUNG_FLAGS = {
    "recompute": {"--recompute-granularity"},
    "ZeRO-3": {"--use-megatron-fsdp"},
    "offload": {"--optimizer-cpu-offload", "--activation-offload-layers", "--grad-reduce-in-bf16"},
    "streaming": {"--use-torch-fsdp2"},
}
LAUNCHER = "torchrun "


def _plan_argv(seq: int, devices: int, options: tuple) -> list[str]:
    return [
        "--search",
        "--model",
        MODEL,
        "--seq-length",
        str(seq),
        "--num-devices",
        str(devices),
        *options,
    ]


@functools.cache
def _search(seq: int, devices: int, options: tuple) -> tuple:
    """The candidates ``plan --search`` shows for this grid point (its ``--top``), by the
    function the CLI prints them from."""
    args = plan_cli.build_parser().parse_args(_plan_argv(seq, devices, options))
    return tuple(plan_cli.search_candidates(args, plan_cli.resolve_args(args))[: args.top])


@functools.cache
def _grid_lines() -> dict[str, int]:
    """``{launch line: device count}`` over the grid (a line printed at two points once)."""
    return {line: n for line, (n, _) in _grid_plans().items()}


@functools.cache
def _grid_plans() -> dict:
    """``{launch line: (device count, the planner's MemoryPlan of it)}`` over the grid."""
    return {
        candidate.launch_command: (n, candidate.plan)
        for seq, n, options in GRID
        for candidate in _search(seq, n, options)
    }


def _flag_names(line: str) -> frozenset:
    """The trainer's flags of a launch line (not torchrun's; the data placeholders' neither)."""
    return frozenset(token for token in pretrain_argv(line) if token.startswith("--"))


def _flag_values(line: str) -> set[tuple[str, str]]:
    """``{(flag, value)}`` of a launch line (a flag without a value: not listed)."""
    return {(flag, value) for flag, values in _options(pretrain_argv(line)) for value in values}


@pytest.mark.planner  # the searches alone
def test_the_grid_fits_where_found_and_covers_every_rung_and_flag_kind():
    fits = {point: bool(_search(*point)) for point in GRID}
    assert fits == FITS
    candidates = [c for point in GRID for c in _search(*point)]
    assert {c.rung for c in candidates} == RUNGS
    for candidate in candidates:  # each line carries its rung's flags
        flags = RUNG_FLAGS.get(candidate.rung, set())
        assert not flags or flags & _flag_names(candidate.launch_command), candidate.rung
        # the limits the line carries exceed its predicted longest phase
        minutes = int(
            candidate.launch_command.split("--distributed-timeout-minutes ")[1].split()[0]
        )
        longest = candidate.step.longest_phase_s
        assert minutes * 60 > longest < int(candidate.launch_env["HCCL_EXEC_TIMEOUT"])
    lines = _grid_lines()
    for line, devices in lines.items():  # torchrun with the line's processes, or on nodes of 8
        prefix = shlex.split(line)[: shlex.split(line).index("-m")]
        options = dict(_options(prefix[1:]))
        nodes = int(options.get("--nnodes", ["1"])[0])
        assert line.startswith(LAUNCHER) and ("--standalone" in options) == (nodes == 1), line
        assert nodes * int(options["--nproc-per-node"][0]) == devices, line
    names = set().union(*map(_flag_names, lines))
    assert FLAG_KINDS <= names, FLAG_KINDS - names
    values = set().union(*map(_flag_values, lines))
    assert FLAG_VALUES <= values, FLAG_VALUES - values
    parallel = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size")
    for flag in (*parallel, "--context-parallel-size"):  # each parallelism beyond 1 somewhere
        assert max(int(v) for f, v in values if f == flag) > 1, flag


def test_the_api_lines_are_the_lines_the_cli_prints():
    """At one point with every option: ``plan --search`` prints exactly the API's lines."""
    point = (32768, 64, OPTIONS)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_cli.main(_plan_argv(*point)) == 0
    printed = [line.strip() for line in out.getvalue().splitlines() if LAUNCHER in line]
    assert printed == [launch_line(c) for c in _search(*point)]
    assert any("--num-layers-per-virtual-pipeline-stage" in line for line in printed)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """What the launch lines' data placeholders are filled with (``make_tokenized_data``)."""
    return make_tokenized_data(tmp_path_factory.mktemp("launch_lines"))


@pytest.mark.slow  # the grid's searches (cached by the planner test above in py311, 40 s alone)
def test_plan_from_pretrain_args_plans_each_line_into_the_searchs_bytes():
    """Each grid line's trainer flags, read by the trainer's parser (``plan
    --from-pretrain-args``, what ``pretrain --dry-run`` plans), give the bytes per device the
    search planned: the flags mean to the trainer what they meant to the search."""
    differ = {}
    for line, (devices, plan) in _grid_plans().items():
        argv = ["--json", "--num-devices", str(devices), "--from-pretrain-args"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = plan_cli.main([*argv, *pretrain_argv(line)], pretrain_reader=planned_run)
        planned = json.loads(out.getvalue())["per_device_bytes"]
        if code != 0 or planned != plan.per_device:
            differ[line] = (code, planned, plan.per_device)
    assert not differ, differ


def _dry_runs(lines: dict[str, int], timeout: float, data: dict) -> tuple[dict, list[int]]:
    """``({line: (exit code, stdout + stderr, seconds)}, [peak RSS bytes of each process])`` of
    ``pretrain --dry-run`` for each ``{line: device count}``, the trainer's flags of the line
    with its placeholders filled (``data``'s tokenizer and data), in one launch of 2 processes:
    a process sets up one platform, so rank 0 takes the lines that build on the CPU, rank 1
    those that build on the emulated NPU (``--optimizer-cpu-offload``,
    ``--fsdp2-offload-to-cpu``: a device apart from the host)."""

    def on_host(line: str) -> bool:
        return "--optimizer-cpu-offload" in line or "--fsdp2-offload-to-cpu" in line

    offloaded = [(line, n) for line, n in lines.items() if on_host(line)]
    on_cpu = [(line, n) for line, n in lines.items() if not on_host(line)]
    assert offloaded and on_cpu
    results, peaks = {}, []
    per_rank = [on_cpu, offloaded]
    for runs, peak in run_distributed(_w_dry_runs, 2, per_rank, data, timeout=timeout):
        results.update(runs)
        peaks.append(peak)
    assert set(results) == set(lines)
    return results, peaks


def _w_dry_runs(rank, world_size, per_rank: list, data: dict) -> tuple[dict, int]:
    """Worker: ``({line: (exit code, stdout + stderr, seconds)}, peak RSS bytes)`` of
    ``pretrain --dry-run`` (in this process, WORLD_SIZE = the line's device count) for
    ``per_rank[rank]``'s ``(line, device count)``."""
    import resource

    import torch.distributed as dist

    from mcore_flash.pretrain import main

    dist.destroy_process_group()  # the dry run makes its own (fake) world
    results = {}
    for line, devices in per_rank[rank]:
        os.environ["WORLD_SIZE"] = str(devices)
        out = io.StringIO()
        started = time.perf_counter()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                argv = pretrain_argv(
                    line, DATA_PATH=data["data"], TOKENIZER_MODEL=data["tokenizer"]
                )
                code = main([*argv, "--dry-run"])
        except SystemExit as error:  # argparse: a flag the trainer does not know
            code = error.code
        except Exception as error:  # noqa: BLE001 - what a constructor raised, reported per line
            code = f"{type(error).__name__}: {error}"
            out.write(f"\nerror: {code}")
        results[line] = (code, out.getvalue(), time.perf_counter() - started)
    return results, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def test_the_dry_run_builds_ddp_fsdp_and_the_offloaded_optimizer_the_flags_ask_for(data):
    """Three planner lines (the interleaved schedule, ZeRO-3, host offload), each dry-run for
    its device count: the model chunks in DDP or Megatron-FSDP and megatron's distributed
    optimizer, offloaded (``HybridDeviceOptimizer``, on the emulated NPU) where asked, at a
    few hundred MB per process (the full 70B shape only on the meta device)."""
    wanted = {  # (grid point, a flag of the line, what the dry run must build)
        (32768, 256, OPTIONS): (
            "--num-layers-per-virtual-pipeline-stage",
            "2 x DistributedDataParallel",
        ),
        (131072, 32, ()): ("--use-megatron-fsdp", "1 x FullyShardedDataParallel"),
        (131072, 8, ()): ("--optimizer-cpu-offload", "DistributedOptimizer(HybridDeviceOptimizer)"),
    }
    lines, built = {}, {}
    for point, (flag, what) in wanted.items():
        line = next(c.launch_command for c in _search(*point) if flag in c.launch_command)
        lines[line], built[line] = point[1], what
    results, peaks = _dry_runs(lines, timeout=300, data=data)
    for line, (code, out, _) in results.items():
        assert code == 0 and built[line] in out, (line, out[-2000:])
        assert _parameters_line(line) in out
    assert max(peaks) < 2 * 2**30, peaks


@pytest.mark.slow
def test_every_launch_line_passes_the_dry_run(data):
    """Each line, for its device count: exit 0 (flags accepted, DDP / FSDP and the optimizer
    built, the trainer's own plan fits), with what the flags ask for really built, and the
    trainer's plan of the flags is the planner's (the same bytes per device: the flags mean
    to the trainer what they meant to the search)."""
    results, peaks = _dry_runs(_grid_lines(), timeout=1500, data=data)
    assert max(peaks) < 2 * 2**30, peaks  # the 70B shape only ever on the meta device
    refused = {line: out for line, (code, out, _) in results.items() if code != 0}
    replanned = {  # the trainer's verdict differs from the planner's: the flags lost a meaning
        line: f"the trainer plans {_verdict(results[line][1])!r}, the planner {verdict(plan)!r}"
        for line, (_, plan) in _grid_plans().items()
        if line not in refused and _verdict(results[line][1]) != verdict(plan)
    }
    assert not (refused or replanned), _report(refused, replanned)
    for line, (_, out, _) in results.items():
        assert "FITS" in out and _parameters_line(line) in out, line
        vp = "--num-layers-per-virtual-pipeline-stage" in line
        if "--use-torch-fsdp2" in line:  # FSDP2 shards: megatron's plain fp32 optimizer
            assert ": 1 x TorchFSDP2, optimizer ChainedOptimizer[FP32Optimizer(AdamW)]" in out, line
            continue
        wrapper = (
            "FullyShardedDataParallel"
            if "--use-megatron-fsdp" in line
            else "DistributedDataParallel"
        )
        assert f": {2 if vp else 1} x {wrapper}, optimizer" in out, (line, out)
        inner = "HybridDeviceOptimizer" if "--optimizer-cpu-offload" in line else "(AdamW)"
        assert inner in out and "DistributedOptimizer" in out, (line, out)


def _parameters_line(line: str) -> str:
    """The dry run's count of the full model the line trains (its preset's shape, meta device)
    with the ``data`` tokenizer's vocabulary, padded as megatron pads it to a multiple of
    128 x TP: the planner's formula (``total_parameters``) for that shape."""
    tp = int(dict(_options(pretrain_argv(line)))["--tensor-model-parallel-size"][0])
    vocab = -(-TOKENIZER_VOCAB // (128 * tp)) * 128 * tp
    count = total_parameters(get_model(MODEL).with_(vocab_size=vocab))
    return f"total parameters: {count:,}"


def _verdict(out: str) -> str:
    """The plan's verdict line in a dry run's output ("FITS: ..." / "DOES NOT FIT: ...")."""
    found = [line for line in out.splitlines() if line.startswith(("FITS", "DOES NOT FIT"))]
    return found[-1] if found else "(none)"


def _report(refused: dict, replanned: dict) -> str:
    """The refused lines with their error, and the lines the trainer plans differently."""
    lines = _grid_lines()
    errors = {  # the trainer's error; or, exit 1, its verdict
        line: next((x for x in out.splitlines() if "error:" in x), _verdict(out))
        for line, out in refused.items()
    }
    return (
        f"of {len(lines)} launch lines, {len(refused)} refused or not fitting by the dry run, "
        f"{len(replanned)} planned differently by the trainer:\n"
        + "\n".join(
            f"\nWORLD_SIZE={lines[line]} {line} --dry-run\n  -> {error}"
            for line, error in {**errors, **replanned}.items()
        )
    )


# --- one tiny iteration per distinct flag set ------------------------------------------------

# the tiny value of each numeric flag of a launch line (layers: 4 per model, 1 per chunk)
TINY_VALUES = {
    "--seq-length": "64",
    "--micro-batch-size": "1",
    "--global-batch-size": "4",
    "--context-parallel-size": "1",
    "--num-layers-per-virtual-pipeline-stage": "1",
    "--activation-offload-layers": "1",
    "--recompute-num-layers": "1",
    "--train-iters": "1",  # the launch line's placeholders: the user's
    "--lr": "1e-3",
}


def _options(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``[(flag, its values)]`` of ``argv``, in order."""
    out = []
    for token in argv:
        if token.startswith("--"):
            out.append((token, []))
        else:
            out[-1][1].append(token)
    return out


def tiny_run(line: str) -> tuple[list[str], int, bool]:
    """``(flags, world size, on the emulated NPU)``: ``line``'s flags (the preset's model
    flags included) at :data:`~_support.recipe_runs.TINY`'s shape with 4 layers, and the fewest
    ranks its flags need: TP 2 with ``--sequence-parallel``, PP 2 with the interleaved schedule,
    data-parallel ranks for the rest (Megatron-FSDP shards over 2 of them; megatron-core 0.16
    refuses it over 1), at least 2: so 4 for ``--sequence-parallel`` with the interleaved
    schedule or with Megatron-FSDP, 2 otherwise; offloaded optimizers and streamed weights on
    the emulated NPU (the CPU path has no device to offload from)."""
    names = _flag_names(line)
    tp = 2 if "--sequence-parallel" in names else 1
    pp = 2 if "--num-layers-per-virtual-pipeline-stage" in names else 1
    dp = 2 if "--use-megatron-fsdp" in names else 1
    values = {
        **TINY_VALUES,
        "--tensor-model-parallel-size": str(tp),
        "--pipeline-model-parallel-size": str(pp),
    }
    flags = [*TINY, "--num-layers", "4", "--train-iters", "1", "--lr-warmup-iters", "0"]
    for flag, given in _options(pretrain_argv(line)):
        flags += [flag, *([values[flag]] if flag in values else given)]
    on_host = {"--optimizer-cpu-offload", "--fsdp2-offload-to-cpu"}
    return flags, max(2, tp * pp * dp), bool(on_host & names)


def _distinct_flag_sets() -> dict[frozenset, str]:
    """``{flag names: the first grid line with them}``."""
    sets = {}
    for line in _grid_lines():
        sets.setdefault(_flag_names(line), line)
    return sets


def _w_one_iteration(rank, world_size, runs: list, save_root: str) -> dict:
    """Worker: ``{name: (loss, grad norm) or the error}`` of one training iteration per run
    (the trainer's :class:`PretrainRecipe`, as ``pretrain`` sets it up); a run that fails
    does not stop the others."""
    import traceback

    from megatron.core import parallel_state

    from mcore_flash.runtime import distributed
    from mcore_flash.training import loop

    results = {}
    for name, flags in runs:
        recipe = None
        try:
            config = parse_config([*flags, "--save", f"{save_root}/{name}"])
            distributed.init_distributed(config)
            recipe = loop.PretrainRecipe(config)
            results[name] = recipe.train_step()[:2]
        except Exception:  # noqa: BLE001 - reported per flag set
            results[name] = traceback.format_exc(limit=-3)
        finally:
            if recipe is not None:
                recipe.cleanup()
            parallel_state.destroy_model_parallel()
    return results


@pytest.mark.slow
def test_each_distinct_flag_set_trains_one_tiny_iteration(tmp_path):
    """One launch per (world size, device kind), one run per distinct set of flag names:
    finite loss and gradient norm on every rank (the loss on the last pipeline stage)."""
    sets = _distinct_flag_sets()
    launches: dict[tuple[int, bool], list] = {}
    ordered = [sets[names] for names in sorted(sets, key=sorted)]
    for index, line in enumerate(ordered):
        flags, world, emulated = tiny_run(line)
        launches.setdefault((world, emulated), []).append((f"set{index}", flags, line))
    failed, trained = {}, 0
    for (world, _), runs in launches.items():  # flags the trainer refuses: no processes for them
        for name, flags, line in list(runs):
            try:
                parse_config(flags, world_size=world)
            except ValueError as error:
                failed[line] = f"{world} ranks: refused: {error}"
                runs.remove((name, flags, line))
    for (world, emulated), runs in sorted(launches.items()):
        if not runs:
            continue
        per_rank = run_distributed(
            _w_one_iteration,
            world,
            [(name, flags) for name, flags, _ in runs],
            str(tmp_path / f"w{world}{'npu' if emulated else 'cpu'}"),
            timeout=900,
            emulate_npu=emulated,
        )
        for name, flags, line in runs:
            outcomes = [results[name] for results in per_rank]
            errors = [o for o in outcomes if isinstance(o, str)]
            if errors:
                where = f"{world} ranks{' (emulated NPU)' if emulated else ''}"
                failed[line] = f"{where}: {errors[0].strip().splitlines()[-1]}"
                continue
            losses = [loss for loss, _ in outcomes if loss is not None]
            assert losses and all(math.isfinite(loss) for loss in losses), (flags, outcomes)
            assert all(math.isfinite(norm) for _, norm in outcomes), (flags, outcomes)
            trained += 1
    assert not failed, f"{len(failed)} of {len(sets)} flag sets did not train:\n" + "\n".join(
        f"\nflags of {line}\n  -> {error}" for line, error in failed.items()
    )
    assert trained == len(sets)
