"""A save that failed: its error, with the cause said plainly (a full disk) and what is still safe."""

from __future__ import annotations

import errno
import shutil
from typing import Optional

import torch.distributed as dist

from mcore_flash.checkpoint.directory import checkpoint_dir, marker_iteration

_FULL_DISK_BYTES = 1 << 20  # less free than this after a failed save: the disk is full


class CheckpointSaveError(RuntimeError):
    """A save failed (disk full, I/O error); the previous checkpoint is untouched."""


def failed_save(root: str, iteration: int, error: BaseException) -> CheckpointSaveError:
    """The error to raise for a save that failed: its message measures the free space before
    rank 0 removes the partial files (giving the space back)."""
    message = save_failure(root, iteration, error)
    if dist.get_rank() == 0:
        shutil.rmtree(checkpoint_dir(root, iteration) + ".tmp", ignore_errors=True)
    return CheckpointSaveError(message)


def save_failure(root: str, iteration: int, error: BaseException) -> str:
    """The message for a failed save: the cause (ENOSPC said plainly) and what is still safe."""
    cause = _os_error(error)
    free = shutil.disk_usage(root).free
    # torch's C++ file writer (torch.save to a path) reports a full disk without an errno
    full = (cause is not None and cause.errno == errno.ENOSPC) or free < _FULL_DISK_BYTES
    if full:
        reason = f"No space left on device ({free:,} bytes free on the filesystem of --save)"
    elif cause is not None:
        reason = f"{cause.strerror} ({cause.filename or 'a checkpoint file'})"
    else:
        reason = f"{type(error).__name__}: {error}"
    previous = marker_iteration(root)
    kept = (
        f"the checkpoint of iteration {previous} is intact"
        if previous is not None
        else "no earlier checkpoint exists"
    )
    advice = "free space on the disk of --save, then" if full else "then"
    return (
        f"saving iteration {iteration} to {checkpoint_dir(root, iteration)} failed: {str(reason)[:500]}; "
        f"its partial files were removed and {kept}; {advice} resume with --load {root}"
    )


def _os_error(error: BaseException) -> Optional[OSError]:
    """The OSError behind ``error``: its cause chain, or one of DCP's per-rank failures."""
    seen = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        stack.extend([current.__cause__, current.__context__])
        failures = current.failures if isinstance(getattr(current, "failures", None), dict) else {}
        stack.extend(
            failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()
        )
    return None
