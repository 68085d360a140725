"""A rank that hangs ends the job within --distributed-timeout-minutes, naming itself.

Oracle: the fault injected (``MCORE_FLASH_FAULT=hang@2:1``: rank 1 sleeps forever in the
forward pass of iteration 2), the checkpoint the drill's run saved before it (iteration 1)
and a resume from it; the launch itself is bounded by the drill's 600 s subprocess timeout, so a watchdog that
does not fire fails this test instead of hanging it.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import time

import pytest

from mcore_flash.training import faults, watchdog
from mcore_flash.training.checkpointing import MARKER

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
    assert line.group(1).startswith("iteration 2 did not finish within 15 s")
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
    from mcore_flash.training.arguments import parse_config

    with pytest.raises(ValueError, match="--distributed-timeout-minutes must be a positive"):
        parse_config(["--distributed-timeout-minutes", minutes, "--dry-run"])
