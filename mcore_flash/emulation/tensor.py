"""Tensors of the emulated ``npu`` device: PrivateUse1 renamed "npu", data in CPU memory.

An npu tensor is an :class:`NpuTensor`, a wrapper subclass holding a CPU tensor
(``_elem``). ``__torch_dispatch__`` unwraps the arguments, runs the aten op on the CPU
and wraps the result, so every op of torch works and gives the CPU's bits. What a real
device enforces is enforced here (:class:`NpuTensor` lists it): an op mixing an npu tensor
with a CPU tensor of one or more dimensions raises torch's "Expected all tensors to be on
the same device"; seeded ops draw from the device's generator; views and in-place ops alias
the CPU data like device memory; collectives reach the process group's ``npu`` backend
(:mod:`.hccl`). Pinned host memory is ordinary host memory. :func:`register` makes ``npu`` a
device of the process.

Relies on private torch APIs (``_setup_privateuseone_for_python_backend``,
``_make_wrapper_subclass``, ``OpOverload.redispatch``, ``_functionalize_unsafe_set``),
checked against torch 2.13 by tests/emulation/test_emulation.py.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import return_and_correct_aliasing

from . import hccl
from .runtime import NAME, runtime

_aten = torch.ops.aten
_CPU = torch.device("cpu")
_PHYSICAL = (
    None  # torch.device("npu", 0) once the backend is renamed: the device torch's guard knows
)

# ops that accept a CPU tensor next to npu tensors, as on a device: copies and CPU indices
_CROSS_DEVICE_OPS = frozenset(
    {
        _aten.copy_.default,
        _aten._to_copy.default,
        _aten._copy_from.default,
        _aten._copy_from_and_resize.default,
        _aten.index.Tensor,
        _aten.index_put_.default,
        _aten.index_put.default,
        _aten._index_put_impl_.default,
    }
)
# in-place ops that change the tensor's size or storage (not tagged inplace_view)
_RESHAPING_INPLACE_OPS = frozenset(
    {_aten.resize_.default, _aten.resize_as_.default, _aten.set_.source_Tensor}
)


def device_mismatch(op, other: Any) -> RuntimeError:
    """The error a device gives for an op mixing its tensors with another device's."""
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"{runtime().bound_device()} and {other}! (emulated npu, op {op})"
    )


