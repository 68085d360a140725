"""mcore_flash: fused FlashAttention for Megatron-Core, for long-context training.

Layers (imports point down only): ``mcore_flash.ops`` (attention kernels, no Megatron),
``mcore_flash.platform`` (the device adapter), ``mcore_flash.transformer`` (Megatron
modules and specs), then training, planning and the CLI.
"""

__version__ = "0.1.0"
