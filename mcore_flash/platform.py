"""The one device adapter: run megatron-core on Ascend NPU, CUDA or the CPU.

``setup()`` picks the device ("npu" > "cuda" > "cpu", or the one asked for) and
makes megatron-core usable on it:

* **npu**: ``from torch_npu.contrib import transfer_to_npu`` - Ascend's own adapter,
  which maps the ``torch.cuda`` API and ``"cuda"`` device strings onto the NPU.
* **cuda**: nothing.
* **cpu**: a small, explicit set of named adaptations (below), so that megatron-core
  (0.12 .. 0.16, checked on 0.16.1) runs on the CPU with the gloo backend.

Why the CPU adaptations look the way they do
--------------------------------------------
Megatron-core's CUDA-only code is a few hundred call sites of four kinds:
``torch.cuda.<fn>()`` (``current_device()`` used as a device, ``synchronize()``, the CUDA
RNG), ``device="cuda"`` literals in tensor factories, ``tensor.cuda()`` and
``tensor.type() == "torch.cuda.FloatTensor"``. Patching each line does not scale, and
patching ``torch`` globally the way ``transfer_to_npu`` does would change torch for every
library in the process (torch's own internals, our kernels, the tests). So the CPU
adaptations are scoped to megatron:

1. ``megatron_torch_view`` - every ``megatron.*`` module's global name ``torch`` is
   rebound to a *view* of torch: the same module dict, except that ``torch.cuda`` is a
   CPU stand-in for the handful of functions megatron calls (``current_device()`` ->
   ``torch.device("cpu")``, ``synchronize``/``empty_cache`` -> no-ops, the CUDA RNG ->
   the CPU generator, ``is_available()`` -> False; everything else falls through to the
   real ``torch.cuda`` and fails as before), and the tensor factories map a ``"cuda"``
   device to the CPU and drop ``pin_memory``. Modules imported after ``setup()`` get the
   view through an import hook. Real ``torch`` is untouched.
2. ``megatron_tensor_methods`` - ``Tensor.cuda()`` and ``Tensor.type()`` are methods of
   the tensor, not of a module, so they are wrapped on ``torch.Tensor``; the wrapper
   changes the answer only when the *caller* is a megatron module (``.cuda()`` returns the
   CPU tensor, ``.type()`` says ``torch.cuda.FloatTensor`` for a CPU float tensor),
   otherwise it calls the original.
3. ``megatron_cpu_rng`` - megatron's own CUDA-RNG primitives (``_get_cuda_rng_state``,
   ``_set_cuda_rng_state`` in ``tensor_parallel/random.py``) are replaced by CPU-generator
   ones, so the model-parallel RNG tracker forks the generator dropout really uses on the
   CPU and ``tensor_parallel.checkpoint`` replays dropout exactly.
4. ``checkpoint_without_output_no_te`` - a megatron bug rather than a CUDA call:
   ``CheckpointWithoutOutput(fp8=False)`` sets ``self.fp8 = fp8 is not None`` (True) and
   takes a Transformer-Engine-only path.

Each adaptation is idempotent and is skipped when its target does not exist in the
installed megatron-core. On cuda and npu none of them is applied.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import logging
import os
import sys
import types

import torch

__all__ = ["setup", "device_type", "torch_device", "peak_memory_bytes", "applied_adaptations", "DEVICES"]

DEVICES = ("npu", "cuda", "cpu")

_state = {"device": None}
_applied: list[str] = []

_CPU = torch.device("cpu")

# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------


def setup(device: str | None = None) -> str:
    """Choose the device and make megatron-core run on it; returns "npu", "cuda" or "cpu".

    ``device=None`` detects: npu (torch_npu importable and ``torch.npu.is_available()``),
    then cuda, else cpu. Calling it again is harmless; asking for a different device than
    the one already set up raises RuntimeError.
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
    elif device == "cpu":
        for adaptation in _CPU_ADAPTATIONS:
            adaptation()
    _state["device"] = device
    return device


