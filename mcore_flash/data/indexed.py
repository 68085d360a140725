"""Megatron ``.bin/.idx`` indexed datasets: atomic writing and a strict pre-flight check.

Writing goes through megatron's own ``IndexedDatasetBuilder`` (so the files are exactly what
Megatron-LM's ``tools/preprocess_data.py`` writes and its ``IndexedDataset`` reads), into
temporary names that are renamed into place only after ``finalize`` succeeded.

The ``.idx`` layout (megatron-core ``indexed_dataset.py``, version 1)::

    b"MMIDIDX\\x00\\x00"  <Q version=1>  <B dtype code>  <Q sequence count n>  <Q document count d>
    int32[n] sequence lengths   int64[n] byte offsets into .bin   int64[d] document boundaries
    (int8[n] sequence modes, multimodal only)

megatron's reader checks only the magic and the version; a truncated or damaged index makes it
fail later with a bare ``AssertionError``, ``ValueError: buffer is smaller than requested size``
or reads garbage. :func:`check_indexed_dataset` checks everything above plus the ``.bin`` size
and (a prefix of) the token ids against the tokenizer, and raises :class:`DataError` naming the
file and the fix.
"""

from __future__ import annotations

import contextlib
import glob
import os
import struct
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy

from mcore_flash.data.errors import DataError

__all__ = ["IndexSummary", "check_indexed_dataset", "atomic_indexed_dataset_builder", "token_dtype"]

_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
_DTYPES = {
    1: numpy.uint8,
    2: numpy.int8,
    3: numpy.int16,
    4: numpy.int32,
    5: numpy.int64,
    8: numpy.uint16,
}
_FLOAT_CODES = {6: "float64", 7: "float32"}
_CHUNK = 1 << 22


def token_dtype(vocab_size: int) -> type:
    """megatron's ``DType.optimal_dtype``: uint16 below 65500 ids, else int32."""
    return numpy.uint16 if vocab_size < 65500 else numpy.int32


@dataclass
class IndexSummary:
    """What :func:`check_indexed_dataset` found."""

    prefix: str
    dtype: type
    num_sequences: int
    num_documents: int
    num_tokens: int
    sequence_lengths: numpy.ndarray  # int32[num_sequences], memory-mapped
    max_token_checked: Optional[
        int
    ]  # max id over the scanned prefix of the .bin (None: not scanned)


def _rerun_hint() -> str:
    return "re-create it with `mcore-flash preprocess` (or delete the .bin/.idx pair and rerun the job that wrote it)"