class NpuTensor(torch.Tensor):
    """A tensor on the emulated npu device; its data is the CPU tensor ``_elem``.

    What a real device enforces is enforced here:

    * an op mixing an npu tensor with a CPU tensor of one or more dimensions raises torch's
      "Expected all tensors to be on the same device" (0-dim CPU scalars and CPU index
      tensors are allowed, as on CUDA and Ascend); ``.numpy()`` refuses, as on a device;
    * seeded ops (dropout, ``randn`` ...) draw from the device's generator, not the CPU's;
    * views and in-place ops alias the CPU data exactly like device memory (megatron's
      gradient buffers are views into one flat buffer);
    * ``Module.to("npu")`` keeps the Parameter objects' attributes (megatron's
      ``sequence_parallel``, ``tensor_model_parallel`` ...), as a device backend written in C++
      does by assigning ``param.data``; torch makes new Parameters for a Python wrapper;
    * collectives (``c10d`` ops) reach the process group's ``npu`` backend (:mod:`.hccl`)
      with the CPU buffers; a CPU tensor finds no backend and fails as with HCCL;
    * pinned host memory is ordinary host memory (a Python backend cannot give torch a
      pinned allocator) that answers ``is_pinned()`` True: ``Tensor.pin_memory()`` copies,
      as on a device, and the torch factories' ``pin_memory=True`` marks what they make.
    """

    _elem: torch.Tensor
    __slots__ = ("_elem", "_finalizer")

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False):
        tensor = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=_PHYSICAL,
            requires_grad=requires_grad,
        )
        tensor._elem = elem
        _memory.track(tensor, elem)
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:
        return runtime().bound_device()

    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        # ``p.data = t`` swaps the TensorImpl in C++; the CPU data must follow it.
        if not isinstance(new, NpuTensor):
            raise RuntimeError(
                f"emulated npu: cannot assign a {new.device} tensor to .data of an npu tensor; move it with .npu() first"
            )
        torch._C.TensorBase.data.__set__(self, new)
        _memory.retrack(self, new._elem)
        self._elem = new._elem

    def data_ptr(self) -> int:
        return self._elem.data_ptr()

    def untyped_storage(self):
        return self._elem.untyped_storage()

    def tolist(self):
        return self._elem.tolist()

    def numpy(self, *args, **kwargs):
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def __repr__(self, *, tensor_contents=None) -> str:
        text = repr(self._elem.detach())
        suffix = f", device='{self.device}'"
        if self.grad_fn is not None:
            suffix += f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            suffix += ", requires_grad=True"
        return text[:-1] + suffix + ")"

    def __reduce_ex__(self, protocol):
        # torch.save: like a storage-less device tensor; torch.load puts it back on the npu.
        return (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (self._elem.detach().clone(), self.dtype, str(self.device), self.requires_grad),
        )

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = NpuTensor(
            self._elem.detach().clone(memory_format=torch.preserve_format), self.requires_grad
        )
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for key, value in self.__dict__.items():
            setattr(new, key, copy.deepcopy(value, memo))
        memo[id(self)] = new
        return new

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = _OpInfo.of(func)
        if info.handler is not None:
            return info.handler(func, args, kwargs)
        cpu_args = _unwrap(args, func, info.cross_device)
        cpu_kwargs = {key: _unwrap(value, func, info.cross_device) for key, value in kwargs.items()}
        if info.seeded:
            out = _with_device_generator(func, cpu_args, cpu_kwargs)
        else:
            out = func(*cpu_args, **cpu_kwargs)
        target = kwargs.get("device")
        if target is not None and torch.device(target).type != NAME:
            return out  # e.g. _to_copy(npu -> cpu)
        if info.inplace_view or func in _RESHAPING_INPLACE_OPS:
            return _inplace_metadata(func, args, kwargs, out)
        if info.mutated is not None:  # in-place and out= ops return their mutated argument
            results = [info.arg(args, kwargs, index) for index in info.mutated]
            return results[0] if len(results) == 1 and info.single_return else type(out)(results)
        out = _wrap(out)
        for out_index, arg_index in info.views:  # views share their base's (wrapper) storage
            base = info.arg(args, kwargs, arg_index)
            results = out if isinstance(out, (tuple, list)) else (out,)
            view = results[out_index]
            for tensor in view if isinstance(view, (tuple, list)) else (view,):
                torch._functionalize_unsafe_set(tensor, base)
        return out


# ---- argument handling ---------------------------------------------------------------------


def _unwrap(value, op, cross_device: bool):
    kind = type(value)
    if kind is NpuTensor:
        return value._elem
    if kind is list or kind is tuple:
        return kind(_unwrap(item, op, cross_device) for item in value)
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise device_mismatch(op, value.device)
        if value.dim() != 0 and not cross_device:
            raise device_mismatch(op, "cpu")
        return value
    if kind is torch.device and value.type == NAME:
        runtime().claim(value.index)
        return _CPU
    return value


def _wrap(value):
    kind = type(value)
    if kind is torch.Tensor:
        return NpuTensor(value)
    if kind is list or kind is tuple:
        return kind(_wrap(item) for item in value)
    return value


def _with_device_generator(func, args, kwargs):
    """Run a seeded op with the device's generator in place of the CPU default one."""
    if kwargs.get("generator") is not None:
        raise RuntimeError(
            f"Expected a '{NAME}' device type for generator but found '{kwargs['generator'].device.type}'"
        )
    cpu, device = torch.default_generator, runtime().generator()
    cpu_state = cpu.get_state()
    cpu.set_state(device.get_state())
    try:
        return func(*args, **kwargs)
    finally:
        device.set_state(cpu.get_state())
        cpu.set_state(cpu_state)


def _inplace_metadata(func, args, kwargs, out):
    """In-place ops that change size/strides/storage: the wrapper's metadata must follow."""
    if func in _RESHAPING_INPLACE_OPS:  # resize_, set_: the CPU op ran; give the wrapper its shape
        self = args[0]
        resized = NpuTensor(self._elem)
        torch._C.TensorBase.data.__set__(self, resized)
        _memory.retrack(self, self._elem)
        return self
    return return_and_correct_aliasing(func, args, kwargs, _wrap(out))


# ---- ops with their own handling ------------------------------------------------------------


