"""Storage-level C++ code, applied to the CPU tensors behind npu tensors.

An emulated npu tensor is a wrapper whose data is a CPU tensor (``_elem``, :mod:`.tensor`);
the wrapper's own ``StorageImpl`` holds nothing. C++ code that works below the dispatcher on
``StorageImpl``s therefore misses the data. One such call is on the training path:
megatron-core 0.19's ``CheckpointWithoutOutput._recompute`` (``tensor_parallel/random.py``,
selective recompute of ``layernorm`` / ``mlp``) points each discarded output's storage at the
recomputed output's with a ``load_inline`` extension (``_get_share_storage``). On an NPU the
``StorageImpl`` holds the device memory and the call works as written; the emulation makes
the same call on the CPU tensors inside. Without it a recomputed layer reads an empty
storage ("data is not allocated yet"). megatron-core 0.16-0.18 copy the data through
``untyped_storage()`` instead, which the wrapper already forwards.
"""

from __future__ import annotations

import functools

from mcore_flash.import_hooks import on_import

MEGATRON_RANDOM = "megatron.core.tensor_parallel.random"


def _cpu_tensor(tensor):
    from .tensor import NpuTensor

    return tensor._elem if isinstance(tensor, NpuTensor) else tensor


def _on_cpu_tensors(get_share_storage):
    @functools.wraps(get_share_storage)
    def get():
        share_storage = get_share_storage()
        return lambda dst, src: share_storage(_cpu_tensor(dst), _cpu_tensor(src))

    get.__mcore_flash_emulation__ = True
    return get


def _patch(module) -> None:
    get = getattr(module, "_get_share_storage", None)
    if get is not None and not getattr(get, "__mcore_flash_emulation__", False):
        module._get_share_storage = _on_cpu_tensors(get)


def storage_sharing_on_cpu_tensors() -> None:
    """megatron's storage sharing (imported now or later) acts on the CPU tensors."""
    on_import(MEGATRON_RANDOM, _patch)
