"""``Tensor.type()`` (and on the CPU ``Tensor.cuda()``) as megatron's callers expect them.

Megatron-core asserts CUDA type strings of parameters and gradients (megatron-core 0.16.1):
``.type() == 'torch.cuda.FloatTensor'`` / ``in ['torch.cuda.HalfTensor',
'torch.cuda.BFloat16Tensor']`` (else TypeError) in ``optimizer/optimizer.py:671,690``
(Float16 optimizer), ``optimizer/distrib_optimizer.py:361,420,582`` (distributed
optimizer, every dtype) and ``optimizer/clip_grads.py:167``. A CPU tensor says
``torch.FloatTensor`` and an NPU tensor ``torch.npu.FloatTensor`` (``transfer_to_npu``
leaves ``.type()`` alone; MindSpeed rewrites it for everyone). Here the answer changes
only for calls made from a ``megatron.*`` module: the device's tensors report the
``torch.cuda.*`` name there, every other caller gets torch's own answer.

On the CPU megatron also calls ``.cuda()`` on tensors: ``tensor_parallel/data.py:84``
(``broadcast_data``), ``dist_checkpointing/exchange_utils.py:336,499``,
``optimizer/optimizer.py:375,380``, ``distrib_optimizer.py:1089``, ``grad_scaler.py:140``,
``utils.py:898``, tied embeddings under PP (``models/common/language_module/language_module.py``).
For megatron's calls it returns the tensor on the CPU. (On NPU ``transfer_to_npu`` maps it.)
"""

from __future__ import annotations

import functools

import torch

from ._common import called_from_megatron, once

_CPU = torch.device("cpu")


def _wrap_type(device_type: str) -> None:
    if getattr(torch.Tensor.type, "__mcore_flash__", False):
        return
    torch_type = torch.Tensor.type
    prefix = "torch." if device_type == "cpu" else f"torch.{device_type}."

    @functools.wraps(torch_type)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if (
            dtype is None
            and not kwargs
            and self.device.type == device_type
            and called_from_megatron()
        ):
            name = torch_type(self)
            return "torch.cuda." + name[len(prefix) :] if name.startswith(prefix) else name
        return torch_type(self, dtype, non_blocking, **kwargs)

    type_.__mcore_flash__ = True
    torch.Tensor.type = type_


@once
def megatron_tensor_methods():
    """CPU: ``.type()`` and ``.cuda()`` for megatron's callers."""
    _wrap_type("cpu")
    if getattr(torch.Tensor.cuda, "__mcore_flash__", False):
        return
    torch_cuda = torch.Tensor.cuda

    @functools.wraps(torch_cuda)
    def cuda(self, *args, **kwargs):
        if called_from_megatron():
            return self.to(_CPU, non_blocking=kwargs.get("non_blocking", False))
        return torch_cuda(self, *args, **kwargs)

    cuda.__mcore_flash__ = True
    torch.Tensor.cuda = cuda


@once
def megatron_npu_tensor_type():
    """NPU: ``.type()`` says ``torch.cuda.*`` for megatron's callers (as MindSpeed does, scoped)."""
    _wrap_type("npu")
