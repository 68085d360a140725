"""An HCCL-strict process-group backend for the emulated device: gloo underneath.

``torch.distributed`` picks a group's backend by the device type of the tensors. The
backend registered here as ``"hccl"`` (:func:`register`) serves the ``npu`` device type
only, like Ascend's ``ProcessGroupHCCL``: a collective or point-to-point call on a CPU tensor
finds no backend and fails with torch's "No backend type associated with device type cpu",
exactly as on HCCL and NCCL (which serves ``cuda`` only). The npu tensors' CPU buffers go to
a gloo process group, so the results are gloo's.

What HCCL refuses is refused: reductions other than HCCL's (:func:`check_reduce_op`: ``AVG``
and ``PREMUL_SUM`` fail as on ``ProcessGroupHCCL``), and two members of a group on one host
driving the same NPU. Every c10d op on npu tensors is recorded against the HCCL communicator
torch_npu's ``ProcessGroupHCCL`` would run it on (:func:`communicators`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
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
    "Unhandled ReduceOp". Gloo underneath takes AVG (and would take or name ``PREMUL_SUM`` as
    gloo's), so without this check a rehearsal would pass megatron's
    ``average_in_collective=True``, which fails on an NPU.

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
    """When a group is created every member publishes the host and the NPU it drives (its
    current device); two members on one host with the same NPU fail the way HCCL refuses to
    build such a communicator - the symptom of ranks that never called
    ``torch.npu.set_device(LOCAL_RANK)``."""
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


# ---- the communicators a rank opens ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Group:
    """A process group: its ``group_desc`` (megatron's names, e.g.
    ``"TENSOR_MODEL_PARALLEL_GROUP"``; torch's ``"default_pg"`` for the world), its global
    ranks, and torch's ``group_name``, unique per group object: two groups of the same ranks
    are two ``ProcessGroupHCCL`` backends, each with communicators of its own."""

    desc: str
    ranks: tuple[int, ...]
    name: str


@dataclasses.dataclass(frozen=True)
class Communicators:
    """The HCCL communicators a process has opened, keyed as torch_npu's ``ProcessGroupHCCL``
    (``torch_npu/csrc/distributed/ProcessGroupHCCL.cpp``) keys them in its ``devHCCLCommMap_``:

    * ``collective``: the groups that ran a collective (a barrier is an all-reduce there), a
      batched point-to-point exchange (``batch_isend_irecv``: ``endCoalescing`` and
      ``batch_isend_irecv_inner`` run on the communicator of ``getKeyFromDevice``, the
      collectives' key) or a send/recv outside one with ``P2P_HCCL_BUFFSIZE=0``: one
      communicator of ``HCCL_BUFFSIZE`` per group (a process drives one NPU);
    * ``p2p``: ``(group, (low, high))`` for each send/recv outside a batch with
      ``P2P_HCCL_BUFFSIZE`` >= 1 (torch_npu's default 20): ``pointToPoint`` opens a 2-rank
      communicator of ``P2P_HCCL_BUFFSIZE`` per peer pair of a group, keyed by
      ``getKeySendRecv(rank, peer)`` - the pair's ranks in the group, low first.

    ``P2P_HCCL_BUFFSIZE`` is read when a send/recv is recorded; torch_npu reads it once
    (``OptionsManager::GetP2PBufferSize``): set it before the first."""

    collective: frozenset[Group]
    p2p: frozenset[tuple[Group, tuple[int, int]]]


_COLLECTIVE_GROUPS: set[Group] = set()
_P2P_PAIRS: set[tuple[Group, tuple[int, int]]] = set()
_BATCHED = [0]  # > 0 inside batch_isend_irecv
_P2P_OPS = {"c10d::send": "dst", "c10d::recv_": "src"}  # the peer argument, a rank in the group


def communicators() -> Communicators:
    """The communicators this process has opened since it started or since
    :func:`reset_communicators`.

    The device memory HCCL holds outside the allocator is a number of communicators, which
    the planner predicts (``mcore_flash/planning/communicators.py``) and the tests count
    here."""
    return Communicators(frozenset(_COLLECTIVE_GROUPS), frozenset(_P2P_PAIRS))


def reset_communicators() -> None:
    """Forget the communicators recorded so far (as a fresh process starts with none)."""
    _COLLECTIVE_GROUPS.clear()
    _P2P_PAIRS.clear()


def is_point_to_point(func) -> bool:
    """Whether c10d op ``func`` is a send or a receive (its peer must post the other side)."""
    return func._schema.name in _P2P_OPS


def record_use(func, args, kwargs) -> None:
    """Record the communicator that c10d op ``func`` (called with npu tensors) runs on
    (:class:`Communicators`); ops without a process group (``check_for_nan``) open none."""
    names = _argument_names(func)
    if "process_group" not in names:
        return
    group = _group(_argument(names, args, kwargs, "process_group"))
    peer_argument = _P2P_OPS.get(func._schema.name)
    if peer_argument is None or _BATCHED[0] or _p2p_buffer_mb() == 0:
        _COLLECTIVE_GROUPS.add(group)
        return
    peer = _argument(names, args, kwargs, peer_argument)
    rank = group.ranks.index(dist.get_rank())
    _P2P_PAIRS.add((group, (min(rank, peer), max(rank, peer))))


@functools.cache
def _argument_names(func) -> tuple[str, ...]:
    return tuple(argument.name for argument in func._schema.arguments)


def _argument(names: tuple[str, ...], args, kwargs, name: str):
    index = names.index(name)
    return args[index] if index < len(args) else kwargs[name]


def _group(boxed) -> Group:
    group = dist.ProcessGroup.unbox(boxed)  # the ScriptObject a c10d op takes
    ranks = tuple(dist.get_process_group_ranks(group))
    return Group(group.group_desc, ranks, group.group_name)


def _p2p_buffer_mb() -> int:
    """``P2P_HCCL_BUFFSIZE`` as torch_npu reads it (``OptionsManager::GetP2PBufferSize``:
    ``strtol``, default 20)."""
    return int(os.environ.get("P2P_HCCL_BUFFSIZE", "20"))


def _batch_isend_irecv(batch_isend_irecv):
    """``batch_isend_irecv`` whose sends and receives count as batched (:class:`Communicators`):
    torch_npu puts its own in ``torch.distributed`` (``_init/patches/distributed_patches.py``);
    torch's, kept here, runs gloo's ops one by one."""

    @functools.wraps(batch_isend_irecv)
    def batched(p2p_op_list):
        _BATCHED[0] += 1
        try:
            return batch_isend_irecv(p2p_op_list)
        finally:
            _BATCHED[0] -= 1

    return batched


def register() -> str:
    """Register the ``hccl`` backend (npu tensors only) and torch_npu's ``batch_isend_irecv``
    entry point; returns the backend's name."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_backend, devices=[NAME])
        batched = _batch_isend_irecv(dist.distributed_c10d.batch_isend_irecv)
        dist.batch_isend_irecv = dist.distributed_c10d.batch_isend_irecv = batched
    return BACKEND
