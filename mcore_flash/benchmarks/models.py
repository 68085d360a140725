"""The benchmarks' models: megatron-core ``GPTModel`` with our flash spec for a planner
:class:`~mcore_flash.planning.ModelShape` (:func:`build_flash_gpt`).

Needs torch and megatron-core (imported on first use, as the benchmarks' other megatron
imports); the planner itself (:mod:`mcore_flash.planning`) stays pure Python.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from mcore_flash.planning import ModelShape, get_model

__all__ = ["build_flash_gpt"]


def build_flash_gpt(
    model: Union[ModelShape, str],
    tp: int = 1,
    vp_stage: Optional[int] = None,
    layer_recompute_modules: Sequence[str] = (),
    **config_overrides,
):
    """megatron-core ``GPTModel`` with the flash spec for a model shape (or a preset name of
    :data:`mcore_flash.planning.MODELS`), on the current default device (this rank's
    pipeline stage; fp32, no dropout unless overridden).

    ``config_overrides`` go to ``TransformerConfig`` (e.g. ``params_dtype``, recompute
    settings); ``layer_recompute_modules`` to the spec (the selective modules our layer
    applies itself). Needs torch and megatron-core with its parallel state initialised.
    """
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_flash.transformer.specs import get_gpt_decoder_block_flash_spec

    model = get_model(model)
    settings = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.gated,
        activation_func=torch.nn.functional.silu if model.gated else torch.nn.functional.gelu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    config = TransformerConfig(**{**settings, **config_overrides})
    return GPTModel(
        config,
        get_gpt_decoder_block_flash_spec(
            config, vp_stage=vp_stage, layer_recompute_modules=layer_recompute_modules
        ),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        position_embedding_type=model.position_embedding_type,
        rotary_percent=model.rotary_percent,
        rotary_base=model.rotary_base,
        rope_scaling=model.rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
    )
