"""What both conversion directions share: an atomically published output directory and
progress lines."""

from __future__ import annotations

import contextlib
import os
import shutil

from mcore_flash.conversion.hf_config import ConversionError


@contextlib.contextmanager
def atomic_directory(target: str, flag: str):
    """Yield ``<target>.tmp`` to fill; on success it is renamed to ``target``, on any error
    removed, so ``target`` is never half-written. An existing non-empty ``target`` is refused."""
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise ConversionError(
            f"{flag} {target} already exists and is not empty; choose a new directory"
        )
    tmp = target.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        if os.path.isdir(target):
            os.rmdir(target)  # empty (checked above)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class Progress:
    """``[n/total] key (layer i)`` about every 5% of ``total`` tensors, through ``log``."""

    def __init__(self, total: int, log):
        self._total, self._log, self._done = total, log, 0

    def step(self, key: str, layer) -> None:
        self._done += 1
        if self._done == self._total or self._done % max(1, self._total // 20) == 0:
            self._log(
                f"  [{self._done}/{self._total}] {key}"
                + ("" if layer is None else f" (layer {layer})")
            )
