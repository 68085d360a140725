"""``--use-torch-fsdp2``: this rank's GPTModel in torch FSDP2, through megatron-core's wrapper.

:func:`torch_fully_sharded` wraps the model as Megatron-LM's ``--use-torch-fsdp2`` does
(megatron-core's ``TorchFullyShardedDataParallel``), with the adaptations of
:mod:`mcore_flash.platform.torch_fsdp2`: ``fully_shard`` on each transformer layer and the
embedding, then on the model (its output layer and final norm), over the data x context
parallel ranks. With ``offload_to_cpu`` (``--fsdp2-offload-to-cpu``) FSDP2's
``CPUOffloadPolicy`` keeps the fp32 sharded weights and gradients on the host; megatron's
optimizer over them (not distributed: FSDP2 shards) keeps Adam's state there too and steps
on the host. Each layer's shard is copied to the device before its forward and again before
its backward, cast to ``param_dtype`` and gathered; its gradient is reduce-scattered in
``reduce_dtype`` and added to the host shard after every micro-batch. The manual:
docs/pretrain.md, "Weights on the host: torch FSDP2".
"""

from __future__ import annotations

import torch

from mcore_flash.runtime.fsdp2_settings import Fsdp2Settings

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def check_offload_device(settings: Fsdp2Settings, device: torch.device) -> None:
    """ValueError naming the flag when the host offload has no device to offload from."""
    if settings.offload_to_cpu and device.type == "cpu":
        raise ValueError(
            "--fsdp2-offload-to-cpu keeps the model on the host while the device computes, and "
            "this run trains on the CPU (host and device are one): drop the flag, or rehearse "
            "the NPU path with --emulate-npu"
        )


def torch_fully_sharded(config, model_config, model: torch.nn.Module, device: torch.device):
    """``model`` (this rank's fp32 GPTModel, on the host or on ``device``) in FSDP2 as
    ``config.fsdp2`` says; returns the wrapper megatron's schedules and optimizer take."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from mcore_flash.platform.torch_fsdp2 import torch_fsdp2_class

    settings = config.fsdp2
    check_offload_device(settings, device)
    offload = CPUOffloadPolicy(pin_memory=settings.pin_memory) if settings.offload_to_cpu else None
    return torch_fsdp2_class()(
        model_config,
        DistributedDataParallelConfig(),
        model,
        device=device,
        units=(TransformerLayer, LanguageModelEmbedding),
        reshard_after_forward=settings.reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=_DTYPES[settings.param_dtype],
            reduce_dtype=_DTYPES[settings.reduce_dtype],
        ),
        offload_policy=offload,
    )
