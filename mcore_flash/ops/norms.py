"""Normalisation ops with a fused kernel where the device has one.

``rms_norm`` uses ``torch_npu.npu_rms_norm`` on Ascend tensors; elsewhere a fused-style
autograd function that, like the NPU kernel, keeps only the input and the float32
``rstd`` for backward (torch's composite ``F.rms_norm`` keeps two full-size tensors).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class _RMSNormFunction(torch.autograd.Function):
    """``y = x * rstd * weight`` with ``rstd = rsqrt(mean(x**2) + eps)`` computed in fp32."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        dy32 = dy.float()
        dy_w = dy32 * weight.float()
        dx = rstd * (dy_w - x_hat * (dy_w * x_hat).mean(dim=-1, keepdim=True))
        dweight = (dy32 * x_hat).reshape(-1, x.shape[-1]).sum(dim=0)
        return dx.to(x.dtype), dweight.to(weight.dtype), None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dim of ``x [..., h]``."""
    if x.device.type == "npu":
        return importlib.import_module("torch_npu").npu_rms_norm(x, weight, epsilon=eps)[0]
    return _RMSNormFunction.apply(x, weight, eps)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Standard LayerNorm over the last dim of ``x [..., h]``."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
