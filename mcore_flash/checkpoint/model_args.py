"""Which flags define a model: ``model_args``, stored in every checkpoint.

Those in :data:`SHAPE_ARGS` fix the tensors' shapes and meaning: a checkpoint loads only into
a model with the same values. Those in :data:`POSITION_ARGS` (RoPE, positions, eps) may change
between runs: that is how a context is extended.
"""

from __future__ import annotations

SHAPE_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "untie_embeddings_and_output_weights",
    "swiglu",
    "disable_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "kv_channels",
    "normalization",
    "position_embedding_type",
)
POSITION_ARGS = (
    "max_position_embeddings",
    "rotary_base",
    "use_rope_scaling",
    "rope_scaling_factor",
    "rotary_seq_len_interpolation_factor",
    "norm_epsilon",
)


def model_args(config, vocab_size: int) -> dict:
    """The model's defining flags (``SHAPE_ARGS`` + ``POSITION_ARGS``, read from ``config``'s
    attributes of those names) and the unpadded ``vocab_size``."""
    out = {name: getattr(config, name) for name in SHAPE_ARGS + POSITION_ARGS}
    out["use_rope_scaling"] = bool(out["use_rope_scaling"])
    if out["kv_channels"] == config.hidden_size // config.num_attention_heads:
        out["kv_channels"] = None  # the default head size, stored as such
    return {**out, "vocab_size": vocab_size}
