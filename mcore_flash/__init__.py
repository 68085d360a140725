"""mcore_flash: fused FlashAttention for Megatron-Core, for long-context training.

Layers, lowest first (imports point down only; ``tests/test_layers.py`` declares and checks
them): the leaves; ``emulation`` (an emulated Ascend device and torch_npu, torch only),
``ops`` (attention kernels, no Megatron), ``platform`` (the device adapter);
``transformer`` (Megatron modules and specs); ``data``, ``planning`` (pure Python),
``optim``; ``checkpoint``; ``runtime`` (flags, config, model, a trained model);
``conversion``; ``training``, ``evaluation``, ``generate``; the other CLIs. The emulation is
installed by ``--emulate-npu`` and by the dry run of an optimizer-offload layout
(:mod:`mcore_flash.training.dry_run`); nothing else imports it.
"""

__version__ = "0.1.0"

_LAZY = {
    "get_gpt_layer_flash_spec": "mcore_flash.transformer",
    "get_gpt_decoder_block_flash_spec": "mcore_flash.transformer",
    "FlashDotProductAttention": "mcore_flash.transformer",
}


def __getattr__(name):
    """Import Megatron-dependent names on first use, so ``mcore_flash.ops`` stays Megatron-free."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mcore_flash' has no attribute {name!r}")
