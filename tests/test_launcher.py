"""The test launcher (``tests/_support/dist_utils.py``) tells a failing test from a lost process.

Oracle: what each rank was made to do. A rank that raises its own error while its peer waits in
a collective is the failure reported, with its own message, and is never retried; a rank ended
by a signal is reported with that signal (and, for a fatal one, faulthandler's stack of where
it was); only such a lost rank is retried, once, with a warning the JUnit report records.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from _support.dist_utils import (
    RETRIES,
    LaunchFailed,
    LostRankRetry,
    retried_after_a_lost_rank,
    run_distributed,
)


def _w_fails_while_its_peer_waits(rank, world_size, how):
    if rank == 1:
        if how == "raise":
            raise AssertionError("rank 1's own message")
        if how == "exit":
            os._exit(3)  # as the hang watchdog exits
        os.kill(os.getpid(), getattr(signal, how))
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes
    return rank


def _launch_counting(how, launches):
    def launch(root):
        launches.append(root)
        return run_distributed(_w_fails_while_its_peer_waits, 2, how, timeout=60)

    return launch


def test_a_rank_raising_while_its_peer_waits_fails_with_its_own_message_and_is_not_retried(
    tmp_path,
):
    launches = []
    with pytest.raises(LaunchFailed) as failed:
        retried_after_a_lost_rank(_launch_counting("raise", launches), str(tmp_path))
    assert len(launches) == 1
    message = str(failed.value)
    assert message.startswith(
        "run_distributed(_w_fails_while_its_peer_waits): rank 1 failed: "
        "AssertionError: rank 1's own message"
    ), message
    assert failed.value.cause.rank == 1 and failed.value.lost_rank is None
    rank0 = failed.value.fates[0]  # the waiting peer: its lost connection is reported, not blamed
    assert rank0.status == "raised" and rank0.lost_a_peer, rank0


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSEGV"])
def test_a_rank_ended_by_a_signal_is_reported_with_it_and_retried_once_with_a_warning(
    tmp_path, how
):
    launches = []
    with pytest.warns(
        LostRankRetry, match=f"rank 1 failed: exited without a result \\(killed by {how}\\)"
    ):
        with pytest.raises(LaunchFailed) as failed:
            retried_after_a_lost_rank(_launch_counting(how, launches), str(tmp_path))
    assert launches == [str(tmp_path), str(tmp_path / "retry")]  # the retry failed the same way
    # recorded for the JUnit report; taken back, as this retry is the test's own doing (the
    # report's count is of the lost ranks nobody planned)
    assert len(RETRIES) == 1 and f"killed by {how}" in RETRIES.pop()
    lost = failed.value.lost_rank
    assert lost is not None and lost.rank == 1 and lost.signal == how
    assert str(failed.value).startswith(
        f"run_distributed(_w_fails_while_its_peer_waits): rank 1 failed: "
        f"exited without a result (killed by {how})"
    )
    if how == "SIGSEGV":  # faulthandler's stack of the crash, in the crashed rank's own frame
        assert "Fatal Python error: Segmentation fault" in lost.crash_log
        assert "_w_fails_while_its_peer_waits" in lost.crash_log
    assert failed.value.fates[0].lost_a_peer


def test_a_rank_that_chooses_to_exit_is_a_failure_not_a_lost_rank(tmp_path):
    launches = []
    with pytest.raises(
        LaunchFailed, match="rank 1 failed: exited without a result \\(exit code 3\\)"
    ):
        retried_after_a_lost_rank(_launch_counting("exit", launches), str(tmp_path))
    assert len(launches) == 1