def device_type() -> str:
    """The device chosen by ``setup()``."""
    if _state["device"] is None:
        raise RuntimeError("mcore_flash.platform.setup() has not been called")
    return _state["device"]


def torch_device() -> torch.device:
    """The device tensors should live on: cpu, cuda:<local rank> or npu:<local rank>."""
    dev = device_type()
    if dev == "cpu":
        return _CPU
    if "LOCAL_RANK" in os.environ:
        index = int(os.environ["LOCAL_RANK"])
    else:
        index = getattr(torch, dev).current_device()
    return torch.device(dev, index)


def peak_memory_bytes() -> int:
    """Peak memory of this process on its device: allocator peak on cuda/npu, peak RSS on cpu."""
    dev = device_type()
    if dev == "cpu":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return getattr(torch, dev).max_memory_allocated()


def applied_adaptations() -> list[str]:
    """Names of the CPU adaptations applied (empty on cuda/npu or before ``setup()``)."""
    return list(_applied)


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


def _once(fn):
    """Run an adaptation at most once and record its name when it applied something."""

    @functools.wraps(fn)
    def wrapper():
        if fn.__name__ in _applied:
            return
        if fn() is not False:
            _applied.append(fn.__name__)

    return wrapper


def _is_megatron_module(name) -> bool:
    return isinstance(name, str) and (name == "megatron" or name.startswith("megatron."))


# --------------------------------------------------------------------------------------
# 1. megatron_torch_view
# --------------------------------------------------------------------------------------


def _cpu_device(device):
    """Map a CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an int
    ordinal) to the CPU; leave anything else alone."""
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


# Tensor factories megatron calls with device="cuda" / pin_memory=True.
_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
    "randint", "zeros_like", "ones_like", "empty_like", "full_like", "empty_strided",
)


def _cpu_get_rng_state(device="cuda"):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device="cuda"):
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _noop(*args, **kwargs):
    return None


def _make_cuda_standin():
    """``torch.cuda`` as megatron sees it on the CPU."""
    real = torch.cuda
    cuda = types.ModuleType("torch.cuda", "megatron's view of torch.cuda on the CPU")
    cuda.__getattr__ = lambda name: getattr(real, name)  # everything else: the real one
    random = types.ModuleType("torch.cuda.random")
    random.__getattr__ = lambda name: getattr(real.random, name)
    for ns in (cuda, random):
        ns.get_rng_state = _cpu_get_rng_state
        ns.set_rng_state = _cpu_set_rng_state
        ns.manual_seed = _cpu_manual_seed
        ns.manual_seed_all = _cpu_manual_seed
        ns.initial_seed = torch.initial_seed
    cuda.random = random
    cuda.current_device = lambda: _CPU
    cuda.is_available = lambda: False
    cuda.synchronize = _noop
    cuda.empty_cache = _noop
    return cuda


def _make_torch_view():
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