def _item(func, args, kwargs):
    return args[0]._elem.item()


def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if (
        isinstance(src, torch.Tensor)
        and not isinstance(src, NpuTensor)
        and src.device.type != "cpu"
    ):
        raise device_mismatch(func, src.device)
    target = dst._elem if isinstance(dst, NpuTensor) else dst
    target.copy_(src._elem if isinstance(src, NpuTensor) else src, *args[2:], **kwargs)
    return dst


def _collective(func, args, kwargs):
    """A c10d op on npu tensors: redispatch to the PrivateUse1 kernel with the CPU buffers,
    so the process group's npu backend (gloo underneath) runs it in place. npu tensors only
    ever reach the ``hccl`` backend, so every collective on it passes here: a reduction
    first has its ``ReduceOp`` checked as HCCL does (:func:`.hccl.check_reduce_op`), and
    the communicator it runs on is recorded (:func:`.hccl.record_use`)."""
    info = _OpInfo.of(func)
    if info.reduce_op is not None:
        hccl.check_reduce_op(info.arg(args, kwargs, info.reduce_op))
    hccl.record_use(func, args, kwargs)
    wrapper_of = {}

    def unwrap(value):
        if isinstance(value, NpuTensor):
            wrapper_of[id(value._elem)] = value
            return value._elem
        if isinstance(value, (list, tuple)):
            return type(value)(unwrap(item) for item in value)
        if isinstance(value, torch.Tensor) and value.dim() != 0:
            raise device_mismatch(func, value.device)
        return value

    def rewrap(value):
        if isinstance(value, torch.Tensor):
            return wrapper_of.get(id(value), value)
        if isinstance(value, (list, tuple)):
            return type(value)(rewrap(item) for item in value)
        return value

    try:
        out = func.redispatch(
            torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1),
            *unwrap(args),
            **{key: unwrap(value) for key, value in kwargs.items()},
        )
        if not hccl.is_point_to_point(func):
            _complete(out)
        return rewrap(out)
    finally:
        # the recursive closures form a reference cycle that holds ``wrapper_of``: emptied
        # here, the tensors die when the caller drops them, as a device frees them (not
        # when the garbage collector next runs: the byte counter would overstate the peak)
        wrapper_of.clear()


def _complete(out) -> None:
    """Wait for the work a c10d op returned (a ``ScriptObject``, alone or beside its tensors).

    The emulated device runs everything on one stream, in issue order: a collective is done
    before the next op, as a device stream orders them. Left to gloo's worker thread, it
    would run beside the caller, which may free its buffers (Megatron-FSDP releases buckets
    with ``untyped_storage().resize_(0)``) while gloo still reads or writes them: a
    segmentation fault, or a read of data not yet gathered. Sends and receives are left
    asynchronous: gloo completes a send only once its peer receives, and a ring exchange
    posts both before waiting."""
    for item in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(item, torch.ScriptObject):
            dist.Work.unbox(item).wait()


def _functional_collective(func, args, kwargs):
    """A ``_c10d_functional`` op on npu tensors (DTensor's redistribution, e.g.
    ``full_tensor()`` -> ``funcol.all_gather_single``,
    ``torch/distributed/_functional_collectives.py``):
    its CompositeExplicitAutograd kernel runs with the npu tensors themselves, so the c10d op
    it issues finds the group's npu backend (:func:`_collective`) and its ``wait_tensor``
    finds the work it registered on them. Given the CPU tensors inside, the kernel would ask
    the group for a CPU backend, which HCCL groups have not."""
    return func.redispatch(
        torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1), *args, **kwargs
    )


