"""CPU: Megatron-FSDP's modules see ``torch.cuda.current_device()`` as the ordinal 0.

The CPU view of ``torch`` (:mod:`.megatron_torch_view`) answers ``current_device()`` with
``torch.device("cpu")``, because megatron uses it as a device. Megatron-FSDP formats it
into a device string and indexes generators with it (megatron-core 0.16.1;
``distributed/fsdp/src/megatron_fsdp/``): ``megatron_fsdp.py:182,184,188``
``torch.device(f"cuda:{torch.cuda.current_device()}")`` -> "Invalid device string:
'cuda:cpu'" (0.19: lines 232-234), ``utils.py:185,223``
``torch.cuda.default_generators[torch.cuda.current_device()]``, and ``utils.py:720`` as the
device of a tensor factory. Its modules get a view of the view whose ``current_device()``
is 0, as on a one-GPU process: the view's factories map an int device to the CPU and its
one generator sits at index 0. The trainer passes ``device=`` (the CPU) to
``FullyShardedDataParallel``, so no tensor is placed by that string.
"""

from __future__ import annotations

import types

import torch

from mcore_flash.import_hooks import AfterImportFinder

from ._common import once
from .megatron_torch_view import megatron_torch_view, torch_view

FSDP_PACKAGE = "megatron.core.distributed.fsdp"

_FSDP_VIEW = None


def _is_fsdp_module(name) -> bool:
    return isinstance(name, str) and (name == FSDP_PACKAGE or name.startswith(FSDP_PACKAGE + "."))


def _make_fsdp_view(base: types.ModuleType) -> types.ModuleType:
    view = types.ModuleType(
        "torch", "Megatron-FSDP's view of torch on the CPU (mcore_flash.platform)"
    )
    view.__dict__.update(base.__dict__)
    cuda = types.ModuleType("torch.cuda", "Megatron-FSDP's view of torch.cuda on the CPU")
    cuda.__dict__.update(base.cuda.__dict__)
    cuda.current_device = lambda: 0
    view.cuda = cuda
    return view


def _install_fsdp_view(module) -> None:
    if module.__dict__.get("torch") in (torch, torch_view()):
        module.torch = _FSDP_VIEW


class FsdpViewFinder(AfterImportFinder):
    """Gives Megatron-FSDP's modules imported after setup() the FSDP view."""

    def __init__(self):
        super().__init__(_is_fsdp_module, _install_fsdp_view)


@once
def megatron_fsdp_cpu_view():
    """Megatron-FSDP's modules (current and future imports) see ``current_device()`` = 0."""
    global _FSDP_VIEW
    megatron_torch_view()  # the base view this one extends
    if _FSDP_VIEW is None:
        _FSDP_VIEW = _make_fsdp_view(torch_view())
    FsdpViewFinder().install()
