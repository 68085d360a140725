"""The checkpoint directory protocol (Megatron-LM's names) and reading what it holds.

Under ``--save``: ``iter_0000100/`` (one checkpoint: shards, ``common.pt``, each rank's
``rng_rank00000.pt``, ``manifest.json`` written last) and the marker
``latest_checkpointed_iteration.txt`` naming the newest finished one. A save is written into
``iter_XXXXXXX.tmp/`` and renamed when complete; only then is the marker replaced.
"""

from __future__ import annotations

import glob
import os
from typing import Optional, Sequence

MARKER = "latest_checkpointed_iteration.txt"
# the formats a checkpoint is written in (``common["ckpt_format"]``; :mod:`.formats`)
TORCH_DIST = "torch_dist"
FSDP_DTENSOR = "fsdp_dtensor"
# dist_checkpointing's index and non-tensor files, checked before anything is read
COMMON_FILES = ("metadata.json", "common.pt", ".metadata")


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def saved_format(common: dict) -> str:
    """``fsdp_dtensor`` or ``torch_dist`` (checkpoints that do not say: written by megatron's
    ``dist_checkpointing``, or converted from Hugging Face)."""
    return common.get("ckpt_format", TORCH_DIST)


def unfinished_saves(root: Optional[str]) -> list[str]:
    """The ``iter_*.tmp`` directories under ``root``: saves that were killed or failed."""
    return sorted(glob.glob(os.path.join(root, "iter_*.tmp"))) if root else []


def refuse_overwrite(save: str, load: Optional[str]) -> None:
    """Raise ValueError when ``save`` holds a run (a checkpoint, a save that did not finish,
    or ``metrics.jsonl``) that this one does not resume (``load`` is not the same
    directory): training would replace its checkpoints. Megatron-LM overwrites silently."""
    names = sorted(os.listdir(save)) if os.path.isdir(save) else []
    held = [n for n in names if n in (MARKER, "metrics.jsonl") or n.startswith("iter_")]
    if held and not (load and os.path.realpath(load) == os.path.realpath(save)):
        given = f"--load {load} is another directory" if load else "no --load is given"
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ValueError(
            f"--save {save} holds a run already ({shown}) and {given}: training would overwrite "
            f"it. Resume that run with --load {save}, or give this one another --save directory"
        )


def marker_iteration(root: str) -> Optional[int]:
    """The iteration the marker names, or None (no marker, or one naming nothing)."""
    try:
        return latest_iteration(root)
    except ValueError:
        return None


def latest_iteration(root: str) -> Optional[int]:
    """The iteration the marker names, or None when ``root`` holds no finished checkpoint."""
    marker = os.path.join(root, MARKER)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        text = f.read().strip()
    if not text.isdigit() or not os.path.isdir(checkpoint_dir(root, int(text))):
        raise ValueError(
            f"--load {root}: {marker} says {text!r} but that checkpoint is missing or unreadable"
        )
    return int(text)


def write_marker(root: str, iteration: int) -> None:
    """Point the marker at ``iteration`` atomically (a temporary file, ``os.replace``, fsynced)."""
    tmp = os.path.join(root, MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MARKER))
    fsync_directory(root)


def fsync_directory(path: str) -> None:
    """Make a rename inside ``path`` durable (POSIX: the directory entry is data too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_latest(root: str, verify_all: bool = False) -> tuple[str, dict]:
    """The latest checkpoint under ``root``: its directory and its common (non-tensor) state
    (iteration, ``model_args``, padded vocabulary, ...). Checks the index and common files
    against the manifest (``verify_all``: every file, in this process alone, for readers
    outside training such as the export) and every pickle before reading any."""
    from mcore_flash.checkpoint import manifest, safe_pickles  # torch: not for the protocol alone

    iteration = latest_iteration(root)
    if iteration is None:
        raise ValueError(
            f"--load {root}: no {MARKER} there; point --load at a --save directory of an earlier run"
        )
    path = checkpoint_dir(root, iteration)
    manifest.verify_files(path, None if verify_all else COMMON_FILES)
    return path, safe_pickles.load_common_state(path)


def read_model_args(root: str) -> dict:
    """The ``model_args`` stored with the latest checkpoint under ``root`` (``--use-checkpoint-args``)."""
    saved = read_latest(root)[1].get("model_args")
    if saved is None:
        raise ValueError(
            f"--use-checkpoint-args: the checkpoint in --load {root} predates stored model flags; pass them"
        )
    return saved


def check_checkpoint(load: Optional[str], needing: Sequence[str]) -> None:
    """Raise ValueError naming ``load`` when it holds no checkpoint (no
    ``latest_checkpointed_iteration.txt``) and the flags ``needing`` (given) load from it."""
    if not needing or load is None or latest_iteration(load) is not None:
        return
    what = "does not exist" if not os.path.exists(load) else "holds no checkpoint"
    flags = " ".join(needing)
    raise ValueError(
        f"--load {load} {what} (no {MARKER}), and {flags} loads from it: point --load "
        "at the --save directory of an earlier run or at a converted checkpoint (`mcore-flash "
        f"convert hf-to-mcore`), or drop {flags} to start from scratch"
    )