class _ViewLoader(importlib.abc.Loader):
    """Wraps a megatron module's loader: exec the module, then give it the torch view."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _install_view(module)

    def __getattr__(self, name):  # get_source, is_package, get_resource_reader, ...
        return getattr(self._inner, name)


class _ViewFinder(importlib.abc.MetaPathFinder):
    """Gives megatron modules imported after setup() the torch view."""

    def find_spec(self, fullname, path, target=None):
        if not _is_megatron_module(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ViewLoader(spec.loader)
                return spec
        return None


@_once
def megatron_torch_view():
    """CPU view of ``torch`` in every megatron module (current and future imports).

    Covers, in megatron-core 0.16.1:
    - ``torch.cuda.current_device()`` used as a device: RoPE
      (``models/common/embeddings/rotary_pos_embedding.py:78,162,297``), SP all-gather /
      reduce-scatter buffers (``tensor_parallel/mappings.py:91,141,148,181,442``,
      ``tensor_parallel/layers.py:261,552,...``), DDP buffers
      (``distributed/param_and_grad_buffer.py:783,800,806``), p2p buffers
      (``pipeline_parallel/p2p_communication.py:190-202,313,321``),
      ``distribute_saved_activations`` (``tensor_parallel/utils.py:70,91``), dist-ckpt
      save (``dist_checkpointing/strategies/state_dict_saver.py:252``), timers, rerun
      state machine.
    - ``torch.cuda.synchronize()``: dist-ckpt save
      (``dist_checkpointing/strategies/filesystem_async.py:230``, ``fully_parallel.py``),
      p2p (``p2p_communication.py:242,398``), ``parallel_state.py``, timers.
    - ``torch.cuda.get_rng_state / manual_seed``: the RNG tracker
      (``tensor_parallel/random.py:55,235-238``), ``model_parallel_cuda_manual_seed``
      (``random.py:422``), ``rerun_state_machine.py:957,970``.
    - ``device="cuda"`` literals: optimizer (``optimizer/optimizer.py:473,481,485,907``),
      ``optimizer/clip_grads.py:90,103,115,174,207``, ``utils.py:1207``,
      ``optimizer/grad_scaler.py``, ``pipeline_parallel/schedules.py:596,983,2138``
      (token count), ``transformer/utils.py:35,40`` (``get_default_causal_mask``),
      ``tensor_parallel/data.py:37``, ``dist_checkpointing/exchange_utils.py``,
      ``state_dict_saver.py:204``; ``torch.autocast("cuda")`` (``schedules.py:418``).
    - ``pin_memory=True``: RoPE context-parallel slicing
      (``models/common/embeddings/rope_utils.py:63``).
    """
    global _TORCH_VIEW
    if _TORCH_VIEW is None:
        _TORCH_VIEW = _make_torch_view()
    if not any(isinstance(f, _ViewFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _ViewFinder())
    for name, module in list(sys.modules.items()):
        if _is_megatron_module(name) and module is not None:
            _install_view(module)


# --------------------------------------------------------------------------------------
# 2. megatron_tensor_methods
# --------------------------------------------------------------------------------------


def _called_from_megatron(depth=2) -> bool:
    try:
        return _is_megatron_module(sys._getframe(depth).f_globals.get("__name__"))
    except ValueError:
        return False


@_once
def megatron_tensor_methods():
    """``Tensor.cuda()`` and ``Tensor.type()`` as megatron sees them on the CPU.

    Only calls made from a ``megatron.*`` module are changed; everyone else gets the
    original methods. Covers, in megatron-core 0.16.1:
    - ``.type() == 'torch.cuda.FloatTensor'`` / ``in ['torch.cuda.HalfTensor',
      'torch.cuda.BFloat16Tensor']`` (else TypeError): ``optimizer/optimizer.py:671,690``
      (Float16 optimizer), ``optimizer/distrib_optimizer.py:361,420,582`` (distributed
      optimizer, every dtype), ``optimizer/clip_grads.py:167``.
    - ``.cuda()``: ``tensor_parallel/data.py:84`` (``broadcast_data``),
      ``dist_checkpointing/exchange_utils.py:336,499``, ``optimizer/optimizer.py:375,380``,
      ``distrib_optimizer.py:1089``, ``grad_scaler.py:140``, ``utils.py:898``, tied
      embeddings under PP (``models/common/language_module/language_module.py``).
    """
    if getattr(torch.Tensor.cuda, "__mcore_flash__", False):
        return
    orig_cuda = torch.Tensor.cuda
    orig_type = torch.Tensor.type

    @functools.wraps(orig_cuda)
    def cuda(self, *args, **kwargs):
        if _called_from_megatron():
            return self.to(_CPU, non_blocking=kwargs.get("non_blocking", False))
        return orig_cuda(self, *args, **kwargs)

    @functools.wraps(orig_type)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu" and _called_from_megatron():
            name = orig_type(self)
            return name.replace("torch.", "torch.cuda.", 1)
        return orig_type(self, dtype, non_blocking, **kwargs)

    cuda.__mcore_flash__ = type_.__mcore_flash__ = True
    torch.Tensor.cuda = cuda
    torch.Tensor.type = type_


# --------------------------------------------------------------------------------------
# 3. megatron_cpu_rng
# --------------------------------------------------------------------------------------


@_once
def megatron_cpu_rng():
    """Megatron's device-RNG primitives on the CPU generator.

    ``tensor_parallel/random.py:41 _get_cuda_rng_state`` and ``:72 _set_cuda_rng_state``
    read/write ``torch.cuda.default_generators`` through ``torch.cuda._lazy_call`` (which
    on the CPU queues the callback forever). They are what ``CudaRNGStatesTracker.add /
    fork`` (``:216-282``), ``_get_all_rng_states / _set_all_rng_states`` (``:444-460``) and
    thereby ``tensor_parallel.checkpoint`` (``CheckpointFunction``, ``:496``) and
    ``CheckpointWithoutOutput`` use. On the CPU, dropout draws from the CPU default
    generator, so forking that generator gives megatron's exact semantics: different
    dropout per TP rank inside ``get_cuda_rng_tracker().fork()``, and exact replay in
    recompute. Also silences fork()'s "CPU RNG state changed within GPU RNG context"
    warning (``random.py:264``), which on the CPU is expected on every forked dropout.
    """
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:
        return False
    if not hasattr(mrandom, "_get_cuda_rng_state") or not hasattr(mrandom, "_set_cuda_rng_state"):
        return False
    if getattr(mrandom._get_cuda_rng_state, "__mcore_flash__", False):
        return

    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        """CPU stand-in (mcore_flash.platform): the CPU generator's state."""
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        """CPU stand-in (mcore_flash.platform): set the CPU generator's state."""
        torch.set_rng_state(new_state)

    _get_cuda_rng_state.__mcore_flash__ = _set_cuda_rng_state.__mcore_flash__ = True
    mrandom._get_cuda_rng_state = _get_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_cuda_rng_state
    # fork() warns when the CPU generator changed inside it (random.py:264): on the CPU
    # that generator *is* the forked one, so the warning fires on every forked dropout.
    logging.getLogger(mrandom.__name__).addFilter(_drop_cpu_rng_changed_warning)


