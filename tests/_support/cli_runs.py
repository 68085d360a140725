"""`mcore-flash` commands run as a user runs them, in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys


def convert(*argv, check=True):
    """`mcore-flash convert ...` in a fresh process; returns the CompletedProcess."""
    run = subprocess.run(
        [sys.executable, "-m", "mcore_flash.cli", "convert", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if check:
        assert run.returncode == 0, run.stderr[-3000:]
    return run
