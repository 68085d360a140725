"""Hugging Face ``config.json`` (Llama, Qwen2/Qwen2.5, Qwen3 dense) <-> the trainer's model flags.

The model is described on our side by ``model_args``: a dict keyed by ``mcore-flash pretrain``
argument names (``num_layers``, ``rotary_base``, ...) plus ``vocab_size`` (unpadded). It is
stored in every checkpoint and turned into flags with :func:`model_flags`.

Architectures (:data:`ARCHITECTURES`): ``LlamaForCausalLM``; ``Qwen2ForCausalLM`` (Qwen2,
Qwen2.5: a Llama with q/k/v biases, no o_proj bias: ``--add-qkv-bias``); ``Qwen3ForCausalLM``
(dense Qwen3: per-head q/k RMSNorm before RoPE, no biases, its own ``head_dim``, default 128 as
in transformers' ``Qwen3Config``: ``--qk-layernorm --kv-channels``). Export picks the
architecture from those flags (:func:`architecture_of`, :func:`hf_config_from_model_args`).

Import (:func:`model_args_from_hf`, which lists the fields it reads and the values it
requires): shape, norm epsilon, tied embeddings and RoPE (none, ``llama3``, integer
``linear``; ``yarn`` is refused: :func:`_rope_args`) come from ``config.json``. Fields that
``transformers`` itself ignores or keeps as metadata are accepted (:func:`is_metadata`); any
other field that would change the model is a :class:`ConversionError` naming it, so a
checkpoint is never converted into a silently different model. Supported models and
refusals: docs/conversion.md, "What converts".
"""

from __future__ import annotations

import json
import os


class ConversionError(ValueError):
    """Bad converter input; the message names the file, field or flag to fix."""


LLAMA, QWEN2, QWEN3 = "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
ARCHITECTURE = LLAMA
# architecture -> its model_type
ARCHITECTURES = {LLAMA: "llama", QWEN2: "qwen2", QWEN3: "qwen3"}
# transformers' Qwen3Config default head_dim (configuration_qwen3.py): a config without one has it
QWEN3_DEFAULT_HEAD_DIM = 128

