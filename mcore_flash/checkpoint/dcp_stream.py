"""Stream tensors into and out of a ``torch.distributed.checkpoint`` (DCP) directory, one
chunk at a time.

megatron's ``dist_checkpointing`` ("torch_dist" format) stores every ``ShardedTensor`` as a
DCP tensor under its key, with its global shape and the chunks that were written; a loader
reads whatever chunks overlap what it asks for. So a checkpoint is fully described by
``(key, global shape, dtype, chunk offsets, chunk sizes)``; these planners write and read
such chunks through DCP's own planner extension points (``resolve_data``,
``create_local_plan``/``resolve_tensor``), asking a callback for each chunk's data only
when DCP writes it. Peak memory is one chunk (plus what the callback holds), never the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings
from typing import Callable, Sequence

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stored piece of the tensor ``key``: ``sizes`` elements at ``offsets`` of ``global_shape``."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class BytesItem:
    """A pickled object stored under ``key`` (megatron's ``ShardedObject``s)."""

    key: str
    value: object


class _ChunkSavePlanner(DefaultSavePlanner):
    def __init__(
        self,
        chunks: Sequence[Chunk],
        objects: Sequence[BytesItem],
        data: Callable[[Chunk], torch.Tensor],
    ):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {MetadataIndex(c.key, torch.Size(c.offsets)): c for c in chunks}
        self._objects = {MetadataIndex(o.key): o.value for o in objects}
        self._data = data

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=index,
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)
                    ),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            )
            for index, c in self._chunks.items()
        ]
        items += [WriteItem(index=index, type=WriteItemType.BYTE_IO) for index in self._objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self._objects[write_item.index], buffer)
            return buffer
        chunk = self._chunks[write_item.index]
        tensor = self._data(chunk)
        if tuple(tensor.shape) != chunk.sizes or tensor.dtype != chunk.dtype:
            raise AssertionError(
                f"{chunk.key}: produced {tuple(tensor.shape)} {tensor.dtype}, planned {chunk}"
            )
        return tensor


def save_chunks(
    path: str,
    chunks: Sequence[Chunk],
    objects: Sequence[BytesItem],
    data: Callable[[Chunk], torch.Tensor],
) -> None:
    """Write a DCP checkpoint in ``path`` holding ``chunks`` (data from ``data(chunk)``, called
    once per chunk while writing) and ``objects``; one process, no process group."""
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, thread_count=1)
    with _single_process():
        dcp.save(
            {},
            storage_writer=writer,
            planner=_ChunkSavePlanner(chunks, objects, data),
            no_dist=True,
        )


class _ChunkLoadPlanner(DefaultLoadPlanner):
    def __init__(self, chunk: Chunk, out: torch.Tensor):
        super().__init__(
            flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True
        )
        self._chunk, self._out = chunk, out

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata.get(self._chunk.key)
        if stored is None:
            raise KeyError(f"the checkpoint has no tensor {self._chunk.key!r}")
        if tuple(stored.size) != self._chunk.global_shape:
            raise ValueError(
                f"{self._chunk.key}: the checkpoint stores shape {tuple(stored.size)}, expected {self._chunk.global_shape}"
            )
        wanted = ChunkStorageMetadata(
            offsets=torch.Size(self._chunk.offsets), sizes=torch.Size(self._chunk.sizes)
        )
        return LoadPlan(create_read_items_for_chunk_list(self._chunk.key, stored, [wanted]))

    def resolve_tensor(self, read_item):
        return _narrow(self._out, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor handed out a view of the output: DCP copied into it


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def load_chunk(path: str, chunk: Chunk) -> torch.Tensor:
    """Read one chunk of a stored tensor (any chunking it was saved with) into a new tensor."""
    out = torch.empty(chunk.sizes, dtype=chunk.dtype)
    reader = dcp.FileSystemReader(path)
    with _single_process():
        dcp.load({}, storage_reader=reader, planner=_ChunkLoadPlanner(chunk, out), no_dist=True)
    return out


def stored_tensors(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (global shape, dtype)}`` of every tensor in the DCP checkpoint at ``path``."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {
        key: (tuple(md.size), md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if hasattr(md, "chunks")
    }


@contextlib.contextmanager
def _single_process():
    """DCP warns that it runs without a process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
