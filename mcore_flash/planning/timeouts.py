"""The limits a planned run launches with: ``--distributed-timeout-minutes`` and, on HCCL,
``HCCL_EXEC_TIMEOUT``, from the predicted longest phase (:attr:`.step_time.StepTime.longest_phase_s`).

The trainer's watchdog ends a rank that makes no progress for the limit, and the same limit
bounds every collective, in which a rank may wait for a peer's whole phase (a pipeline receive
waits for the previous stage's micro-batch): so the limit is :data:`MARGIN` x the longest
phase, at least Megatron-LM's default of 10 minutes. HCCL's own limit on a device's wait in a
collective must exceed the longest phase too, and end before the watchdog, so that the
device's error, which names the collective, comes first (docs/fault-tolerance.md): the
largest multiple of 68 s (CANN rounds it down to one; range 68-17340 s, CANN 6.0.1's
environment-variable reference) at least a minute below the limit. Without pipeline
parallelism no collective waits for a peer's whole phase (the ranks run in step and every
collective is a layer's or the step's): there a phase longer than HCCL can wait leaves
``HCCL_EXEC_TIMEOUT`` at its largest, 17340 s; with stages it is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .step_time import StepTime

__all__ = ["RunTimeouts", "run_timeouts", "MARGIN"]

MARGIN = 3.0  # the limit over the predicted longest phase (the prediction is a model)
MIN_MINUTES = 10  # Megatron-LM's default --distributed-timeout-minutes
HCCL_EXEC_TIMEOUT_UNIT_S = 68
HCCL_EXEC_TIMEOUT_MAX_S = 17340


@dataclass(frozen=True)
class RunTimeouts:
    """``distributed_timeout_minutes`` (the trainer's flag) and ``hccl_exec_timeout_s``
    (``HCCL_EXEC_TIMEOUT``, seconds; None off HCCL) for a run whose longest phase is
    ``longest_phase_s`` seconds."""

    longest_phase_s: float
    distributed_timeout_minutes: int
    hccl_exec_timeout_s: Optional[int]


def run_timeouts(step: StepTime) -> RunTimeouts:
    """The limits of ``step``'s layout on its hardware (ValueError when, with pipeline
    stages, the longest phase exceeds what HCCL can wait)."""
    longest = step.longest_phase_s
    minutes = max(MIN_MINUTES, math.ceil(MARGIN * longest / 60))
    hccl = None
    if step.hardware.collective_library == "hccl":
        below_watchdog = minutes * 60 - 60
        hccl = min(
            HCCL_EXEC_TIMEOUT_MAX_S,
            below_watchdog // HCCL_EXEC_TIMEOUT_UNIT_S * HCCL_EXEC_TIMEOUT_UNIT_S,
        )
        if hccl < longest and step.layout.pp > 1:
            raise ValueError(
                f"a phase of {longest:.0f} s is longer than HCCL_EXEC_TIMEOUT can wait "
                f"({HCCL_EXEC_TIMEOUT_MAX_S} s): use more devices or shorter sequences"
            )
    return RunTimeouts(longest, minutes, hccl)