def check_indexed_dataset(
    prefix: str,
    *,
    arg: str = "--data-path",
    vocab_size: Optional[int] = None,
    tokenizer_name: str = "the tokenizer",
    scan_tokens: int = 1 << 24,
) -> IndexSummary:
    """Validate ``prefix.idx``/``prefix.bin`` before megatron touches them.

    ``vocab_size``: when given, the first ``scan_tokens`` token ids of the ``.bin`` must be
    below it (catches data preprocessed with another tokenizer). Raises :class:`DataError`.
    """
    where = f"{arg} {prefix}"
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            raise DataError(
                f"{where}: pass the path prefix without {suffix}, i.e. {arg} {prefix[: -len(suffix)]}"
            )
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            hint = "run `mcore-flash preprocess` first"
            near = sorted(glob.glob(glob.escape(prefix) + "_*_document.idx"))
            if near:
                hint = f"did you mean {arg} {near[0][: -len('.idx')]}? (preprocess appends _<key>_document)"
            raise DataError(f"{where}: {path} not found; {hint}")

    def corrupt(reason: str, path: str = idx_path) -> DataError:
        return DataError(f"{where}: {path} is corrupt ({reason}); {_rerun_hint()}")

    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES:
        raise corrupt(f"truncated: {idx_size} bytes, shorter than the {_HEADER_BYTES}-byte header")
    if head[:9] != _HEADER:
        raise corrupt(f"not a Megatron index: bad magic {head[:9]!r}, expected {_HEADER!r}")
    version, code, n, d = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise corrupt(f"unsupported index version {version}, expected 1")
    if code in _FLOAT_CODES:
        raise corrupt(f"token dtype {_FLOAT_CODES[code]} is not a token id type")
    if code not in _DTYPES:
        raise corrupt(f"unknown token dtype code {code}")
    dtype = _DTYPES[code]
    itemsize = numpy.dtype(dtype).itemsize
    expected = _HEADER_BYTES + n * 4 + n * 8 + d * 8
    if idx_size < expected:
        raise corrupt(
            f"truncated: {idx_size} bytes, but its header announces {n} sequences and "
            f"{d - 1 if d else 0} documents = {expected} bytes"
        )
    if idx_size not in (expected, expected + n):  # + n: the optional multimodal modes
        raise corrupt(f"{idx_size} bytes, expected {expected} for {n} sequences and {d} boundaries")
    if d < 1:
        raise corrupt("no document boundaries")

    mm = numpy.memmap(idx_path, mode="r", dtype=numpy.uint8)
    lengths = numpy.frombuffer(mm, dtype=numpy.int32, count=n, offset=_HEADER_BYTES)
    pointers = numpy.frombuffer(mm, dtype=numpy.int64, count=n, offset=_HEADER_BYTES + 4 * n)
    doc_idx = numpy.frombuffer(mm, dtype=numpy.int64, count=d, offset=_HEADER_BYTES + 12 * n)

    if doc_idx[0] != 0 or doc_idx[-1] != n:
        raise corrupt(
            f"document boundaries run from {doc_idx[0]} to {doc_idx[-1]}, expected 0 to {n}"
        )
    total = 0
    for start in range(0, n, _CHUNK):
        ln = lengths[start : start + _CHUNK].astype(numpy.int64)
        if ln.size and ln.min() < 0:
            raise corrupt(f"negative sequence length near sequence {start + int(numpy.argmin(ln))}")
        expect_ptr = (total + numpy.concatenate(([0], numpy.cumsum(ln)[:-1]))) * itemsize
        bad = numpy.nonzero(pointers[start : start + _CHUNK] != expect_ptr)[0]
        if bad.size:
            i = start + int(bad[0])
            raise corrupt(
                f"sequence {i} points at byte {pointers[i]}, expected {expect_ptr[bad[0]]}"
            )
        total += int(ln.sum())
    for start in range(0, d, _CHUNK):
        chunk = doc_idx[max(start - 1, 0) : start + _CHUNK]
        if chunk.size > 1 and (numpy.diff(chunk) < 0).any():
            raise corrupt("document boundaries are not increasing")

    bin_size = os.path.getsize(bin_path)
    if bin_size != total * itemsize:
        state = "truncated" if bin_size < total * itemsize else "longer than its index"
        raise DataError(
            f"{where}: {bin_path} is {state}: {bin_size} bytes, but {idx_path} describes {total} "
            f"{numpy.dtype(dtype).name} tokens = {total * itemsize} bytes (a .bin and .idx from "
            f"different runs, or an interrupted copy); {_rerun_hint()}"
        )
    if n == 0 or total == 0:
        raise DataError(f"{where}: the dataset holds no tokens; preprocess a non-empty input")

    max_token = None
    if vocab_size is not None and scan_tokens > 0:
        count = min(total, scan_tokens)
        data = numpy.memmap(bin_path, mode="r", dtype=dtype, shape=(count,))
        max_token = int(data.max())
        min_token = int(data.min())
        del data
        if max_token >= vocab_size or min_token < 0:
            bad_id = max_token if max_token >= vocab_size else min_token
            raise DataError(
                f"{where}: token id {bad_id} is outside the vocabulary of {tokenizer_name} "
                f"(vocab_size {vocab_size}): the data was preprocessed with another tokenizer; pass "
                "the --tokenizer-type/--tokenizer-model it was preprocessed with, or re-run "
                "`mcore-flash preprocess` with this one"
            )
    return IndexSummary(prefix, dtype, int(n), int(d) - 1, total, lengths, max_token)


@contextlib.contextmanager
def atomic_indexed_dataset_builder(prefix: str, dtype: type) -> Iterator[object]:
    """Yield megatron's ``IndexedDatasetBuilder`` writing to temporary names; on success
    finalize and rename them to ``prefix.bin``/``prefix.idx``, on any error delete them.

    The old ``prefix.idx`` (if any) is removed before the new ``.bin`` is renamed in, so a
    reader never sees a new ``.bin`` with an old ``.idx``.
    """
    with (
        warnings.catch_warnings()
    ):  # megatron's import-time "Transformer Engine/Apex missing" noise
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    try:
        yield builder
        builder.finalize(tmp + ".idx")
        with contextlib.suppress(FileNotFoundError):
            os.remove(prefix + ".idx")
        os.replace(tmp + ".bin", prefix + ".bin")
        os.replace(tmp + ".idx", prefix + ".idx")
    except BaseException:
        with contextlib.suppress(Exception):
            builder.data_file.close()
        for path in (tmp + ".bin", tmp + ".idx"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        raise
