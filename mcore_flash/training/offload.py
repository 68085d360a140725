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