class _OpInfo:
    """What dispatch needs to know about one op, read from its schema once."""

    _cache: dict = {}

    @classmethod
    def of(cls, func) -> "_OpInfo":
        info = cls._cache.get(func)
        if info is None:
            info = cls._cache[func] = cls(func)
        return info

    def __init__(self, func):
        self.handler: Optional[Callable] = None
        if func.namespace == "c10d":
            self.handler = _collective
        elif func.namespace == "_c10d_functional":
            self.handler = _functional_collective
        elif func is _aten._local_scalar_dense.default:
            self.handler = _item
        elif func is _aten.copy_.default:
            self.handler = _copy
        schema = func._schema
        self.seeded = torch.Tag.nondeterministic_seeded in func.tags
        self.cross_device = func in _CROSS_DEVICE_OPS
        self.inplace_view = torch.Tag.inplace_view in func.tags
        self.arg_names = [argument.name for argument in schema.arguments]
        self.reduce_op = (  # the index of a c10d op's ReduceOp argument
            self.arg_names.index("reduce_op")
            if func.namespace == "c10d" and "reduce_op" in self.arg_names
            else None
        )
        self.single_return = len(schema.returns) == 1
        mutated, views = [], []
        for out_index, ret in enumerate(schema.returns):
            if ret.alias_info is None:
                continue
            for arg_index, argument in enumerate(schema.arguments):
                if argument.alias_info is not None and set(argument.alias_info.before_set) & set(
                    ret.alias_info.before_set
                ):
                    (mutated if ret.alias_info.is_write else views).append((out_index, arg_index))
                    break
        if mutated and len(mutated) != len(schema.returns):
            mutated = []  # some returns alias, some are new: torch's generic helper sorts it out
            self.inplace_view = True
        self.mutated = [arg_index for _, arg_index in mutated] or None
        self.views = views

    def arg(self, args, kwargs, index: int):
        return args[index] if index < len(args) else kwargs[self.arg_names[index]]


# ---- memory statistics -----------------------------------------------------------------------


