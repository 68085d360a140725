"""Hugging Face ``*.safetensors`` checkpoints, read and written one tensor at a time.

Reading uses the ``safetensors`` library (memory-mapped; ``get_tensor`` materialises one
tensor). Writing streams: the shard layout is planned from names, shapes and dtypes alone,
each file's header is written first and every tensor's bytes are appended as it arrives,
so the writer never holds more than the tensor being written. The file format is
safetensors' documented one (8-byte little-endian header length, JSON header with
``dtype``/``shape``/``data_offsets``, then the raw little-endian data in header order);
several shards get Hugging Face's ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Sequence

import torch

from mcore_flash.conversion.hf_config import ConversionError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class HFCheckpointReader:
    """Tensors of a Hugging Face model directory by name (sharded with an index, or one file)."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        index_path = os.path.join(hf_dir, INDEX)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                self._file_of = json.load(f)["weight_map"]
            source = INDEX
        elif os.path.isfile(os.path.join(hf_dir, SINGLE)):
            with safe_open(os.path.join(hf_dir, SINGLE), "pt") as f:
                self._file_of = {name: SINGLE for name in f.keys()}
            source = SINGLE
        else:
            raise ConversionError(
                f"--hf-dir {hf_dir}: neither {INDEX} nor {SINGLE} is there (only safetensors checkpoints are read; "
                "re-save a *.bin model with transformers' save_pretrained(safe_serialization=True))"
            )
        for file in sorted(set(self._file_of.values())):
            if not os.path.isfile(os.path.join(hf_dir, file)):
                raise ConversionError(f"--hf-dir {hf_dir}: shard {file} named in {source} is missing")
        self._dir, self._open = hf_dir, {}
        self._safe_open = safe_open

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def _handle(self, name: str):
        if name not in self._file_of:
            raise ConversionError(f"--hf-dir {self._dir}: tensor {name!r} is missing from the checkpoint")
        file = self._file_of[name]
        if file not in self._open:
            self._open[file] = self._safe_open(os.path.join(self._dir, file), "pt")
        return self._open[file]


class StreamingSafetensorsWriter:
    """Writes the planned tensors, in plan order, into shards of at most ``max_shard_bytes``.

    ``plan`` is ``[(name, shape, dtype)]``; :meth:`write` must be called once per entry, in
    order, and :meth:`close` writes the index (several shards) and checks nothing is missing.
    """

    def __init__(self, out_dir: str, plan: Sequence[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int):
        for _, _, dtype in plan:
            if dtype not in _DTYPES:
                raise ConversionError(f"cannot write {dtype} to safetensors here; supported: {list(_DTYPES)}")
        self._dir = out_dir
        self._shards = _split(plan, max_shard_bytes)
        self._plan = [entry for shard in self._shards for entry in shard]
        self._next, self._file, self._shard = 0, None, -1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._plan):
            raise AssertionError(f"{name}: every planned tensor has been written")
        planned = self._plan[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != planned:
            raise AssertionError(f"writing {name} {tuple(tensor.shape)} {tensor.dtype}, planned {planned}")
        if self._file is None:
            self._open_next_shard()
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._next += 1
        self._written_in_shard += 1
        if self._written_in_shard == len(self._shards[self._shard]):
            self._file.close()
            self._file = None

    def close(self) -> list[str]:
        """Finish; returns the files written."""
        if self._next != len(self._plan):
            missing = [name for name, _, _ in self._plan[self._next :]]
            raise AssertionError(f"{len(missing)} planned tensors never written, first {missing[0]}")
        files = [self._file_name(i) for i in range(len(self._shards))]
        if len(files) > 1:
            weight_map = {name: files[i] for i, shard in enumerate(self._shards) for name, _, _ in shard}
            total = sum(_nbytes(shape, dtype) for _, shape, dtype in self._plan)
            with open(os.path.join(self._dir, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        return files

    def _file_name(self, i: int) -> str:
        n = len(self._shards)
        return SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"

    def _open_next_shard(self) -> None:
        self._shard += 1
        self._written_in_shard = 0
        header, offset = {}, 0
        for name, shape, dtype in self._shards[self._shard]:
            size = _nbytes(shape, dtype)
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = {"format": "pt"}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self._file = open(os.path.join(self._dir, self._file_name(self._shard)), "wb")
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _split(plan, max_shard_bytes: int) -> list[list]:
    shards, current, size = [], [], 0
    for entry in plan:
        nbytes = _nbytes(entry[1], entry[2])
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((entry[0], tuple(entry[1]), entry[2]))
        size += nbytes
    return shards + [current] if current or not shards else shards
