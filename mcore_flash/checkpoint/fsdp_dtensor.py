"""Megatron-FSDP checkpoints (``--ckpt-format fsdp_dtensor``): torch DCP of DTensor state dicts.

What Megatron-LM writes for this format (``megatron/training/checkpointing.py``, not in the
megatron-core wheel): ``{"model": model.state_dict_for_save_checkpoint(), "optimizer":
optimizer.sharded_state_dict(..., metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})}``
(``distrib_optimizer.py``: ``sharded_param_state_fsdp_dtensor``), every DTensor given its
uneven chunk (``distributed/fsdp/src/megatron_fsdp/uneven_dtensor.py``), saved and loaded
with ``torch.distributed.checkpoint`` (:func:`state_dict`, :func:`save`, :func:`load_into`).
Megatron-FSDP cuts each parameter's rows unevenly over the data x context parallel ranks (a
rank may hold none), so DCP's own even-split offsets are wrong and every DTensor needs its
real offset (:func:`attach_chunks`, in one collective). With them recorded, DCP's planner
reads any other cut from the stored chunks: the weights and the optimizer state resume at
another data x context parallel size (not another TP size:
:func:`mcore_flash.checkpoint.compatibility.check_fsdp_optimizer_layout`).

The counters, the scheduler and the layout are the checkpoint's common state: rank 0 writes
them to ``common.pt`` with ``torch.save`` (:func:`write_common`; the layout megatron-core
0.16's torch_dist uses), so :func:`mcore_flash.checkpoint.safe_pickles.load_common_state`
reads both formats.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mcore_flash.checkpoint.directory import FSDP_DTENSOR

COMMON = "common.pt"
MODEL_PREFIX = "model."  # the model's keys in the DCP index: "model.module.decoder.layers.0..."


def is_fsdp(model) -> bool:
    """``model`` is megatron's ``FullyShardedDataParallel`` (``--use-megatron-fsdp``)."""
    return bool(getattr(getattr(model, "ddp_config", None), "use_megatron_fsdp", False))


def state_dict(model, optimizer=None, is_loading: bool = False) -> dict:
    """The DTensor state Megatron-LM saves for ``fsdp_dtensor`` (collective: :func:`attach_chunks`).

    ``optimizer.sharded_state_dict`` with ``is_loading`` gives a fresh optimizer its Adam
    state first (``_init_optimizer_states_with_dummy_values``: one zero-gradient step; the
    scheduler's lr is 0 before warm-up, and the load overwrites the weights anyway). The
    tensors are the live ones: DCP loads into them in place.
    """
    model_state = model.state_dict_for_save_checkpoint()
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state,
            is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": FSDP_DTENSOR},
        )
    attach_chunks(state)
    return state


def save(state: dict, path: str) -> None:
    """``dcp.save`` of ``state`` into ``path`` (collective).

    ``per_thread_copy_ahead=0``: torch's ``FileSystemWriter`` otherwise takes its overlapping
    loader whenever ``torch.cuda.is_available()`` (True under ``transfer_to_npu``), which
    moves only "cuda" tensors to the CPU and then fails "Tensor must be on CPU" for npu ones
    (``torch/distributed/checkpoint/filesystem.py``); the serial loader moves every tensor.
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, per_thread_copy_ahead=0))


def load(state: dict, path: str) -> None:
    """``dcp.load`` into ``state`` in place (collective); every requested key must be stored."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=dcp.FileSystemReader(path))