def _drop_cpu_rng_changed_warning(record) -> bool:
    return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


# --------------------------------------------------------------------------------------
# 4. checkpoint_without_output_no_te
# --------------------------------------------------------------------------------------


@_once
def checkpoint_without_output_no_te():
    """``CheckpointWithoutOutput()`` without Transformer Engine.

    ``tensor_parallel/random.py:589``: ``__init__(self, fp8=False)`` sets
    ``self.fp8 = fp8 is not None`` - True for the default - and then calls TE's
    ``activation_recompute_forward`` (NameError without TE). Hit by selective recompute
    of ``layernorm`` / ``mlp`` / ``moe_act`` (``transformer/transformer_layer.py:577``).
    Here ``fp8`` False or None means no fp8.
    """
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:
        return False
    cls = getattr(mrandom, "CheckpointWithoutOutput", None)
    if cls is None:
        return False
    if getattr(cls.__init__, "__mcore_flash__", False):
        return
    if "fp8" not in inspect.signature(cls.__init__).parameters:
        return False
    orig_init = cls.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        fp8 = inspect.signature(orig_init).bind(self, *args, **kwargs).arguments.get("fp8", False)
        if fp8 is None or fp8 is False:
            self.fp8 = False

    __init__.__mcore_flash__ = True
    cls.__init__ = __init__


_CPU_ADAPTATIONS = (
    megatron_torch_view,
    megatron_tensor_methods,
    megatron_cpu_rng,
    checkpoint_without_output_no_te,
)
