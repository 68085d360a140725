"""Process groups for training: torchrun or a single process, and a fake world for dry runs."""

from __future__ import annotations

import datetime
import os
import random

import numpy
import torch
import torch.distributed as dist

from mcore_flash import platform
from mcore_flash.ports import free_port
from mcore_flash.runtime.config import TrainingConfig

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def init_distributed(config: TrainingConfig) -> str:
    """Set up the device and ``torch.distributed`` + megatron's parallel state; returns the device.

    Under ``torchrun`` the usual RANK/WORLD_SIZE/MASTER_* variables are used; otherwise a
    one-process group on 127.0.0.1. ``config.world_size`` must match the real world size.

    A collective that has not completed after ``config.distributed_timeout_minutes``
    (Megatron-LM's ``--distributed-timeout-minutes``, default 10) fails, in the default
    process group and in megatron's TP/PP/CP/DP groups alike (megatron-core's own default
    for those is 30 minutes; Megatron-LM passes its flag to both, as here). The minutes are
    a float, where Megatron-LM takes an int: every value it accepts means the same here,
    and a test can ask for a few seconds through the flag itself (0.1 = 6 s) instead of a
    switch that only tests would use. The watchdog (:mod:`mcore_flash.training.watchdog`) uses the same limit
    per iteration and per save.
    """
    device = platform.setup()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != config.world_size:
        raise ValueError(
            f"WORLD_SIZE={world_size} but the flags were validated for {config.world_size} ranks"
        )
    if not dist.is_initialized():
        dist.init_process_group(
            _BACKENDS[device],
            rank=int(os.environ["RANK"]),
            world_size=world_size,
            timeout=datetime.timedelta(minutes=config.distributed_timeout_minutes),
        )
    _init_parallel_state(config, distributed_timeout_minutes=config.distributed_timeout_minutes)
    return device


def init_fake_world(config: TrainingConfig) -> None:
    """A single-process stand-in for ``config.world_size`` ranks (rank 0), for ``--dry-run``.

    torch's ``fake`` process-group backend accepts any world size and makes collectives
    no-ops, so megatron's parallel state and model code see the real layout.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    platform.setup("cpu")
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=config.world_size, store=FakeStore())
    _init_parallel_state(config, create_gloo_process_groups=False)


def _init_parallel_state(config: TrainingConfig, **kwargs) -> None:
    """megatron's TP/PP/CP groups (``kwargs``: more of ``initialize_model_parallel``'s), then the seeds."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
            context_parallel_size=config.context_parallel_size,
            **kwargs,
        )
    set_random_seed(config.seed)


def set_random_seed(seed: int) -> None:
    """Megatron-LM's ``_set_random_seed``: python, numpy and torch (CPU and every device)
    from ``seed + 100 * pipeline rank``, then megatron's device generator and TP tracker.

    The weights are drawn on the CPU (``use_cpu_initialization``), so every replica of a
    data-parallel group and every tensor-parallel shard starts from the same master weights.
    """
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down megatron's parallel state and the process group (either may be absent)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
