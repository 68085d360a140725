"""What the adaptations share: run-once bookkeeping, "is this caller megatron?" and the
device ``mcore_flash.platform.setup()`` chose."""

from __future__ import annotations

import functools
import sys

applied: list[str] = []
_state = {"device": None}  # set by mcore_flash.platform.setup()


def device_type() -> str:
    """The device chosen by ``setup()``."""
    if _state["device"] is None:
        raise RuntimeError("mcore_flash.platform.setup() has not been called")
    return _state["device"]


def once(fn):
    """Run an adaptation at most once; record its name when it applied something
    (it returns False when its target does not exist in the installed megatron-core)."""

    @functools.wraps(fn)
    def wrapper():
        if fn.__name__ in applied:
            return
        if fn() is not False:
            applied.append(fn.__name__)

    return wrapper


def is_megatron_module(name) -> bool:
    return isinstance(name, str) and (name == "megatron" or name.startswith("megatron."))


def called_from_megatron(depth: int = 2) -> bool:
    """Whether the function ``depth`` frames up the stack belongs to a megatron module."""
    try:
        return is_megatron_module(sys._getframe(depth).f_globals.get("__name__"))
    except ValueError:
        return False
