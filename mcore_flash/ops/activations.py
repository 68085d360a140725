"""Gated activations with a fused kernel where the device has one.

``swiglu(x) = silu(a) * b`` where ``a, b`` are the two halves of ``x``'s last dim (the
layout of Megatron's fused fc1 output). On Ascend tensors ``torch_npu.npu_swiglu``;
elsewhere an autograd function that, like the fused kernels, keeps only ``x`` for
backward and recomputes ``silu`` there (the unfused expression keeps ``silu(a)`` and a
copy of ``b`` as well: two more tensors of the FFN width).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, dy: Tensor):
        (x,) = ctx.saved_tensors
        a, b = x.chunk(2, dim=-1)
        sigmoid = torch.sigmoid(a)
        silu = a * sigmoid
        da = dy * b * sigmoid * (1 + a * (1 - sigmoid))
        db = dy * silu
        return torch.cat([da, db], dim=-1)


def swiglu(x: Tensor) -> Tensor:
    """``[..., 2f] -> [..., f]``: ``silu(x[..., :f]) * x[..., f:]``."""
    if x.device.type == "npu":
        return importlib.import_module("torch_npu").npu_swiglu(x, dim=-1)
    return _SwiGLUFunction.apply(x)
