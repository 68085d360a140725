"""Checkpoint manifests: the size and SHA-256 of every file, written last, checked before loading.

``manifest.json`` in a checkpoint directory lists every other file in it (relative names)::

    {"format": 1, "files": {"common.pt": {"bytes": 1234, "sha256": "..."}, ...}, "files_sha256": "..."}

``files_sha256`` hashes the entries themselves, so a damaged manifest is reported as such.

Writing and checking are shared out: rank ``r`` of ``W`` hashes the sorted files
``r, r + W, ...``, so a 70B checkpoint is hashed in parallel, never by one rank. A file
that is missing, truncated, grown or changed by one bit fails with :class:`CorruptCheckpoint`
naming it, before anything in the checkpoint is deserialised.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Optional

import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
_PARTIAL = "manifest.rank{:05d}.json"
_CHUNK = 16 << 20


class CorruptCheckpoint(ValueError):
    """A checkpoint file does not match its manifest entry (or the manifest is unreadable)."""


def digest(path: str, sync: bool = False) -> dict:
    """``{"bytes": size, "sha256": hex}`` of one file, read in 16 MiB blocks; ``sync``:
    fsync it too (its data reaches the disk before the manifest that vouches for it)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            sha.update(block)
        if sync:
            os.fsync(f.fileno())
    return {"bytes": os.path.getsize(path), "sha256": sha.hexdigest()}


def write_manifest(directory: str) -> None:
    """Hash every file under ``directory`` into ``directory/manifest.json``.

    Collective when ``torch.distributed`` is initialised (every rank calls it once all ranks
    have written their files): each rank hashes its share into a partial file, then rank 0
    merges them. Every file is fsynced by the rank that hashes it, then the manifest; it
    is the last file of a checkpoint.
    """
    rank, world = _rank_and_world()
    names = _files(directory)
    share = {name: digest(os.path.join(directory, name), sync=True) for name in names[rank::world]}
    _write_json(os.path.join(directory, _PARTIAL.format(rank)), share)
    _barrier()
    if rank == 0:
        entries = {}
        for r in range(world):
            partial = os.path.join(directory, _PARTIAL.format(r))
            with open(partial) as f:
                entries.update(json.load(f))
            os.remove(partial)
        files = dict(sorted(entries.items()))
        _write_json(
            os.path.join(directory, MANIFEST),
            {"format": 1, "files": files, "files_sha256": _self_hash(files)},
        )


def read_manifest(directory: str) -> Optional[dict]:
    """``{name: {"bytes", "sha256"}}`` from ``directory/manifest.json``; None when there is none."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            payload = json.load(f)
        if set(payload) != {"format", "files", "files_sha256"} or payload["format"] != 1:
            raise ValueError("not a format-1 manifest")
        files = payload["files"]
        if not all(set(entry) == {"bytes", "sha256"} for entry in files.values()):
            raise ValueError("an entry without bytes and sha256")
        if _self_hash(files) != payload["files_sha256"]:
            raise ValueError("its entries do not match its own files_sha256")
    except (
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
    ) as error:  # UnicodeDecodeError is a ValueError
        raise CorruptCheckpoint(
            f"{path} is damaged ({error}): the checkpoint cannot be verified"
        ) from error
    return files


def verify_files(directory: str, names: Optional[Iterable[str]] = None) -> bool:
    """Check those of ``names`` that the manifest lists (default: all) on this rank alone.

    Returns False when the checkpoint has no manifest (written by another tool: nothing to
    check against); raises :class:`CorruptCheckpoint` naming the first bad file.
    """
    files = read_manifest(directory)
    if files is None:
        return False
    for name in sorted(files) if names is None else [name for name in names if name in files]:
        problem = _problem(directory, name, files[name])
        if problem:
            raise CorruptCheckpoint(problem)
    return True


def verify_checkpoint(directory: str, device: torch.device) -> bool:
    """Check every file of the manifest, shared out over the ranks (collective).

    Every rank raises the same :class:`CorruptCheckpoint` (naming the first bad file in
    sorted order), so none is left waiting in a later collective. ``device``: where the
    agreement's one-element tensor lives (NCCL/HCCL serve device tensors only).
    """
    files = read_manifest(directory)
    if files is None:
        return False
    rank, world = _rank_and_world()
    names = sorted(files)
    bad = next(
        (
            i
            for i in range(rank, len(names), world)
            if _problem(directory, names[i], files[names[i]])
        ),
        len(names),
    )
    if world > 1:
        first = torch.tensor([bad], device=device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        bad = int(first.item())
    if bad < len(names):
        raise CorruptCheckpoint(_problem(directory, names[bad], files[names[bad]]))
    return True


def _problem(directory: str, name: str, expected: dict) -> Optional[str]:
    """What is wrong with one file, or None."""
    path = os.path.join(directory, name)
    advice = "the checkpoint is damaged; resume from an earlier one (point the tracker file at it) or re-save"
    if not os.path.isfile(path):
        return f"{path} is missing ({MANIFEST} lists it); {advice}"
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        return f"{path} has {size} bytes, {MANIFEST} says {expected['bytes']} (truncated or overwritten); {advice}"
    if digest(path)["sha256"] != expected["sha256"]:
        return f"{path} does not match its SHA-256 in {MANIFEST} (its content changed); {advice}"
    return None


def _self_hash(files: dict) -> str:
    """SHA-256 of the entries' canonical JSON: a changed manifest is told from a changed file."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _files(directory: str) -> list[str]:
    """Every file under ``directory`` but the manifest and its partials, sorted, relative."""
    names = []
    for root, _, files in os.walk(directory):
        for name in files:
            relative = os.path.relpath(os.path.join(root, name), directory)
            if relative != MANIFEST and not (
                relative.startswith("manifest.rank") and relative.endswith(".json")
            ):
                names.append(relative)
    return sorted(names)


def _write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
