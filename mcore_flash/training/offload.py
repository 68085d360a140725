"""Host offload of the optimizer: megatron-core's ``HybridDeviceOptimizer``.

``--optimizer-cpu-offload`` (Megatron-LM's flags, with ``--optimizer-offload-fraction F`` and
``--use-precision-aware-optimizer``) makes megatron-core's ``get_megatron_optimizer`` wrap the
distributed optimizer's shards in ``optimizer/cpu_offloading/hybrid_optimizer.py``'s
``HybridDeviceOptimizer``: the fp32 master copy and Adam's moments of a fraction ``F`` of this
rank's parameters (by elements) live on the host, where torch's AdamW steps them; each step
copies their gradients to the host and the updated parameters back. The rest stays on the
device. megatron-core decides what to offload by ``param.is_cuda``; on the NPU
``transfer_to_npu`` makes npu tensors answer True. On the CPU there is no device to offload
from (nothing is ``is_cuda``, and megatron-core then fails with a ``KeyError``): refused.
"""

from __future__ import annotations

from unittest import mock

import torch

from mcore_flash.optim.host_adam import MOMENT_DTYPES, HostAdamW


def optimizer_settings(config) -> dict:
    """The ``OptimizerConfig`` fields of the offload flags (none without them)."""
    if not (config.optimizer_cpu_offload or config.use_precision_aware_optimizer):
        return {}
    settings = dict(use_precision_aware_optimizer=config.use_precision_aware_optimizer)
    if config.optimizer_cpu_offload:
        check_device()
        settings.update(
            optimizer_cpu_offload=True,
            optimizer_offload_fraction=config.optimizer_offload_fraction,
            overlap_cpu_optimizer_d2h_h2d=config.overlap_cpu_optimizer_d2h_h2d,
            **moment_dtypes(config),
        )
    return settings


def moment_dtypes(config) -> dict[str, torch.dtype]:
    """``{"exp_avg_dtype": ..., "exp_avg_sq_dtype": ...}``: the storage dtypes of Adam's moments
    (``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``, megatron's ``OptimizerConfig`` names)."""
    return {
        "exp_avg_dtype": MOMENT_DTYPES[config.exp_avg_dtype],
        "exp_avg_sq_dtype": MOMENT_DTYPES[config.exp_avg_sq_dtype],
    }


def build_optimizer(config, optimizer_config, model_chunks: list):
    """megatron-core's ``get_megatron_optimizer``; with narrower moments its offloaded optimizer's
    host step is :class:`.host_adam.HostAdamW`. megatron-core builds that step from its module's
    ``CPUAdam`` (torch's AdamW: ``optimizer/__init__.py``, ``_get_megatron_optimizer_based_on_param_groups``),
    replaced while it builds; the dtypes go into the hybrid optimizer's param groups, which it
    copies into its sub-optimizers' before every step (``_sync_hdo_param_groups_to_sub_optimizers``)
    and which checkpoints keep."""
    from megatron.core import optimizer as megatron_optimizer

    dtypes = moment_dtypes(config)
    if set(dtypes.values()) == {torch.float32}:
        return megatron_optimizer.get_megatron_optimizer(optimizer_config, model_chunks)
    with mock.patch.object(megatron_optimizer, "CPUAdam", HostAdamW):
        optimizer = megatron_optimizer.get_megatron_optimizer(optimizer_config, model_chunks)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            group.update(dtypes)
    return optimizer


def check_device() -> None:
    """ValueError naming the flag when this process trains on the CPU (nothing to offload)."""
    from mcore_flash import platform

    if platform.device_type() == "cpu":
        raise ValueError(
            "--optimizer-cpu-offload moves optimizer state from the device to the host, and this run "
            "trains on the CPU: drop the flag (or rehearse the NPU path with --emulate-npu)"
        )


def state_placement(optimizer) -> dict[str, dict[str, int]]:
    """Bytes of the optimizer's per-parameter state tensors (Adam's moments, the offloaded
    fp32 master copies) by device type and dtype: ``{"cpu": {"torch.float32": n}, ...}``; a
    DTensor's (torch FSDP2's) by its local shard, which may live on the host of its mesh."""
    return _placement(
        value
        for inner in getattr(optimizer, "chained_optimizers", [optimizer])
        for state in inner.optimizer.state.values()
        for value in state.values()
    )


def model_state_placement(model_chunks: list) -> dict[str, dict[str, int]]:
    """Bytes of this rank's parameters (their local shards) by device type and dtype, as
    :func:`state_placement`: the host holds them all under ``--fsdp2-offload-to-cpu``."""
    return _placement(param for chunk in model_chunks for param in chunk.parameters())


def _placement(tensors) -> dict[str, dict[str, int]]:
    placement: dict[str, dict[str, int]] = {}
    for value in tensors:
        value = getattr(value, "_local_tensor", value)
        if torch.is_tensor(value) and value.dim() > 0:
            by_dtype = placement.setdefault(value.device.type, {})
            dtype = str(value.dtype)
            by_dtype[dtype] = by_dtype.get(dtype, 0) + value.numel() * value.element_size()
    return placement