# Fields that do not change the forward pass of a Llama (ids, training-time settings, metadata);
# an export copies these from the config.json the checkpoint was converted from.
_IGNORED = {
    "_name_or_path",
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "pretraining_tp",
    "attention_dropout",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "tokenizer_class",
    "id2label",
    "label2id",
    "problem_type",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "tie_encoder_decoder",
}
# The special-token ids transformers keeps in config.json (the tokenizer's, not the model's;
# ``unk_token_id`` and the like are what a tokenizer's config adds): accepted, and an export
# writes them back as the source had them.
_TOKEN_ID_FIELDS = {
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "unk_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
    "decoder_start_token_id",
}
_IGNORED |= _TOKEN_ID_FIELDS
# PretrainedConfig's own attributes, which no Llama's forward pass reads: transformers 5.25's
# (configuration_utils.py: the dataclass fields and the kwargs ``__post_init__`` pops) and those
# 4.x's ``PretrainedConfig.__init__`` set and wrote into config.json. Not here: ``pruned_heads``
# (4.x prunes the heads it lists: the model changes), ``tie_word_embeddings`` (read) and
# ``per_layer_config`` (5.x's per-layer overrides).
_PRETRAINED_CONFIG_FIELDS = {
    "transformers_version",
    "architectures",
    "model_type",
    "name_or_path",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "dtype",
    "torch_dtype",
    "attn_implementation",
    "experts_implementation",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "is_decoder",
    "add_cross_attention",
    "cross_attention_hidden_size",
    "tie_encoder_decoder",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "finetuning_task",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "tokenizer_class",
    "prefix",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "task_specific_params",
}
# Decoding settings transformers 4.x kept in config.json (5.x pops them when it reads a config:
# ``GenerationConfig._get_default_generation_params()``); they belong in generation_config.json.
_GENERATION_FIELDS = {
    "max_length",
    "max_new_tokens",
    "min_length",
    "min_new_tokens",
    "do_sample",
    "use_cache",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "min_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "repetition_penalty",
    "encoder_repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
    "assistant_lookbehind",
    "target_lookbehind",
}
_READ = {
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "hidden_act",
}
# read besides, per architecture
_READ_BY_ARCHITECTURE = {
    LLAMA: {"head_dim", "attention_bias", "mlp_bias"},
    QWEN2: {"head_dim", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    QWEN3: {
        "head_dim",
        "attention_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    },
}
# Qwen fields that change nothing while use_sliding_window is false; an export copies them
# from the config.json the checkpoint was converted from
_QWEN_WINDOW_FIELDS = ("sliding_window", "max_window_layers")
# megatron's RotaryEmbedding._apply_scaling fixes these (megatron/core/models/common/embeddings/
# rotary_pos_embedding.py); a checkpoint with other values needs a different rotary embedding.
_LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(
            f"--hf-dir {hf_dir}: no config.json there; point it at a Hugging Face model directory"
        )
    with open(path) as f:
        return json.load(f)


def read_generation_config(hf_dir: str) -> dict | None:
    """``generation_config.json`` of a Hugging Face directory (transformers' decoding defaults
    for the model: ``eos_token_id``, an int or a list, ...), or None where there is none."""
    path = os.path.join(hf_dir, "generation_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def model_args_from_hf(config: dict) -> dict:
    """The trainer's ``model_args`` for a Llama, Qwen2 or Qwen3 ``config.json`` (raises
    ConversionError naming the field).

    Read from ``config.json``: ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``vocab_size``, ``rms_norm_eps``,
    ``max_position_embeddings``, ``tie_word_embeddings``, RoPE as ``rope_theta`` +
    ``rope_scaling`` (transformers 4.x, the Hub) or ``rope_parameters`` (transformers 5.x):
    no scaling, Llama-3.1's ``"llama3"`` (megatron's fixed low/high frequency factors 1 and 4
    over 8192 positions) or integer ``"linear"`` interpolation (:func:`_rope_args`).
    ``hidden_act`` must be silu; Llama's ``head_dim``, ``attention_bias``, ``mlp_bias`` must
    have Llama's values, Qwen3's ``attention_bias`` false; Qwen's ``use_sliding_window`` must
    be false (then ``sliding_window`` and ``max_window_layers`` change nothing and are
    accepted) and its ``layer_types``, where given, all ``full_attention``. Fields that
    ``transformers`` itself ignores or keeps as metadata are accepted (:func:`is_metadata`).
    Any other field that would change the model (a non-empty ``pruned_heads`` among them) is
    an error naming it, so a checkpoint is never converted into a silently different model.
    """
    architecture = _architecture(config)
    read = _READ | _READ_BY_ARCHITECTURE[architecture]
    unknown = sorted(
        k
        for k in config
        if not is_metadata(k) and k not in read and config[k] not in (None, False, 0, {}, [])
    )
    if unknown:
        raise ConversionError(
            f"config.json: field(s) {', '.join(unknown)} would change the model and are not supported "
            f"by the {_FAMILY[architecture]} converter"
        )
    heads = _required(config, "num_attention_heads")
    hidden = _required(config, "hidden_size")
    fixed = {"hidden_act": "silu"}
    if architecture == LLAMA:
        fixed.update(attention_bias=False, mlp_bias=False)
    if architecture == QWEN3:
        fixed["attention_bias"] = False
    for field, value in fixed.items():
        if config.get(field, value) != value:
            raise ConversionError(
                f"config.json: {field}={config[field]!r} is not supported "
                f"({_FAMILY[architecture]} uses {value!r})"
            )
    if architecture == LLAMA:
        if config.get("head_dim") not in (None, hidden // heads):
            raise ConversionError(
                f"config.json: head_dim={config['head_dim']} differs from hidden_size / num_attention_heads = {hidden // heads}"
            )
        head_dim = hidden // heads
    else:
        _check_full_attention(config)
        default = QWEN3_DEFAULT_HEAD_DIM if architecture == QWEN3 else hidden // heads
        head_dim = config.get("head_dim") or default
    args = dict(
        num_layers=_required(config, "num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=_required(config, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        vocab_size=_required(config, "vocab_size"),
        swiglu=True,
        disable_bias_linear=True,
        add_qkv_bias=architecture == QWEN2,
        qk_layernorm=architecture == QWEN3,
        kv_channels=None if head_dim == hidden // heads else head_dim,
        normalization="RMSNorm",
        position_embedding_type="rope",
    )
    args.update(_rope_args(config))
    return args


_FAMILY = {LLAMA: "Llama", QWEN2: "Qwen2", QWEN3: "Qwen3"}


def _architecture(config: dict) -> str:
    """The config's architecture among :data:`ARCHITECTURES` (a config without
    ``architectures`` goes by its ``model_type``, Llama when it has none either)."""
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    by_type = {t: a for a, t in ARCHITECTURES.items()}
    architecture = architectures[0] if architectures else by_type.get(model_type or "llama")
    if (
        len(architectures) > 1
        or architecture not in ARCHITECTURES
        or model_type not in (None, ARCHITECTURES[architecture])
    ):
        raise ConversionError(
            f"config.json: architecture {architectures or model_type!r} is not supported; the converter "
            f"handles {', '.join(ARCHITECTURES)} (Llama-2/3/3.1/3.2, Qwen2/Qwen2.5, dense Qwen3 and "
            "models with their tensor names)"
        )
    return architecture


def _check_full_attention(config: dict) -> None:
    """Qwen: every layer attends to the whole causal context (no sliding-window layers)."""
    if config.get("use_sliding_window"):
        raise ConversionError(
            f"config.json: use_sliding_window={config['use_sliding_window']!r} is not supported "
            "(Qwen's sliding-window layers from max_window_layers on); only full attention converts"
        )
    sliding = sorted({t for t in config.get("layer_types") or [] if t != "full_attention"})
    if sliding:
        raise ConversionError(
            f"config.json: layer_types {sliding} are not supported; only full_attention layers convert"
        )


def is_metadata(field: str) -> bool:
    """Whether ``field`` is one transformers ignores or keeps as metadata (it changes no weight
    and no computation of a Llama): keys starting with ``_`` (``_name_or_path``,
    ``_attn_implementation_autoset``, ...), ``PretrainedConfig``'s own attributes and the
    generation settings transformers 4.x stored in ``config.json``
    (:data:`_PRETRAINED_CONFIG_FIELDS`, :data:`_GENERATION_FIELDS`)."""
    return (
        field.startswith("_")
        or field in _IGNORED
        or field in _PRETRAINED_CONFIG_FIELDS
        or field in _GENERATION_FIELDS
    )


def _rope_args(config: dict) -> dict:
    """The RoPE flags for ``config``: ``rope_theta`` + ``rope_scaling`` (transformers 4.x) or
    ``rope_parameters`` (5.x); no scaling, ``"llama3"`` or integer ``"linear"``.

    ``yarn`` is refused: megatron-core's ``YarnRotaryEmbedding`` computes transformers'
    frequencies and attention factor (checked for Qwen's recipe), but
    ``GPTModel(position_embedding_type="yarn")`` reads its settings from ``yarn_*`` config
    fields only ``MLATransformerConfig`` declares, and the trainer (whose flags are
    Megatron-LM's, which has none for them) does not set them.
    """
    rope = dict(config.get("rope_parameters") or {})
    rope.update(config.get("rope_scaling") or {})
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = dict(
        rotary_base=_whole(theta, "rope_theta"),
        use_rope_scaling=False,
        rope_scaling_factor=8.0,
        rotary_seq_len_interpolation_factor=None,
    )
    if kind == "default":
        return out
    if kind == "llama3":
        for field, fixed in _LLAMA3_FIXED.items():
            if float(rope.get(field, fixed)) != fixed:
                raise ConversionError(
                    f"config.json: rope_scaling.{field}={rope[field]} is not supported (megatron's llama3 scaling fixes {fixed})"
                )
        return {**out, "use_rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
    if kind == "linear":
        return {
            **out,
            "rotary_seq_len_interpolation_factor": _whole(rope["factor"], "rope_scaling.factor"),
        }
    reason = (
        " (megatron-core builds its YaRN embedding from MLA-only config fields, which the "
        "trainer does not set)"
        if kind == "yarn"
        else ""
    )
    raise ConversionError(
        f"config.json: rope_scaling type {kind!r} is not supported{reason}; supported: default, "
        "llama3, linear (integer factor)"
    )


def architecture_of(model_args: dict) -> str:
    """The Hugging Face architecture of a model: Qwen2 with ``add_qkv_bias``, Qwen3 with
    ``qk_layernorm``, else Llama."""
    qkv_bias, qk_norm = model_args.get("add_qkv_bias"), model_args.get("qk_layernorm")
    if qkv_bias and qk_norm:
        raise ConversionError(
            "--add-qkv-bias with --qk-layernorm has no Hugging Face architecture here "
            "(Qwen2 has the q/k/v biases, Qwen3 the q/k norms)"
        )
    return QWEN2 if qkv_bias else QWEN3 if qk_norm else LLAMA


def hf_config_from_model_args(model_args: dict, base: dict | None = None) -> dict:
    """The ``config.json`` for ``model_args`` (transformers 4.x field names, which 5.x reads):
    ``Qwen2ForCausalLM`` with ``--add-qkv-bias``, ``Qwen3ForCausalLM`` with ``--qk-layernorm``,
    else ``LlamaForCausalLM``.

    Non-architectural fields (token ids, ...) come from ``base``, the config the checkpoint was
    converted from, when there is one; everything that defines the model comes from ``model_args``,
    so RoPE changed by continued pretraining is what the exported config says.
    """
    if (
        model_args.get("normalization", "RMSNorm") != "RMSNorm"
        or not model_args.get("swiglu", True)
        or not model_args.get("disable_bias_linear", True)
        or model_args.get("position_embedding_type", "rope") != "rope"
    ):
        raise ConversionError(
            "only Llama-shaped models (RMSNorm, SwiGLU, no biases but Qwen2's q/k/v, RoPE) export "
            "to Hugging Face"
        )
    architecture = architecture_of(model_args)
    heads = model_args["num_attention_heads"]
    head_dim = model_args.get("kv_channels") or model_args["hidden_size"] // heads
    if architecture == LLAMA and head_dim != model_args["hidden_size"] // heads:
        raise ConversionError(
            f"--kv-channels {head_dim} differs from --hidden-size / --num-attention-heads: a Llama "
            "converts only with head_dim = hidden_size / num_attention_heads"
        )
    base = base or {}
    config = {k: v for k, v in base.items() if k in _IGNORED and k != "architectures"}
    config.pop("rope_parameters", None)
    config.update(
        architectures=[architecture],
        model_type=ARCHITECTURES[architecture],
        hidden_size=model_args["hidden_size"],
        intermediate_size=model_args["ffn_hidden_size"],
        num_hidden_layers=model_args["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=model_args["num_query_groups"],
        head_dim=head_dim,
        vocab_size=model_args["vocab_size"],
        rms_norm_eps=model_args["norm_epsilon"],
        max_position_embeddings=model_args["max_position_embeddings"],
        tie_word_embeddings=not model_args["untie_embeddings_and_output_weights"],
        rope_theta=float(model_args["rotary_base"]),
        rope_scaling=None,
        hidden_act="silu",
    )
    if architecture == LLAMA:
        config.update(attention_bias=False, mlp_bias=False)
    else:
        if architecture == QWEN2 and not model_args.get("kv_channels"):
            del config["head_dim"]  # Qwen2Config has none (the model takes hidden / heads)
        if architecture == QWEN3:
            config["attention_bias"] = False
        config["use_sliding_window"] = False
        if base.get("model_type") == config["model_type"]:
            config.update({k: base[k] for k in _QWEN_WINDOW_FIELDS if k in base})
    if model_args["use_rope_scaling"]:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(model_args["rope_scaling_factor"]),
            **_LLAMA3_FIXED,
        }
    elif model_args.get("rotary_seq_len_interpolation_factor"):
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(model_args["rotary_seq_len_interpolation_factor"]),
        }
    return config


def model_flags(model_args: dict) -> list[str]:
    """``mcore-flash pretrain`` flags that build the model ``model_args`` describes."""
    defaults = {"normalization": "RMSNorm", "position_embedding_type": "rope"}  # the trainer's own
    flags = []
    for name, value in model_args.items():
        if name == "vocab_size" or value is None or value is False or defaults.get(name) == value:
            continue
        if name == "rope_scaling_factor" and not model_args.get("use_rope_scaling"):
            continue
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def _required(config: dict, field: str):
    if config.get(field) is None:
        raise ConversionError(f"config.json: required field {field!r} is missing")
    return config[field]


def _whole(value, field: str) -> int:
    if float(value) != int(value):
        raise ConversionError(f"config.json: {field}={value} must be a whole number here")
    return int(value)
