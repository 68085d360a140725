"""Normalisation ops with a fused kernel where the device has one.

``rms_norm`` uses ``torch_npu.npu_rms_norm`` on Ascend tensors and torch's
``F.rms_norm`` elsewhere (identical to megatron's ``torch.nn.RMSNorm``-based norm).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dim of ``x [..., h]``."""
    if x.device.type == "npu":
        return importlib.import_module("torch_npu").npu_rms_norm(x, weight, epsilon=eps)[0]
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Standard LayerNorm over the last dim of ``x [..., h]``."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
