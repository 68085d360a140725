"""An emulated Ascend NPU on a CPU-only torch: the real NPU code path, rehearsed on the CPU.

    from mcore_flash import emulation
    emulation.install()     # from now on `import torch_npu` finds the emulated one
    import torch_npu        # registers the "npu" device, torch.npu and the "hccl" backend

After ``install()`` the project's NPU path runs unchanged: ``platform.setup()`` detects
an NPU, imports ``torch_npu.contrib.transfer_to_npu``, and every tensor of the model lives
on an ``npu`` device whose data sits in CPU memory. ``mcore-flash pretrain --emulate-npu``
does this for a whole training run (one process, or one per rank under ``torchrun``). What a
rehearsal proves, and what it cannot: ``docs/rehearsal.md``.

Parts: :mod:`.runtime` (``torch.npu``), :mod:`.tensor` (npu tensors), :mod:`.hccl` (the
process-group backend), :mod:`.storage_sharing` (C++ storage sharing on the CPU data),
:mod:`.transfer` (``transfer_to_npu``), :mod:`.dtensor` (DTensor's sharding propagation),
the operator doubles :mod:`.fusion_attention` (``npu_fusion_attention`` and its grad op),
:mod:`.fusion_attention_args` (one call's arguments and their checks),
:mod:`.fusion_attention_visibility` (which keys each query sees) and :mod:`.fused_ops`, and
the ``torch_npu`` package beside them that ``import torch_npu`` finds.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Optional

__all__ = ["install", "is_installed", "activate", "op_calls", "op_double", "report"]

_STANDIN_DIR = os.path.dirname(os.path.abspath(__file__))
_CALLS: list = []


class _TorchNpuFinder(importlib.abc.MetaPathFinder):
    """Resolves ``torch_npu`` to the stand-in package beside this file."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch_npu":
            return None
        return importlib.machinery.PathFinder.find_spec("torch_npu", [_STANDIN_DIR])


def install() -> None:
    """Make ``import torch_npu`` find the emulated ``torch_npu`` in this process.

    Raises RuntimeError when a real torch_npu was imported already.
    """
    if is_installed():
        return
    loaded = sys.modules.get("torch_npu")
    if loaded is not None:
        raise RuntimeError(
            f"a real torch_npu is already imported ({loaded.__file__}); the emulation needs a fresh process"
        )
    sys.meta_path.insert(0, _TorchNpuFinder())


def is_installed() -> bool:
    return any(isinstance(finder, _TorchNpuFinder) for finder in sys.meta_path)


def activate():
    """What ``import torch_npu`` does: register the device, ``torch.npu`` and ``hccl``;
    returns ``torch.npu``."""
    import torch.distributed as dist

    from . import hccl, tensor
    from .dtensor import fake_tensors_on_cpu
    from .runtime import runtime
    from .storage_sharing import storage_sharing_on_cpu_tensors

    npu = runtime()
    tensor.register(npu)
    hccl.register()
    storage_sharing_on_cpu_tensors()
    fake_tensors_on_cpu()
    dist.is_hccl_available = lambda: True
    return npu


def op_calls() -> list:
    """Every call of an emulated ``torch_npu`` op in this process, one dict each (see the
    doubles)."""
    return _CALLS


def report() -> dict:
    """What this process's rehearsal exercised, JSON-ready: its device, the ``torch_npu`` op
    calls by name and layout, the inputs those kernels would have had to copy into their
    layout first (non-contiguous), and the device's peak allocated bytes."""
    from collections import Counter

    from .runtime import runtime

    calls = Counter(f"{c['name']}[{c['layout']}]" if "layout" in c else c["name"] for c in _CALLS)
    copies = Counter(
        f"{c['name']}[{c.get('layout', '')}].{name}" for c in _CALLS for name in c["noncontiguous"]
    )
    return {
        "device": str(runtime().bound_device()),
        "op_calls": dict(sorted(calls.items())),
        "inputs_the_kernels_would_copy": dict(sorted(copies.items())),
        "peak_memory_allocated_bytes": runtime().max_memory_allocated(),
    }


def op_double(calls: Optional[list] = None) -> types.ModuleType:
    """The emulated ``torch_npu``'s operators alone, as a module named ``torch_npu`` with no
    device behind it (tests put it in ``sys.modules`` to drive the NPU backend with CPU
    tensors). ``module.calls`` (``calls`` if given) records every call."""
    from . import fused_ops, fusion_attention

    module = types.ModuleType(
        "torch_npu", "contract doubles of torch_npu's operators (mcore_flash.emulation)"
    )
    module.calls = [] if calls is None else calls
    module.npu_fusion_attention, module.npu_fusion_attention_grad = fusion_attention.make_ops(
        module.calls
    )
    module.npu_rms_norm, module.npu_swiglu = fused_ops.make_ops(module.calls)
    return module
