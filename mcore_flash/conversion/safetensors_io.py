"""Hugging Face ``*.safetensors`` checkpoints, read and written one tensor at a time.

Reading parses each file's header and reads one tensor's bytes at a time. Writing streams: the shard layout is planned from names, shapes and dtypes alone,
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
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


class HFCheckpointReader:
    """Tensors of a Hugging Face model directory by name (sharded with an index, or one file).

    Each tensor is read with ``readinto`` from its byte range, not through a memory map:
    mapped pages that were touched would stay in the process's resident set until the file
    is closed, so reading a whole checkpoint through maps makes the peak RSS the model's size.
    """

    def __init__(self, hf_dir: str):
        index_path = os.path.join(hf_dir, INDEX)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            source = INDEX
        elif os.path.isfile(os.path.join(hf_dir, SINGLE)):
            files, source = [SINGLE], SINGLE
        else:
            raise ConversionError(
                f"--hf-dir {hf_dir}: neither {INDEX} nor {SINGLE} is there (only safetensors checkpoints are read; "
                "re-save a *.bin model with transformers' save_pretrained(safe_serialization=True))"
            )
        self._dir, self._entries = hf_dir, {}
        for file in files:
            path = os.path.join(hf_dir, file)
            if not os.path.isfile(path):
                raise ConversionError(
                    f"--hf-dir {hf_dir}: shard {file} named in {source} is missing"
                )
            header, data_start = _read_header(path)
            for name, entry in header.items():
                if name != "__metadata__":
                    self._entries[name] = (path, data_start, entry)

    def names(self) -> set[str]:
        return set(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)[2]["shape"])

    def get(self, name: str) -> torch.Tensor:
        path, data_start, entry = self._entry(name)
        dtype = _TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ConversionError(
                f"{path}: tensor {name} has dtype {entry['dtype']}; supported: {sorted(_TORCH_DTYPES)}"
            )
        begin, end = entry["data_offsets"]
        data = torch.empty(end - begin, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(data_start + begin)
            if f.readinto(memoryview(data.numpy())) != end - begin:
                raise ConversionError(
                    f"{path}: truncated (tensor {name} ends past the end of the file)"
                )
        return data.view(dtype).reshape(entry["shape"])

    def _entry(self, name: str):
        if name not in self._entries:
            raise ConversionError(
                f"--hf-dir {self._dir}: tensor {name!r} is missing from the checkpoint"
            )
        return self._entries[name]


def _read_header(path: str) -> tuple[dict, int]:
    """A safetensors file's JSON header and the offset where its data starts."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < size < 100 * 2**20:
            raise ConversionError(f"{path}: not a safetensors file (bad header length)")
        try:
            return json.loads(f.read(size)), 8 + size
        except ValueError:
            raise ConversionError(f"{path}: not a safetensors file (unreadable header)") from None


class StreamingSafetensorsWriter:
    """Writes the planned tensors, in plan order, into shards of at most ``max_shard_bytes``.

    ``plan`` is ``[(name, shape, dtype)]``; :meth:`write` must be called once per entry, in
    order, and :meth:`close` writes the index (several shards) and checks nothing is missing.
    """

    def __init__(
        self,
        out_dir: str,
        plan: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
        max_shard_bytes: int,
    ):
        for _, _, dtype in plan:
            if dtype not in _DTYPES:
                raise ConversionError(
                    f"cannot write {dtype} to safetensors here; supported: {list(_DTYPES)}"
                )
        self._dir = out_dir
        self._shards = _split(plan, max_shard_bytes)
        self._plan = [entry for shard in self._shards for entry in shard]
        self._next, self._file, self._shard = 0, None, -1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._plan):
            raise AssertionError(f"{name}: every planned tensor has been written")
        planned = self._plan[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != planned:
            raise AssertionError(
                f"writing {name} {tuple(tensor.shape)} {tensor.dtype}, planned {planned}"
            )
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
            raise AssertionError(
                f"{len(missing)} planned tensors never written, first {missing[0]}"
            )
        files = [self._file_name(i) for i in range(len(self._shards))]
        if len(files) > 1:
            weight_map = {
                name: files[i] for i, shard in enumerate(self._shards) for name, _, _ in shard
            }
            total = sum(_nbytes(shape, dtype) for _, shape, dtype in self._plan)
            with open(os.path.join(self._dir, INDEX), "w") as f:
                json.dump(
                    {"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2
                )
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
            header[name] = {
                "dtype": _DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
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
