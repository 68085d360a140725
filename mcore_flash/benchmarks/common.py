"""What the benchmark commands share: units, dtype names, list-valued flags, the machine's
load, the process's peak memory, step timing, progress lines, a free port and a one-process
Megatron group."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time
from typing import Callable, Iterator, Optional, Sequence

import torch

from mcore_flash.ports import free_port

MIB = 2**20  # bytes
GIB = 2**30  # bytes
# --dtype names -> torch dtypes (a benchmark that cannot take all of them offers a subset)
DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers (``"512,1024"``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def choice_list(flag: str, choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type for ``flag``: a non-empty comma-separated subset of ``choices``."""

    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        if not values or any(x not in choices for x in values):
            raise argparse.ArgumentTypeError(
                f"{flag} takes a comma-separated list of {','.join(choices)}, got {text!r}"
            )
        return values

    return parse


def loadavg() -> str:
    """The 1-minute load average, formatted (empty where the platform has none)."""
    try:
        return "{:.1f}".format(os.getloadavg()[0])
    except (AttributeError, OSError):
        return ""


def _status_kib(field: str) -> Optional[int]:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in KiB; None where the
    platform has no such file (not Linux) or the field is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss() -> Optional[int]:
    """This process's peak resident set size in bytes since it started or since the last
    :func:`reset_peak_rss` (Linux ``VmHWM``); None where the platform does not report it.

    Unlike ``getrusage``'s ``ru_maxrss`` it is this process's own, not inherited from the
    parent across ``fork``/``exec``, and it can be reset."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> Optional[int]:
    """Lower the kernel's peak-RSS mark (:func:`peak_rss`) to the current RSS (Linux
    ``/proc/self/clear_refs``); returns that current RSS in bytes, or None where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return None
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


@contextlib.contextmanager
def timed(wall_ms: list[float], cpu_ms: list[float]) -> Iterator[None]:
    """Time the ``with`` body: append its wall-clock time to ``wall_ms`` and this process's
    CPU time (all threads) to ``cpu_ms``, both in milliseconds."""
    start, start_cpu = time.perf_counter(), time.process_time()
    yield
    wall_ms.append((time.perf_counter() - start) * 1e3)
    cpu_ms.append((time.process_time() - start_cpu) * 1e3)


def progress_log(command: str) -> Callable[[str], None]:
    """A ``log(message)`` that writes ``[command] message`` to stderr, flushed at once."""

    def log(message: str) -> None:
        print(f"[{command}] {message}", file=sys.stderr, flush=True)

    return log


class MegatronGroup:
    """Context: a one-process gloo group with Megatron's model-parallel state on the CPU
    platform (:func:`mcore_flash.platform.setup`), torn down on exit if it started them."""

    def __init__(self) -> None:
        self.started_dist = False

    def __enter__(self) -> "MegatronGroup":
        from mcore_flash import platform

        platform.setup("cpu")
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel

        if not dist.is_initialized():
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=datetime.timedelta(seconds=60),
            )
            self.started_dist = True
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        return self

    def __exit__(self, *exc) -> None:
        if not self.started_dist:
            return
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
