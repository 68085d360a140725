"""What ``from torch_npu.contrib import transfer_to_npu`` does, for the emulated device.

Follows torch_npu 2.13.0's ``contrib/transfer_to_npu.py`` for everything a Megatron
training script touches, so that code that runs under this runs under the real one.
:func:`apply` (once per process) patches, as torch_npu does:

* ``torch.cuda``: the names of ``torch_npu.npu.__all__`` copied onto the *existing* module;
* device arguments "cuda" -> "npu" in the torch factories, ``Tensor`` and ``Module`` methods;
  ``Tensor.cuda``/``is_cuda`` and ``Module.cuda`` are the npu ones;
* ``torch.distributed``: "nccl" -> "hccl" in ``init_process_group`` and new groups;
* ``torch.jit.script`` returns its argument unchanged.

Not done here (as in torch_npu): ``Tensor.type()`` still says ``torch.npu.FloatTensor``,
and CPU tensors are not moved anywhere. Not emulated: the AMP, profiler, inductor,
FSDP/DeviceMesh and ``torch.Generator``/``torch.Event`` proxies.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .runtime import runtime

_TORCH_FACTORIES = (
    "logspace",
    "randint",
    "rand",
    "full_like",
    "ones_like",
    "rand_like",
    "randperm",
    "arange",
    "normal",
    "empty_strided",
    "empty_like",
    "scalar_tensor",
    "tril_indices",
    "ones",
    "randn",
    "tensor",
    "triu_indices",
    "as_tensor",
    "zeros",
    "randint_like",
    "full",
    "eye",
    "empty",
    "zeros_like",
    "range",
    "randn_like",
    "linspace",
    "load",
    "set_default_device",
)
_TENSOR_METHODS = (
    "new_empty",
    "new_empty_strided",
    "new_full",
    "new_ones",
    "new_tensor",
    "new_zeros",
    "to",
    "pin_memory",
)
_MODULE_METHODS = ("to", "to_empty")
_CUDA_FUNCTIONS = (
    "get_device_properties",
    "get_device_name",
    "get_device_capability",
    "set_device",
    "synchronize",
    "mem_get_info",
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "reset_max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "default_stream",
    "current_stream",
    "get_rng_state",
    "set_rng_state",
)
_DEVICE_KEYWORDS = ("device", "device_type", "map_location", "device_id")

_applied = False


def _npu_device(value, convert_int: bool):
    """torch_npu's rewrite of one device-like argument ("cuda" -> "npu")."""
    if isinstance(value, str) and "cuda" in value:
        return value.replace("cuda", "npu")
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("npu" if value.index is None else f"npu:{value.index}")
    if convert_int and isinstance(value, int) and not isinstance(value, bool):
        return f"npu:{value}"
    if isinstance(value, dict):
        return {_npu_device(key, False): _npu_device(item, False) for key, item in value.items()}
    return value


def _on_npu(fn):
    """``fn`` with its "cuda" device arguments rewritten to "npu"."""
    convert_positional_int = fn.__name__ in ("to", "to_empty")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args = tuple(_npu_device(arg, convert_positional_int) for arg in args)
        for name in _DEVICE_KEYWORDS:
            if kwargs.get(name) is not None:
                kwargs[name] = _npu_device(kwargs[name], True)
        if isinstance(kwargs.get("device_ids"), (list, tuple)):
            kwargs["device_ids"] = type(kwargs["device_ids"])(
                _npu_device(item, convert_positional_int) for item in kwargs["device_ids"]
            )
        return fn(*args, **kwargs)

    return wrapper


def _hccl_backend(fn):
    """``fn`` with "nccl" -> "hccl" and "cuda" -> "npu" in string arguments and ``backend=``."""

    def rewrite(value):
        return (
            value.replace("nccl", "hccl").replace("cuda", "npu")
            if isinstance(value, str)
            else value
        )

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args = tuple(rewrite(arg) for arg in args)
        if "backend" in kwargs:
            kwargs["backend"] = rewrite(kwargs["backend"])
        return fn(*args, **kwargs)

    return wrapper


def _wrap_all(owner, names) -> None:
    for name in names:
        fn = getattr(owner, name, None)
        if fn is not None:
            setattr(owner, name, _on_npu(fn))


def apply() -> None:
    """Patch torch as ``transfer_to_npu`` does (once per process).

    * ``torch.cuda``: every name of ``torch_npu.npu.__all__`` is copied onto the *existing*
      ``torch.cuda`` module (and ``torch.cuda.random``), as torch_npu's ``_apply_patches``
      does. Functions a library imported from ``torch.cuda`` before (megatron's
      ``from torch.cuda import _lazy_call``) keep the old object, whose module globals now
      see the npu functions. ``set_device``, ``get_rng_state`` and the other white-listed
      functions also rewrite "cuda" device arguments; ``default_generators`` follows the
      device's generators once it is initialised.
    * Device arguments "cuda" -> "npu" (strings, ``torch.device``, dicts; an int in a device
      keyword becomes ``"npu:<int>"``, a positional int only for ``to``/``to_empty``) in the
      torch factories, ``Tensor.new_* / to / pin_memory`` and ``Module.to / to_empty``.
    * ``Tensor.cuda = Tensor.npu``, ``Tensor.is_cuda = Tensor.is_npu``,
      ``Module.cuda = Module.npu``.
    * ``torch.distributed``: "nccl" -> "hccl" (and "cuda" -> "npu") in ``init_process_group``
      and in new groups (``_new_group_with_tag``); ``is_nccl_available = is_hccl_available``;
      no default backend for "cuda".
    * ``torch.jit.script`` returns its argument unchanged.
    """
    global _applied
    if _applied:
        return
    npu = runtime()
    for name in npu.__all__:
        setattr(torch.cuda, name, getattr(npu, name))
    for name in npu.random.__all__:
        setattr(torch.cuda.random, name, getattr(npu.random, name))
    _wrap_all(torch.cuda, _CUDA_FUNCTIONS)
    _wrap_all(torch.cuda.random, ("get_rng_state", "set_rng_state"))
    npu._lazy_call(lambda: setattr(torch.cuda, "default_generators", npu.default_generators))

    _wrap_all(torch, _TORCH_FACTORIES)
    _wrap_all(torch.Tensor, _TENSOR_METHODS)
    torch.Tensor.cuda = torch.Tensor.npu
    torch.Tensor.is_cuda = torch.Tensor.is_npu
    _wrap_all(torch.nn.Module, _MODULE_METHODS)
    torch.nn.Module.cuda = torch.nn.Module.npu

    dist.init_process_group = _hccl_backend(_on_npu(dist.init_process_group))
    dist.distributed_c10d._new_group_with_tag = _hccl_backend(
        dist.distributed_c10d._new_group_with_tag
    )
    dist.is_nccl_available = dist.is_hccl_available
    dist.Backend.default_device_backend_map.pop("cuda", None)

    torch.jit.script = lambda obj, *args, **kwargs: obj
    torch.jit.script_method = lambda fn: fn
    _applied = True
