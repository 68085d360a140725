"""CPU: megatron's modules see a view of ``torch`` whose CUDA calls run on the CPU.

Megatron-core's CUDA-only code is a few hundred call sites: ``torch.cuda.<fn>()``
(``current_device()`` used as a device, ``synchronize()``, the CUDA RNG), ``device="cuda"``
literals in tensor factories and ``pin_memory=True``. Patching ``torch`` globally the way
``transfer_to_npu`` does would change torch for every library in the process, so every
``megatron.*`` module's global name ``torch`` is rebound to a *view* of torch instead: the
same module dict, except that ``torch.cuda`` is a CPU stand-in for the functions megatron
calls (``current_device()`` -> ``torch.device("cpu")``, ``synchronize``/``empty_cache`` ->
no-ops, the CUDA RNG -> :mod:`.megatron_cpu_rng`'s device generator, ``is_available()`` ->
False; anything else falls through to the real ``torch.cuda`` and fails as before), and
the tensor factories map a ``"cuda"`` device to the CPU and drop ``pin_memory``. Modules
imported after ``setup()`` get the view through an import hook. Real ``torch`` is untouched.

The call sites it covers, file by file (megatron-core 0.16.1, and 0.19 where it added some):
``docs/megatron-spec.md``, "The device adapter".
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

from mcore_flash.import_hooks import AfterImportFinder

from ._common import is_megatron_module, once
from .megatron_cpu_rng import device_generator

_CPU = torch.device("cpu")

# Tensor factories megatron calls with device="cuda" / pin_memory=True.
_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "empty_strided",
)


def _cpu_device(device):
    """A CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an int ordinal) -> CPU."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _factory_on_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return wrapper


def _autocast_on_cpu(cls):
    def autocast(device_type="cuda", *args, **kwargs):
        if "device_type" in kwargs:
            device_type = kwargs.pop("device_type")
        if device_type == "cuda":
            device_type = "cpu"
        return cls(device_type, *args, **kwargs)

    return autocast


def _noop(*args, **kwargs):
    return None


class _CPUEvent:
    """An event on the CPU's one stream: it has always happened."""

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True


class _CPUStream:
    """The one in-order "stream" of the CPU: waits and synchronizations are no-ops, a
    recorded event has happened.

    megatron-core 0.19's ``_ParamAndGradBucketGroup.start_grad_sync``
    (``distributed/param_and_grad_buffer.py:632``) calls ``torch.cuda.current_stream()``
    unconditionally (to wait on CUDA-graph gradient events) on every DDP step; Megatron-FSDP
    makes side streams and waits on the events it records there (below)."""

    def __init__(self, *args, **kwargs):  # torch.cuda.Stream(device=..., priority=...)
        pass

    def wait_event(self, event=None):
        return None

    def wait_stream(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def record_event(self, event=None):
        return event if event is not None else _CPUEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_CPU_STREAM = _CPUStream()


def _make_cuda_standin() -> types.ModuleType:
    """``torch.cuda`` as megatron sees it on the CPU."""
    real = torch.cuda
    generator = device_generator()
    cuda = types.ModuleType("torch.cuda", "megatron's view of torch.cuda on the CPU")
    cuda.__getattr__ = lambda name: getattr(real, name)  # everything else: the real one
    random = types.ModuleType("torch.cuda.random")
    random.__getattr__ = lambda name: getattr(real.random, name)
    for namespace in (cuda, random):
        namespace.get_rng_state = lambda device="cuda": generator.get_state()
        namespace.set_rng_state = lambda new_state, device="cuda": generator.set_state(new_state)
        namespace.manual_seed = namespace.manual_seed_all = lambda seed: generator.manual_seed(
            int(seed)
        )
        namespace.initial_seed = generator.initial_seed
    cuda.random = random
    cuda.default_generators = (generator,)
    cuda.current_device = lambda: _CPU
    cuda.is_available = lambda: False
    cuda.synchronize = _noop
    cuda.empty_cache = _noop
    cuda.current_stream = cuda.default_stream = lambda device=None: _CPU_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.Stream = _CPUStream
    cuda.Event = _CPUEvent
    return cuda


def _make_torch_view() -> types.ModuleType:
    view = types.ModuleType("torch", "megatron's view of torch on the CPU (mcore_flash.platform)")
    view.__dict__.update(torch.__dict__)
    view.__getattr__ = lambda name: getattr(torch, name)  # later/lazy attributes
    view.cuda = _make_cuda_standin()
    for name in _FACTORIES:
        if hasattr(torch, name):
            setattr(view, name, _factory_on_cpu(getattr(torch, name)))
    view.autocast = _autocast_on_cpu(torch.autocast)
    view.__mcore_flash_view__ = True
    return view


_TORCH_VIEW = None


def _install_view(module) -> None:
    if _TORCH_VIEW is not None and module.__dict__.get("torch") is torch:
        module.torch = _TORCH_VIEW


class ViewFinder(AfterImportFinder):
    """Gives megatron modules imported after setup() the torch view."""

    def __init__(self):
        super().__init__(is_megatron_module, _install_view)


def torch_view() -> types.ModuleType:
    """The CPU view of ``torch`` megatron's modules see (made once)."""
    global _TORCH_VIEW
    if _TORCH_VIEW is None:
        _TORCH_VIEW = _make_torch_view()
    return _TORCH_VIEW


@once
def megatron_torch_view():
    """CPU view of ``torch`` in every megatron module (current and future imports)."""
    torch_view()
    ViewFinder().install()
