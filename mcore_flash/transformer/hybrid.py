"""Our layer spec inside megatron-core's ``HybridModel`` (0.19+), the class 0.19 recommends
over ``GPTModel`` ("GPTModel IS DEPRECATED", Megatron-LM ``docs/user-guide/hybrid-model-migration.md``).

A GPT layer becomes two hybrid layers, pattern ``"*-"`` per GPT layer: ``*`` is our attention
layer (input norm, ``SelfAttention`` whose core attention is the fused kernel) and ``-`` is
megatron's ``MLPLayer`` (pre-MLP norm, ``MLP`` with our fused SwiGLU). The model computes what
``GPTModel`` with :func:`~mcore_flash.transformer.get_gpt_decoder_block_flash_spec` computes;
its checkpoint keys differ (:func:`gpt_to_hybrid_state_dict`).

    config = hybrid_config(gpt_config)                # num_layers doubled, is_hybrid_model
    model = HybridModel(config, get_hybrid_flash_stack_spec(config), vocab_size=...,
                        max_sequence_length=..., hybrid_layer_pattern=hybrid_layer_pattern(gpt_config.num_layers),
                        position_embedding_type="rope")

``mcore-flash pretrain`` still builds ``GPTModel`` on every release (docs/megatron-versions.md).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from mcore_flash.compat import hybrid_stack_parts

from .norms import norm_class
from .specs import get_gpt_layer_flash_spec

PATTERN_PER_GPT_LAYER = "*-"


def hybrid_layer_pattern(num_gpt_layers: int) -> str:
    """``hybrid_layer_pattern`` for a model of ``num_gpt_layers`` GPT layers."""
    return PATTERN_PER_GPT_LAYER * num_gpt_layers


def hybrid_config(config: TransformerConfig) -> TransformerConfig:
    """A GPT config as HybridModel's: twice the layers, ``is_hybrid_model`` (which keeps the
    output layer's init std equal to the GPT model's)."""
    return dataclasses.replace(config, num_layers=2 * config.num_layers, is_hybrid_model=True)


def _flash_hybrid_stack_class():
    HybridStack, _, _ = hybrid_stack_parts()

    class FlashHybridStack(HybridStack):
        """``HybridStack`` whose final norm is ours: 0.19's ``HybridStack.__init__``
        (``models/hybrid/hybrid_block.py``) builds Transformer Engine's ``TENorm``, which does
        not exist on Ascend or the CPU."""

        def __init__(self, config, submodules, *args, post_layer_norm: bool = True, **kwargs):
            super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
            self.post_layer_norm = post_layer_norm
            if self.post_process and post_layer_norm:
                self.final_norm = norm_class(config.normalization)(
                    config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
                )

    return FlashHybridStack


def get_hybrid_flash_stack_spec(
    config: TransformerConfig, attention_backend: Optional[str] = None
) -> ModuleSpec:
    """The ``hybrid_stack_spec`` for ``HybridModel``: our attention layer as ``*``, megatron's
    ``MLPLayer`` with our norm and fused SwiGLU as ``-``. Raises ImportError (naming the
    installed release) before megatron-core 0.19."""
    _, HybridStackSubmodules, MLPLayer = hybrid_stack_parts()
    layer = get_gpt_layer_flash_spec(config.normalization, config.qk_layernorm, attention_backend)
    parts = layer.submodules
    return ModuleSpec(
        module=_flash_hybrid_stack_class(),
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(
                module=layer.module,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=parts.input_layernorm,
                    self_attention=parts.self_attention,
                    self_attn_bda=get_bias_dropout_add,
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=parts.pre_mlp_layernorm,
                    mlp=parts.mlp,
                    mlp_bda=get_bias_dropout_add,
                ),
            ),
        ),
    )


_GPT_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def gpt_to_hybrid_state_dict(state: dict) -> dict:
    """``GPTModel`` (flash spec) state-dict keys -> the ``HybridModel`` keys above: GPT layer
    ``i``'s norm + attention go to hybrid layer ``2i``, its pre-MLP norm + MLP to ``2i+1``;
    ``decoder.final_layernorm`` becomes ``decoder.final_norm``."""
    mapped = {}
    for key, value in state.items():
        match = _GPT_LAYER_KEY.match(key)
        if match:
            index, rest = int(match.group(1)), match.group(2)
            attention = rest.startswith(("input_layernorm.", "self_attention."))
            key = f"decoder.layers.{2 * index + (0 if attention else 1)}.{rest}"
        elif key.startswith("decoder.final_layernorm."):
            key = "decoder.final_norm." + key.removeprefix("decoder.final_layernorm.")
        mapped[key] = value
    return mapped
