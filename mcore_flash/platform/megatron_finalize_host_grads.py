"""Gradient finalisation for torch FSDP2 models, whose gradient shards may live on the host.

Answers ``distributed/finalize_model_grads.py: finalize_model_grads`` (megatron-core
0.16.1-0.19). With FSDP2's ``CPUOffloadPolicy`` the gradient shards are host tensors, and
megatron's all-reduce of the sequence-parallel norms' gradients over the tensor-parallel
ranks hands them to the device's communicator: "No backend type associated with device type
cpu" on HCCL (NCCL fails the same way). :func:`finalize_fsdp2_grads` does what megatron's
does for one model chunk per rank (FSDP2 runs at pipeline size 1: no embedding or
pipeline all-reduce), with that all-reduce on the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def finalize_fsdp2_grads(model: list, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's ``finalize_model_grads`` for FSDP2 model chunks ``model`` (the same
    signature): finish each chunk's reduction, sum the gradients of the parameters replicated
    over the tensor-parallel ranks (sequence-parallel norms, ``q_layernorm`` / ``k_layernorm``)
    over those ranks, then, with per-token loss, all-reduce ``num_tokens`` (a device tensor)
    over the data x context parallel ranks and divide every gradient by it."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    for chunk in model:
        chunk.finish_grad_sync(force_all_reduce=force_all_reduce)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if tp_group.size() > 1:
        _sum_replicated_grads(model, config, tp_group)
    if num_tokens is not None:
        dist.all_reduce(
            num_tokens, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        if num_tokens > 0:
            for chunk in model:
                chunk.scale_gradients(1.0 / num_tokens)


def _sum_replicated_grads(model: list, config, tp_group) -> None:
    """Sum over ``tp_group``, on the device, this rank's shards of the gradients megatron sums
    there (each tensor-parallel rank holds the same FSDP shard of a replicated parameter)."""
    grads = []
    for chunk in model:
        for name, param in chunk.module.named_parameters():
            replicated = (
                config.sequence_parallel and getattr(param, "sequence_parallel", False)
            ) or (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))
            if replicated and param.requires_grad and param.grad is not None:
                grads.append(param.grad.to_local())
    if not grads:
        return
    from mcore_flash.platform import torch_device

    flat = torch.cat([grad.reshape(-1) for grad in grads]).to(torch_device())
    dist.all_reduce(flat, group=tp_group)
    flat = flat.to(grads[0].device)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
