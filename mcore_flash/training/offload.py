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

import torch


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
        )
    return settings


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
    fp32 master copies) by device type and dtype: ``{"cpu": {"torch.float32": n}, ...}``."""
    placement: dict[str, dict[str, int]] = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    by_dtype = placement.setdefault(value.device.type, {})
                    dtype = str(value.dtype)
                    by_dtype[dtype] = by_dtype.get(dtype, 0) + value.numel() * value.element_size()
    return placement
