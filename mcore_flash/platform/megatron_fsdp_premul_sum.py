"""CPU and NPU: Megatron-FSDP's gradient scaling without NCCL's PREMUL_SUM or AVG.

``distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:
gradient_reduce_preprocessing`` (megatron-core 0.16.1 line 3762; 0.19 the same function)
picks the reduce-scatter's op for a gradient bucket and a scaling factor: SUM without a
factor, ``ReduceOp.AVG`` with ``average_in_collective``, else
``torch.distributed._make_nccl_premul_sum(factor)`` (``gradient_reduce_div_fusion``, on by
default, for every dtype but bf16). PREMUL_SUM exists on NCCL only; gloo and HCCL refuse
it, and HCCL also refuses AVG. Here, on the devices whose collectives are not NCCL's, the
bucket is scaled in place and summed - what megatron's own fallback branch of that
function does, and what MindSpeed patches it to on Ascend. The trainer's per-token loss
passes no factor (SUM already); this keeps any other configuration off the ops the
collective library would refuse.
"""

from __future__ import annotations

import torch

from mcore_flash.import_hooks import on_import

from ._common import once

BUFFER_MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"


@torch.no_grad()
def gradient_reduce_preprocessing(grad_data: torch.Tensor, scaling_factor, ddp_config):
    """``grad_data *= scaling_factor`` (when given); the collective's op is SUM."""
    if scaling_factor is not None:
        grad_data.mul_(scaling_factor)
    return torch.distributed.ReduceOp.SUM


gradient_reduce_preprocessing.__mcore_flash__ = True


def _rebind(module) -> None:
    if hasattr(module, "gradient_reduce_preprocessing"):
        module.gradient_reduce_preprocessing = gradient_reduce_preprocessing


@once
def megatron_fsdp_premul_sum():
    """Megatron-FSDP reduces gradients with SUM after scaling (now, or when it is imported)."""
    on_import(BUFFER_MODULE, _rebind)
