"""Megatron-Core adapters: fused core attention, SP-capable norms and layer/block specs."""

from .attention import FlashDotProductAttention
from .layer import FlashTransformerLayer
from .norms import LayerNorm, RMSNorm
from .specs import get_gpt_decoder_block_flash_spec, get_gpt_layer_flash_spec

__all__ = [
    "FlashDotProductAttention",
    "FlashTransformerLayer",
    "LayerNorm",
    "RMSNorm",
    "get_gpt_decoder_block_flash_spec",
    "get_gpt_layer_flash_spec",
]
