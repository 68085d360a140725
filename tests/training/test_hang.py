"""A rank that hangs ends the job within --distributed-timeout-minutes, naming itself; a rank
that makes progress is never ended, however long its iteration.

Oracle: the fault injected (``MCORE_FLASH_FAULT=hang@2:1``: rank 1 sleeps forever in the
forward pass of iteration 2), the checkpoint the drill's run saved before it (iteration 1)
and a resume from it; the launch itself is bounded by the drill's 600 s subprocess timeout, so a watchdog that
does not fire fails this test instead of hanging it.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import subprocess
import sys
import time

import pytest

from mcore_flash import faults
from mcore_flash.checkpoint.directory import MARKER
from mcore_flash.training import watchdog

from _support.dist_utils import run_distributed
from _support.pretrain_flags import tiny_flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
fault_drill = importlib.import_module("fault_drill")  # scripts/fault_drill.py


@pytest.mark.slow  # one 2-rank launch that waits out the limit (15 s)
def test_a_hung_rank_dumps_its_stack_names_itself_and_ends_the_job(tmp_path):
    save = str(tmp_path / "run")
    code, output = fault_drill.launch(
        save,
        fault="hang@2:1",
        extra=("--train-iters", "3", "--distributed-timeout-minutes", "0.25"),
        # every line prefixed [default<rank>]: both ranks' watchdogs dump at once
        torchrun_flags=("--tee", "3", "--log-dir", str(tmp_path / "logs")),
    )
    ended = time.time()
    assert code != 0, output[-3000:]
    stuck = "\n".join(line for line in output.splitlines() if line.startswith("[default1]:"))
    assert "fault injection: hang in the forward pass, iteration 2, rank 1" in output
    line = re.search(r"watchdog: rank 1 \(TP 0, PP 0, CP 0, DP 1\) is stuck: (.*)", stuck)
    assert line, output[-3000:]
    assert line.group(1).startswith("iteration 2 made no progress for 15 s")
    assert "in phase forward" in line.group(1)
    assert f"exiting with code {watchdog.EXIT_CODE}".lower() in line.group(1).lower()
    assert f"--load {save}" in line.group(1)
    # faulthandler's dump of the stuck rank: its main thread sleeps in the fault point
    assert re.search(r'File ".*faults\.py", line \d+ in point', stuck), stuck[-3000:]
    tracker = os.path.join(save, MARKER)
    with open(tracker) as f:
        assert f.read().strip() == "1"  # the checkpoint to resume from, named in the line
    # the tracker is the last thing iteration 1 writes: from there every rank was gone within
    # the limit + 30 s (torchrun reports once all are)
    assert ended - os.path.getmtime(tracker) < 15 + 30
    # nothing is lost: the run resumes from that checkpoint and finishes
    code, output = fault_drill.launch(save, load=True, extra=("--train-iters", "3"))
    assert code == 0 and fault_drill._resumed_from(output) == 1, output[-3000:]
    assert output.count("done:") == 1  # one summary line for the job, not one per rank


def test_hang_is_a_model_point_not_a_row_of_the_kill_drill():
    assert faults.parse("hang@2:1") == faults.Fault("hang", 2, 1)
    assert "hang" not in faults.POINTS
    with pytest.raises(ValueError, match="MCORE_FLASH_FAULT='stall@2'.*or hang"):
        faults.parse("stall@2")


@pytest.mark.parametrize("minutes", ["0", "-1", "inf"])
def test_a_timeout_that_is_not_a_positive_number_of_minutes_is_refused(minutes):
    from mcore_flash.runtime.arguments import parse_config

    with pytest.raises(ValueError, match="--distributed-timeout-minutes must be a positive"):
        parse_config(["--distributed-timeout-minutes", minutes, "--dry-run"])


WATCHED = """
import sys, time
from mcore_flash.training.watchdog import Watchdog

dog = Watchdog(1.0, "rank 0", "runs/x")
dog.begin_iteration(1)
for step in range(1, 14):  # 13 marks 0.3 s apart: 3.6 s of progress under a 1 s limit
    time.sleep(0.3)
    dog.phase(f"step {step}")
    print(f"progress {step} at {time.monotonic():.3f}", flush=True)
time.sleep(30)  # stuck: the watchdog ends the process
"""


def test_the_watchdog_times_progress_not_the_armed_work(tmp_path):
    """Oracle: the marks the script makes. An iteration that makes progress is never ended,
    however long; one that stops is ended no sooner than the limit after its last mark."""
    run = subprocess.run(
        [sys.executable, "-c", WATCHED], capture_output=True, text=True, timeout=60
    )
    ended = time.monotonic()
    assert run.returncode == watchdog.EXIT_CODE, run.stdout + run.stderr[-2000:]
    marks = re.findall(r"progress (\d+) at ([\d.]+)", run.stdout)
    assert [int(step) for step, _ in marks] == list(range(1, 14)), run.stdout
    assert (
        "iteration 1 made no progress for 1 s (--distributed-timeout-minutes), in phase step 13"
        in run.stderr
    )
    assert ended - float(marks[-1][1]) >= 1.0


def _w_one_long_iteration(rank, world_size, flags):
    from megatron.core import parallel_state

    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training import loop

    config = parse_config(flags)
    distributed.init_distributed(config)
    recipe = loop.PretrainRecipe(config)
    try:
        start = time.monotonic()
        loss, _, _ = recipe.train_step()
        seconds = time.monotonic() - start
        recipe.watchdog.timeout_s = 120  # the save's marks are checked, not its speed
        marks, mark = [], recipe.watchdog.phase
        recipe.watchdog.phase = lambda name: (marks.append(name), mark(name))
        recipe.save()
        return loss, seconds, marks
    finally:
        recipe.cleanup()
        parallel_state.destroy_model_parallel()


def test_an_iteration_of_many_micro_batches_outlasting_the_limit_completes(tmp_path):
    """Oracle: the clock. 1024 micro-batches of the tiny model under a limit of 1.2 s: the
    iteration must take several times the limit (else the test proves nothing) and finish
    (the watchdog that timed iterations ended it with code 3); the save after it marks each
    of its steps (Checkpointer.save's order)."""
    flags = tiny_flags(micro_batch_size=1, train_iters=2)
    flags += ["--global-batch-size", "1024", "--distributed-timeout-minutes", "0.02"]
    flags += ["--save", str(tmp_path / "run")]
    [(loss, seconds, save_marks)] = run_distributed(_w_one_long_iteration, 1, flags, timeout=300)
    assert math.isfinite(loss)
    assert seconds > 3 * 1.2, f"the iteration took {seconds:.1f} s: too short to outlast the limit"
    # a save marks progress at each of its steps too, in the order it takes them
    assert save_marks == [
        "save: the shards",
        "save: the RNG state",
        "save: the manifest",
        "save: the rename and the tracker",
    ]