class _Memory:
    """Bytes of the CPU storages behind live npu tensors (views count once), each at its
    current size: a storage resized in place (``untyped_storage().resize_(n)``, see
    :func:`_resize_counted`) counts at its new size. Keyed by the storage object, held, not by
    its address: the allocator reuses the address of a storage freed by
    ``untyped_storage().resize_(0)`` (megatron's ``CheckpointWithoutOutput``, Megatron-FSDP's
    buckets) while that storage's tensors still live. Storages of 0 bytes are tracked too: one
    freed with ``resize_(0)`` may get new tensors before it is regrown."""

    def __init__(self):
        self._live: dict[int, list] = {}  # id(storage) -> [wrappers, nbytes, storage]

    def track(self, tensor: NpuTensor, elem: torch.Tensor) -> None:
        storage = elem.untyped_storage()
        key = id(storage)
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, storage.nbytes(), storage]
            runtime()._record_allocation(entry[1])
        else:  # resized by a ``resize_`` op while another tensor shares it
            self.resized(storage)
        entry[0] += 1
        tensor._finalizer = weakref.finalize(tensor, self._release, key)

    def retrack(self, tensor: NpuTensor, elem: torch.Tensor) -> None:
        """``tensor`` now holds ``elem`` (``.data =``, ``resize_``, ``set_``)."""
        finalizer = getattr(tensor, "_finalizer", None)
        if finalizer is not None:
            finalizer()  # releases the old storage once
        self.track(tensor, elem)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` may have a new size: if it is tracked, count it at that size."""
        entry = self._live.get(id(storage))
        if entry is None or entry[1] == storage.nbytes():
            return
        if storage.nbytes() > entry[1]:
            runtime()._record_allocation(storage.nbytes() - entry[1])
        else:
            runtime()._record_free(entry[1] - storage.nbytes())
        entry[1] = storage.nbytes()

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            runtime()._record_free(entry[1])


_memory = _Memory()


def _resize_counted(resize):
    """``UntypedStorage.resize_`` that keeps the device's byte counter in step.

    Megatron-FSDP frees and regrows its buckets in place: ``_free_storage`` /
    ``_alloc_storage`` in ``megatron_fsdp/param_and_grad_buffer.py`` call
    ``tensor._typed_storage()._resize_(n)``, which torch 2.13's ``TypedStorage._resize_``
    (``torch/storage.py``) turns into ``self._untyped_storage.resize_(n * element_size)``;
    megatron's ``CheckpointWithoutOutput`` calls ``untyped_storage().resize_(0)``. On an npu
    tensor ``untyped_storage()`` is its CPU tensor's storage, and ``resize_`` on it reaches
    no dispatcher op, so the counter would not see it: this wrapper tells :class:`_Memory`."""

    @functools.wraps(resize)
    def resize_(self, size):
        result = resize(self, size)
        _memory.resized(self)
        return result

    return resize_


# ---- kernels for the PrivateUse1 key (no npu tensor argument) --------------------------------

_PRIVATEUSE1_OPS = (
    "empty.memory_format",
    "empty_strided",
    "tril_indices",
    "triu_indices",
    "_efficientzerotensor",
    "copy_",
    "_copy_from",
    "_copy_from_and_resize",
    "lift_fresh",
    "lift_fresh_copy",
    "_local_scalar_dense",
    "detach",
    "alias",
    "view",
    "as_strided",
    "_to_copy",
)


def _privateuse1_kernel(op):
    def kernel(*args, **kwargs):
        if (
            op is _aten._copy_from.default
        ):  # _copy_from(src, dst): copy_(dst, src) between cpu and npu
            return _copy(op, (args[1], args[0]), {})
        with torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
        ):
            return NpuTensor.__torch_dispatch__(op, (), args, kwargs)

    return kernel


# factories that take pin_memory=: a Python backend cannot give torch a pinned allocator
_PINNING_FACTORIES = (
    "tensor",
    "empty",
    "zeros",
    "ones",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "empty_strided",
)


# the storages of "pinned" host tensors: ordinary host memory that answers is_pinned() True,
# so code that pins only what is not pinned yet (FSDP2's offloaded shards) keeps its buffer
_PINNED: "weakref.WeakSet[torch.UntypedStorage]" = weakref.WeakSet()


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    _PINNED.add(tensor.untyped_storage())
    return tensor


def _pinned_factory(factory):
    """``factory`` whose ``pin_memory=True`` gives ordinary host memory marked pinned."""

    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        pin = kwargs.pop("pin_memory", False)
        out = factory(*args, **kwargs)
        return _pinned(out) if pin else out

    return wrapper


def _keep_parameter_attributes(module_apply):
    """``Module._apply`` that carries each Parameter's attributes over to its replacement."""

    def _apply(self, fn, recurse=True):
        before = {name: param for name, param in self._parameters.items() if param is not None}
        attributes = {name: dict(param.__dict__) for name, param in before.items()}
        result = module_apply(self, fn, recurse)
        for name, old in before.items():
            new = self._parameters.get(name)
            if new is not None and new is not old:
                for key, value in attributes[name].items():
                    if not hasattr(new, key):
                        setattr(new, key, value)
        return result

    _apply.__wrapped__ = module_apply
    return _apply


_LIBRARIES: list = []  # torch.library registrations live as long as these objects


def register(device_module) -> None:
    """Make ``npu`` a device of this process (PrivateUse1), with ``device_module`` as ``torch.npu``.

    Factories (``torch.empty(..., device="npu")``) and CPU->npu copies have no npu tensor
    argument: they reach per-op kernels registered for the PrivateUse1 key, which build the
    result the same way. Ops are registered one by one because a boxed Python fallback for
    PrivateUse1 trips an internal assert in torch 2.13 when a subclass is involved.
    """
    global _PHYSICAL
    if _PHYSICAL is not None:
        return
    import warnings

    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=NAME, backend_module=device_module)
    _PHYSICAL = torch.device(NAME, 0)
    kernels = torch.library.Library("aten", "IMPL")
    for qualified in _PRIVATEUSE1_OPS:
        name, _, overload = qualified.partition(".")
        kernels.impl(
            qualified,
            _privateuse1_kernel(getattr(getattr(_aten, name), overload or "default")),
            "PrivateUse1",
        )
    # pin_memory() / pin_memory=True ask the accelerator hooks for a pinned allocator, which
    # Python hooks cannot give: pinned host memory is ordinary host memory here, a copy as
    # pin_memory() makes, that answers is_pinned() True (:data:`_PINNED`).
    pinning = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pinning.impl(
            "_pin_memory",
            lambda self, device=None: _pinned(self.clone()),
            "CompositeExplicitAutograd",
        )
        pinning.impl(
            "is_pinned",
            lambda self, device=None: self.untyped_storage() in _PINNED,
            "CompositeExplicitAutograd",
        )
    _LIBRARIES.extend([kernels, pinning])
    for name in _PINNING_FACTORIES:
        setattr(torch, name, _pinned_factory(getattr(torch, name)))
    torch.nn.Module._apply = _keep_parameter_attributes(torch.nn.Module._apply)
    torch.UntypedStorage.resize_ = _resize_counted(torch.UntypedStorage.resize_)
