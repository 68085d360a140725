"""Megatron-Core adapters: fused core attention, SP-capable norms and layer/block specs.

The names below are imported on first use, so importing a module of this package that needs
neither torch nor megatron-core (``recompute``: the recompute settings the config holds) loads
neither."""

import importlib

_LAZY = {
    "FlashDotProductAttention": "attention",
    "FlashTransformerLayer": "layer",
    "LayerNorm": "norms",
    "RMSNorm": "norms",
    "get_gpt_decoder_block_flash_spec": "specs",
    "get_gpt_layer_flash_spec": "specs",
}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
