"""An HCCL-strict process-group backend for the emulated device: gloo underneath.

``torch.distributed`` picks a group's backend by the device type of the tensors. The
backend registered here as ``"hccl"`` serves the ``npu`` device type only, like Ascend's
``ProcessGroupHCCL``: a collective or point-to-point call on a CPU tensor finds no backend
and fails with torch's "No backend type associated with device type cpu", exactly as on
HCCL and NCCL (which serves ``cuda`` only). The npu tensors' CPU buffers go to a gloo
process group, so the results are gloo's.

Reductions take HCCL's operators only (:func:`check_reduce_op`): ``AVG`` and ``PREMUL_SUM``
(which gloo underneath would take or name as gloo's) fail as on ``ProcessGroupHCCL``.

When a group is created every member publishes the host and the NPU it drives (its
current device); two members on one host with the same NPU fail the way HCCL refuses
to build such a communicator - the symptom of ranks that never called
``torch.npu.set_device(LOCAL_RANK)``.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from .runtime import NAME, runtime

BACKEND = "hccl"


def _create_backend(store, rank: int, world_size: int, timeout):
    _check_one_device_per_rank(store, rank, world_size)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


_RED_OP = dist.ReduceOp.RedOpType
# torch_npu's ProcessGroupHCCL.cpp: ``hcclOp`` (the ops HCCL has) and ``unsupportedOp``
_HCCL_REDUCE_OPS = frozenset({_RED_OP.SUM, _RED_OP.PRODUCT, _RED_OP.MIN, _RED_OP.MAX})
_REFUSED_REDUCE_OPS = frozenset({_RED_OP.AVG, _RED_OP.BAND, _RED_OP.BOR, _RED_OP.BXOR})


def check_reduce_op(reduce_op) -> None:
    """Refuse a reduction HCCL does not have, as torch_npu's ``getHcclReduceOp``
    (``torch_npu/csrc/distributed/ProcessGroupHCCL.cpp``) does before any communication:
    ``AVG`` and the bitwise ops raise "Cannot use ReduceOp.AVG with HCCL", anything else
    outside SUM/PRODUCT/MIN/MAX (``PREMUL_SUM``, made by ``_make_nccl_premul_sum``) raises
    "Unhandled ReduceOp". Gloo underneath takes AVG, so without this check a rehearsal
    would pass megatron's ``average_in_collective=True``, which fails on an NPU.

    ``reduce_op`` is the ``c10d`` op's argument (a ``ScriptObject`` of ``c10d.ReduceOp``,
    whose ``op()`` is the ``RedOpType``) or a ``dist.ReduceOp``."""
    kind = _RED_OP(reduce_op.op() if isinstance(reduce_op, torch.ScriptObject) else reduce_op)
    if kind in _HCCL_REDUCE_OPS:
        return
    if kind in _REFUSED_REDUCE_OPS:
        advice = "; reduce with SUM and divide" if kind == _RED_OP.AVG else ""
        raise RuntimeError(
            f"HCCL (emulated): Cannot use ReduceOp.{kind.name} with HCCL"
            f" (torch_npu's ProcessGroupHCCL refuses it{advice})"
        )
    raise RuntimeError(
        f"HCCL (emulated): Unhandled ReduceOp {kind.name} (torch_npu's ProcessGroupHCCL has"
        " SUM, PRODUCT, MIN and MAX only; reduce with SUM and scale)"
    )


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