def load_into(path: str, model, optimizer=None) -> dict:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``), as Megatron-LM does:
    DCP into the live DTensors, then ``load_state_dict`` of each (collective). Returns the
    loaded state."""
    state = state_dict(model, optimizer, is_loading=True)
    load(state, path)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        # megatron-FSDP's optimizer state is keyed by parameter name; its load_state_dict
        # rebuilds the param groups from "param_to_group_meta" and hands the rest to torch
        optimizer.load_state_dict(state["optimizer"])
    return state


def write_common(path: str, common: dict) -> None:
    """Rank 0 writes the common (non-sharded) state to ``path/common.pt``; collective: a
    failed write (a full disk) raises on every rank, so none waits in a later barrier."""
    from mcore_flash import platform

    error = None
    if dist.get_rank() == 0:
        try:
            torch.save(common, os.path.join(path, COMMON))
        except (OSError, RuntimeError) as caught:  # torch's C++ writer raises RuntimeError
            error = caught
    failed = torch.tensor([int(error is not None)], device=platform.torch_device())
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"rank 0 could not write {os.path.join(path, COMMON)}")


def attach_chunks(state: dict) -> None:
    """Give every DTensor in ``state`` its uneven chunk for DCP, with one collective.

    Each rank contributes ``{key: local shape}`` of the DTensors it holds (one
    ``all_gather_object`` over the world); each DTensor then gets the offsets that
    ``gather_and_compute_chunk_metadata`` would compute, and the ``__create_chunk_list__`` /
    ``__create_write_items__`` closures that ``update_uneven_dtensor_chunk_metadata`` sets
    (``uneven_dtensor.py``, alike in megatron-core 0.16 and 0.19).

    Why not megatron-core's own ``preprocess_state_dict_for_uneven_dtensor``: it finds the
    offsets with one ``all_gather_object`` per DTensor, and the ranks hold different
    optimizer keys (Adam has state only for parameters with a non-empty local shard:
    ``_init_optimizer_states_with_dummy_values`` skips empty ones), so the ranks issue
    different numbers of collectives and the save hangs. Here the offsets are computed as
    ``gather_and_compute_chunk_metadata`` does, from the one gather; a rank without a key
    writes nothing for it (DCP merges the ranks' plans).
    """
    dtensors = _dtensors(state)
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(
        shapes, {key: tuple(t._local_tensor.shape) for key, t in dtensors.items()}
    )
    for key, tensor in dtensors.items():
        _set_chunk(tensor, _chunk(tensor, key, shapes))


def _dtensors(state: dict, prefix: str = "") -> dict:
    """``{dotted key: DTensor}`` of every DTensor in the nested dict ``state``."""
    from torch.distributed.tensor import DTensor

    found = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found.update(_dtensors(value, name + "."))
        elif isinstance(value, DTensor):
            found[name] = value
    return found


def _shard_order(tensor) -> list[int]:
    """The order in which the mesh dimensions shard ``tensor``: the mesh's ``_shard_order``
    (``param_and_grad_buffer.py``: ``_get_fsdp_tensor_spec`` sets it with TP), else the
    ``_StridedShard`` dimension first, as ``gather_and_compute_chunk_metadata``."""
    from torch.distributed.tensor.placement_types import _StridedShard

    order = getattr(tensor.device_mesh, "_shard_order", None)
    if order is not None:
        return list(order)
    strided = [d for d, p in enumerate(tensor.placements) if isinstance(p, _StridedShard)]
    if len(strided) > 1:
        raise ValueError(f"a DTensor sharded by {len(strided)} strided shards is not supported")
    rest = [d for d in range(len(tensor.placements)) if d not in strided]
    return list(reversed(strided + rest))


def _chunk(tensor, key: str, shapes: list):
    """This rank's ``ChunkStorageMetadata`` of ``tensor`` from every rank's local shapes.

    ``gather_and_compute_chunk_metadata`` walks the mesh dimensions in reverse shard order;
    along a sharded one, a rank's offset grows by the extent of the ranks before it in its
    group (sorted ranks: ``new_group``'s order) and each rank's extent becomes the group's
    sum. Here every group is walked at once from the gathered shapes. A rank that lacks
    ``key`` holds an empty shard (Megatron-FSDP views a local shard as ``(-1, *shape[1:])``,
    ``make_fsdp_dtensor``): zero rows, the other extents as this rank's.
    """
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    mine = tuple(tensor._local_tensor.shape)
    mesh = tensor.device_mesh.mesh
    empty = (0, *mine[1:])
    extent = {r: list(shapes[r].get(key, empty)) for r in mesh.flatten().tolist()}
    offset = {r: [0] * len(mine) for r in extent}
    for mesh_dim in reversed(_shard_order(tensor)):
        placement = tensor.placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise ValueError(f"{key}: placement {placement} cannot be checkpointed")
        dim = placement.dim
        for group in mesh.swapdims(-1, mesh_dim).reshape(-1, mesh.size(mesh_dim)).tolist():
            group, before = sorted(group), 0
            for r in group:
                offset[r][dim] += before
                before += extent[r][dim]
            for r in group:
                extent[r][dim] = before
    rank = dist.get_rank()
    return ChunkStorageMetadata(offsets=torch.Size(offset[rank]), sizes=torch.Size(mine))


def _set_chunk(tensor, chunk) -> None:
    """The closures ``update_uneven_dtensor_chunk_metadata`` sets on the local tensor: DCP asks
    them for the chunk (load and save plans) and the write items (none for an empty shard)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    def write_items(fqn: str, dtensor) -> list:
        local = dtensor.to_local()
        if local.numel() == 0:
            return []
        return [
            WriteItem(
                type=WriteItemType.SHARD,
                index=MetadataIndex(fqn, chunk.offsets),
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(local),
                    size=dtensor.size(),
                ),
            )
        ]

    tensor._local_tensor.__create_chunk_list__ = lambda: [chunk]
    tensor._local_tensor.__create_write_items__ = write_items


def load_unsharded(path: str, model) -> None:
    """The weights of the FSDP checkpoint at ``path`` into ``model``, a bare GPTModel of a run
    without FSDP at the checkpoint's TP size (each rank alone, no collective).

    A stored DTensor is the whole parameter of this TP shard's layout: Megatron-FSDP's
    DTensor is the TP shards laid side by side on the partition dimension
    (``make_fsdp_dtensor``), so TP rank ``t`` reads the ``t``-th slice there; read chunk by
    chunk with :func:`mcore_flash.checkpoint.dcp_stream.load_chunk` (any stored chunking).
    """
    from megatron.core import parallel_state

    from mcore_flash.checkpoint import dcp_stream

    stored = dcp_stream.stored_tensors(path)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = f"{MODEL_PREFIX}module.{name}"
            if key not in stored:
                raise ValueError(f"{path}: the checkpoint has no weight {key!r} for {name}")
            shape, dtype = stored[key]
            offsets = [0] * len(shape)
            if getattr(param, "tensor_model_parallel", False):
                offsets[param.partition_dim] = tp_rank * param.shape[param.partition_dim]
            chunk = dcp_stream.Chunk(key, shape, tuple(offsets), tuple(param.shape), dtype)
            param.copy_(dcp_stream.load_chunk(path, chunk))
