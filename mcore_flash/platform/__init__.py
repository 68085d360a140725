"""The one device adapter: run megatron-core on Ascend NPU, CUDA or the CPU.

``setup()`` picks the device ("npu" > "cuda" > "cpu", or the one asked for), binds this
process to its device (``set_device(LOCAL_RANK)`` under a launcher, as Megatron-LM does)
and makes megatron-core usable on it with a few named adaptations (``_ADAPTATIONS``: which
run on which device), one module each, each naming the megatron-core 0.16.1 code it answers
to: ``transfer_to_npu`` (Ascend's own), :mod:`.npu_device_capability`,
:mod:`.megatron_tensor_methods`, :mod:`.checkpoint_without_output`,
:mod:`.megatron_torch_view`, :mod:`.megatron_cpu_rng`, :mod:`.megatron_fsdp_device_mesh`,
:mod:`.megatron_fsdp_premul_sum`, :mod:`.megatron_fsdp_cpu_view`,
:mod:`.te_version_without_te`, :mod:`.megatron_fsdp_no_te`, :mod:`.megatron_clip_host_grads`, :mod:`.megatron_optimizer_ckpt_dtensor`, :mod:`.megatron_swiglu_fsdp2_checkpoint`,
:mod:`.megatron_jit_fuser_off`.
Torch FSDP2's wrapper (:mod:`.torch_fsdp2`) and its gradient finalisation
(:mod:`.megatron_finalize_host_grads`) are classes and functions the trainer uses, not
patches. ``docs/megatron-spec.md``, "The
device adapter", tabulates each: its devices and the code it answers to.

The megatron adaptations are visible to megatron's modules only: the CPU view of
``torch`` is bound into ``megatron.*`` modules, tensor methods change their answer only
for megatron callers, RNG changes go to megatron's own functions. The one process-wide
change, on NPU, is an environment default torch needs there (:mod:`.npu_device_capability`).
Each is idempotent and skipped when its target does not exist in the installed megatron-core.
"""

from __future__ import annotations

import os

import torch

from ._common import _state, applied, device_type
from .checkpoint_without_output import checkpoint_without_output_no_te
from .megatron_clip_host_grads import megatron_clip_host_grads
from .megatron_cpu_rng import megatron_cpu_rng
from .megatron_fsdp_cpu_view import megatron_fsdp_cpu_view
from .megatron_fsdp_device_mesh import megatron_fsdp_device_mesh
from .megatron_fsdp_no_te import megatron_fsdp_no_te
from .megatron_fsdp_premul_sum import megatron_fsdp_premul_sum
from .megatron_jit_fuser_off import megatron_jit_fuser_off
from .megatron_optimizer_ckpt_dtensor import megatron_optimizer_ckpt_dtensor
from .megatron_swiglu_fsdp2_checkpoint import megatron_swiglu_fsdp2_checkpoint
from .megatron_tensor_methods import megatron_npu_tensor_type, megatron_tensor_methods
from .megatron_torch_view import megatron_torch_view
from .npu_device_capability import npu_device_capability
from .te_version_without_te import te_version_without_te

__all__ = [
    "setup",
    "device_type",
    "torch_device",
    "peak_memory_bytes",
    "side_stream",
    "applied_adaptations",
    "DEVICES",
]

DEVICES = ("npu", "cuda", "cpu")

_ADAPTATIONS = {
    "npu": (
        megatron_jit_fuser_off,
        npu_device_capability,
        megatron_npu_tensor_type,
        checkpoint_without_output_no_te,
        megatron_fsdp_device_mesh,
        megatron_fsdp_premul_sum,
        megatron_fsdp_no_te,
        te_version_without_te,
        megatron_clip_host_grads,
        megatron_optimizer_ckpt_dtensor,
        megatron_swiglu_fsdp2_checkpoint,
    ),
    "cuda": (
        megatron_jit_fuser_off,
        checkpoint_without_output_no_te,
        megatron_fsdp_no_te,
        te_version_without_te,
        megatron_clip_host_grads,
        megatron_optimizer_ckpt_dtensor,
        megatron_swiglu_fsdp2_checkpoint,
    ),
    "cpu": (
        megatron_jit_fuser_off,
        megatron_torch_view,
        megatron_tensor_methods,
        megatron_cpu_rng,
        checkpoint_without_output_no_te,
        megatron_fsdp_device_mesh,
        megatron_fsdp_premul_sum,
        megatron_fsdp_no_te,
        megatron_fsdp_cpu_view,
        te_version_without_te,
        megatron_optimizer_ckpt_dtensor,
        megatron_swiglu_fsdp2_checkpoint,
    ),
}


_CPU = torch.device("cpu")


def setup(device: str | None = None) -> str:
    """Choose the device and make megatron-core run on it; returns "npu", "cuda" or "cpu".

    ``device=None`` detects: npu (torch_npu importable and ``torch.npu.is_available()``),
    then cuda, else cpu. Under a launcher (``LOCAL_RANK`` set) the process is bound to
    device ``LOCAL_RANK`` on npu/cuda. Calling it again is harmless; asking for a different
    device than the one already set up raises RuntimeError.
    """
    if device is not None:
        if not isinstance(device, str) or device.lower() not in DEVICES:
            raise ValueError(
                f"unknown device={device!r}; valid choices: {', '.join(DEVICES)} or None (detect)"
            )
        device = device.lower()

    current = _state["device"]
    if current is not None:
        if device is not None and device != current:
            raise RuntimeError(
                f"mcore_flash.platform.setup() already set up device {current!r}; "
                f"cannot switch to {device!r} in the same process"
            )
        return current

    if device is None:
        device = _detect()
    elif device == "npu":
        if not _npu_available():
            raise RuntimeError(
                "device='npu' requested but torch_npu is not importable or sees no NPU. "
                "Install Ascend's CANN toolkit (and `source set_env.sh`), then "
                "`pip install torch_npu` matching your torch version (or "
                "`pip install mcore-flash[npu]`)."
            )
    elif device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "device='cuda' requested but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}). Install a CUDA build of torch, e.g. "
                "`pip install torch --index-url https://download.pytorch.org/whl/cu124`, "
                "and check the NVIDIA driver."
            )

    if device == "npu":
        from torch_npu.contrib import transfer_to_npu  # noqa: F401  (patches on import)
    if device != "cpu" and "LOCAL_RANK" in os.environ:
        getattr(torch, device).set_device(int(os.environ["LOCAL_RANK"]))
    for adaptation in _ADAPTATIONS[device]:
        adaptation()
    _state["device"] = device
    return device


def torch_device() -> torch.device:
    """The device this process's tensors live on: cpu, or cuda/npu at the current index."""
    dev = device_type()
    if dev == "cpu":
        return _CPU
    return torch.device(dev, getattr(torch, dev).current_device())


def peak_memory_bytes() -> int:
    """Peak memory of this process on its device: allocator peak on cuda/npu, peak RSS on cpu."""
    dev = device_type()
    if dev == "cpu":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return getattr(torch, dev).max_memory_allocated()


def side_stream():
    """``(stream, device module)``: a new stream of this process's device and ``torch.npu`` /
    ``torch.cuda``, for copies that overlap compute; ``(None, None)`` on the CPU (work is
    synchronous there)."""
    dev = device_type()
    if dev == "cpu":
        return None, None
    module = getattr(torch, dev)
    return module.Stream(), module


def applied_adaptations() -> list[str]:
    """Names of the adaptations applied in this process."""
    return list(applied)


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except Exception:  # ImportError, or a broken install without CANN
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def _detect() -> str:
    if _npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"
