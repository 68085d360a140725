"""An HCCL-strict process-group backend for the emulated device: gloo underneath.

``torch.distributed`` picks a group's backend by the device type of the tensors. The
backend registered here as ``"hccl"`` serves the ``npu`` device type only, like Ascend's
``ProcessGroupHCCL``: a collective or point-to-point call on a CPU tensor finds no backend
and fails with torch's "No backend type associated with device type cpu", exactly as on
HCCL and NCCL (which serves ``cuda`` only). The npu tensors' CPU buffers go to a gloo
process group, so the results are gloo's.

When a group is created every member publishes the host and the NPU it drives (its
current device); two members on one host with the same NPU fail the way HCCL refuses
to build such a communicator - the symptom of ranks that never called
``torch.npu.set_device(LOCAL_RANK)``.
"""

from __future__ import annotations

import socket

import torch.distributed as dist

from .runtime import NAME, runtime

BACKEND = "hccl"


def _create_backend(store, rank: int, world_size: int, timeout):
    _check_one_device_per_rank(store, rank, world_size)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def _check_one_device_per_rank(store, rank: int, world_size: int) -> None:
    here = f"{socket.gethostname()}/{NAME}:{runtime().current_device()}"
    store.set(f"mcore_flash_emulated_hccl_device_{rank}", here)
    owners: dict[str, int] = {}
    for other in range(world_size):
        device = store.get(f"mcore_flash_emulated_hccl_device_{other}").decode()
        if device in owners:
            raise RuntimeError(
                f"HCCL (emulated): ranks {owners[device]} and {other} of this group both drive {device}; "
                "each rank must call torch.npu.set_device(LOCAL_RANK) before creating process groups"
            )
        owners[device] = other


def register() -> str:
    """Register the ``hccl`` backend (npu tensors only); returns its name."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_backend, devices=[NAME])
    return BACKEND
