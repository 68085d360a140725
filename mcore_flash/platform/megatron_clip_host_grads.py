"""NPU and CUDA: megatron's gradient clipping of gradients that live on the host.

Answers ``optimizer/clip_grads.py: clip_grad_by_total_norm_fp32`` (megatron-core
0.16.1-0.19), which asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``: with torch
FSDP2's ``CPUOffloadPolicy`` (``--fsdp2-offload-to-cpu``) the gradient shards are host
tensors and the assertion fails bare. The optimizer module's ``clip_grad_by_total_norm_fp32``
becomes one that scales host gradients itself (the same coefficient,
``max_norm / (total_norm + 1e-6)``, applied below 1) and leaves every other call to
megatron's. The norm itself needs nothing: megatron's ``get_grad_norm_fp32`` reads the local
shards and reduces a device tensor.
"""

from __future__ import annotations

import functools

from mcore_flash.import_hooks import on_import

from ._common import once

OPTIMIZER_MODULE = "megatron.core.optimizer.optimizer"


def _clip_host_grads_too(clip):
    @functools.wraps(clip)
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        import torch

        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        attribute = "decoupled_grad" if use_decoupled_grad else "grad"
        host = [
            p for p in params if getattr(p, attribute, None) is not None and _on_host(p, attribute)
        ]
        if not host:
            return clip(params, max_norm, total_norm, use_decoupled_grad)
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            with torch.no_grad():
                for param in host:
                    _local(getattr(param, attribute)).mul_(clip_coeff)
        on_host = {id(p) for p in host}
        device = [p for p in params if id(p) not in on_host]
        if device:
            clip(device, max_norm, total_norm, use_decoupled_grad)

    clip_grad_by_total_norm_fp32.__mcore_flash__ = True
    return clip_grad_by_total_norm_fp32


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _on_host(param, attribute: str) -> bool:
    return _local(getattr(param, attribute)).device.type == "cpu"


def _rebind(module) -> None:
    clip = getattr(module, "clip_grad_by_total_norm_fp32", None)
    if clip is not None and not getattr(clip, "__mcore_flash__", False):
        module.clip_grad_by_total_norm_fp32 = _clip_host_grads_too(clip)


@once
def megatron_clip_host_grads():
    """megatron's optimizer clips host gradients too (now, or when it is imported)."""
    on_import(OPTIMIZER_MODULE, _rebind)
