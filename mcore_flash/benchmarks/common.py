"""What the benchmark commands share: list-valued flags, the machine's load, a free port and
a one-process Megatron group."""

from __future__ import annotations

import argparse
import datetime
import os
import socket
from typing import Callable, Sequence


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers (``"512,1024"``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def choice_list(flag: str, choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type for ``flag``: a non-empty comma-separated subset of ``choices``."""

    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        if not values or any(x not in choices for x in values):
            raise argparse.ArgumentTypeError(f"{flag} takes a comma-separated list of {','.join(choices)}, got {text!r}")
        return values

    return parse


def loadavg() -> str:
    """The 1-minute load average, formatted (empty where the platform has none)."""
    try:
        return "{:.1f}".format(os.getloadavg()[0])
    except (AttributeError, OSError):
        return ""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
