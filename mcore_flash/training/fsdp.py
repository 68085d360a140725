"""ZeRO-3 in the trainer: megatron-core's Megatron-FSDP around the flash-spec GPTModel.

Provides :func:`fully_sharded` (``--use-megatron-fsdp``: this rank's model in megatron-core's
``FullyShardedDataParallel``, ``distributed/fsdp/mcore_fsdp_adapter.py``, instead of its
``DistributedDataParallel``), :func:`ddp_config` (the settings the trainer runs it with, and
why) and :func:`layer_elements`. It shards over the data x context parallel ranks what
``--data-parallel-sharding-strategy`` names: ``optim`` the optimizer state (ZeRO-1),
``optim_grads`` also the gradients (ZeRO-2), ``optim_grads_params`` also the weights (ZeRO-3:
each FSDP unit's weights are all-gathered just before its forward and again before its
backward, and freed after). The FSDP units are the transformer layers (ours subclass
megatron's ``TransformerLayer``) and the embedding; the output layer and the final norm stay
in one group of their own. The planner models the same (:mod:`mcore_flash.planning`). The
device adaptations Megatron-FSDP needs (mesh device type, streams, ``current_device()``
formatted into a CUDA device string, PREMUL_SUM) live in :mod:`mcore_flash.platform`. The
manual: docs/pretrain.md, section "ZeRO-3: Megatron-FSDP".
"""

from __future__ import annotations

import dataclasses
import logging

import torch


def layer_elements(model: torch.nn.Module) -> int:
    """Parameter elements of one transformer layer of ``model`` on this rank (the largest)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    sizes = [
        sum(p.numel() for p in module.parameters())
        for module in model.modules()
        if isinstance(module, TransformerLayer)
    ]
    return max(sizes, default=0)


def ddp_config(config, model: torch.nn.Module):
    """megatron's ``DistributedDataParallelConfig`` for Megatron-FSDP as the trainer runs it.

    What it sets, and why (the planner models the same, :mod:`mcore_flash.planning`):

    * ``grad_reduce_in_fp32`` (fp32 main gradients, as without FSDP; bf16 with
      ``--grad-reduce-in-bf16``), and on megatron-core 0.19, which ignores that field under
      FSDP, ``megatron_fsdp_main_grads_dtype`` of the same dtype;
    * ``suggested_communication_unit_size`` = 2 x the parameter elements of one layer: the
      unit being computed plus one prefetched; left unset, megatron floors it at 10^9 elements
      (``megatron_fsdp.py``), which prefetches whole small models and about 9 layers of a 70B;
    * ``fsdp_double_buffer`` off (buffers are allocated and freed by ``resize_``);
    * ``gradient_reduce_div_fusion`` off: the per-token loss passes no scaling factor, and
      NCCL's PREMUL_SUM does not exist on gloo or HCCL
      (:mod:`mcore_flash.platform.megatron_fsdp_premul_sum` covers any other configuration).
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    fields = {field.name for field in dataclasses.fields(DistributedDataParallelConfig)}
    settings = dict(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=config.data_parallel_sharding_strategy,
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=not config.grad_reduce_in_bf16,
        gradient_reduce_div_fusion=False,
        fsdp_double_buffer=False,
        suggested_communication_unit_size=2 * layer_elements(model),
        overlap_grad_reduce=config.overlap_grad_reduce,  # on for optim_grads[_params]: megatron's
    )
    if "megatron_fsdp_main_grads_dtype" in fields:  # 0.19: grad_reduce_in_fp32 is ignored
        settings["megatron_fsdp_main_grads_dtype"] = (
            torch.bfloat16 if config.grad_reduce_in_bf16 else torch.float32
        )
    return DistributedDataParallelConfig(**settings)


def _device_string_note(record: logging.LogRecord) -> bool:
    """Drop Megatron-FSDP's warning that its device is not ``cuda:<current_device()>``
    (``megatron_fsdp.py: MegatronFSDP.__init__``): on the CPU and the NPU the trainer's device
    is the right one, and every rank would print it."""
    return "Megatron-FSDP is using device" not in record.getMessage()


def fully_sharded(config, model_config, model: torch.nn.Module, device: torch.device):
    """``model`` (this rank's GPTModel, on ``device``) in megatron's ``FullyShardedDataParallel``
    with the layers and the embedding as FSDP units."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.transformer_layer import TransformerLayer

    logging.getLogger(megatron_fsdp.__name__).addFilter(_device_string_note)
    return FullyShardedDataParallel(
        model_config,
        ddp_config(config, model),
        model,
        fsdp_unit_modules=[TransformerLayer, LanguageModelEmbedding],
        device=device,
    )
