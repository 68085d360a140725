"""Backend registry: resolve a backend by name, or automatically from the tensors' device.

Automatic choice follows the device the inputs live on (``npu`` tensors -> ``npu``,
``cuda`` -> ``cuda``, ``cpu`` -> ``cpu``), which after :func:`mcore_flash.platform.setup`
means npu, then cuda, then cpu. The environment variable ``MCORE_FLASH_ATTENTION_BACKEND``
overrides the automatic choice. Each resolved backend is logged once and
:func:`last_used_backend` reports it.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Union

from .base import AttentionBackend, AttentionParams
from .cpu import CpuBackend
from .cuda import CudaBackend
from .npu import NpuBackend
from .reference import ReferenceBackend

__all__ = [
    "AttentionBackend",
    "AttentionParams",
    "BackendUnavailableError",
    "available_backends",
    "backend_names",
    "get_backend",
    "last_used_backend",
]

logger = logging.getLogger("mcore_flash")

ENV_VAR = "MCORE_FLASH_ATTENTION_BACKEND"

_BACKENDS: dict[str, AttentionBackend] = {
    backend.name: backend
    for backend in (NpuBackend(), CudaBackend(), CpuBackend(), ReferenceBackend())
}
_logged: set[str] = set()
_last_used: Optional[str] = None


class BackendUnavailableError(ValueError):
    """The requested backend cannot run here; the message says how to make it available."""


def backend_names() -> list[str]:
    """All backend names, available or not."""
    return list(_BACKENDS)


def available_backends() -> list[str]:
    """Names of the backends that can run in this process."""
    return [name for name, backend in _BACKENDS.items() if backend.is_available()]


def get_backend(
    name: Union[str, AttentionBackend, None] = None, device_type: str = "cpu"
) -> AttentionBackend:
    """The backend called ``name``, or the automatic one for tensors on ``device_type``.

    An :class:`AttentionBackend` instance is returned as is (e.g. a reference backend with
    custom block sizes).
    """
    global _last_used
    if isinstance(name, AttentionBackend):
        _last_used = name.name
        return name
    name = name or os.environ.get(ENV_VAR) or _auto_name(device_type)
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {backend_names()} (or None for auto)"
        )
    backend = _BACKENDS[name]
    reason = backend.unavailable_reason()
    if reason:
        raise BackendUnavailableError(f"attention backend {name!r} is not available: {reason}")
    if name not in _logged:
        _logged.add(name)
        logger.info("mcore_flash: using attention backend %r", name)
    _last_used = name
    return backend


def last_used_backend() -> Optional[str]:
    """Name of the backend the most recent attention call resolved to (None before any)."""
    return _last_used


def _auto_name(device_type: str) -> str:
    if device_type in ("npu", "cuda"):
        return device_type
    return "cpu"
