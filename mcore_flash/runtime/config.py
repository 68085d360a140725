"""The trainer's configuration: every flag of ``mcore-flash pretrain`` resolved and checked once.

:func:`resolve_config` takes the parsed flags (Megatron-LM's names), fills what was left
unset from the checkpoint (``--use-checkpoint-args``) and from the ``--model`` preset,
checks the result against the world size (each error names the flag to change) and
returns a frozen :class:`TrainingConfig` with the derived values (data-parallel size,
micro-batches per iteration, recompute settings, hardware profile) computed here, once.
Everything downstream reads this object; nothing writes to it. Pure Python: nothing is
allocated before the flags are known to work.

The config is flat, its fields named as the flags (Megatron-LM's names, as megatron-core's own
flat ``TransformerConfig``), so evaluate, generate, the converter and the planner read the
same names; comments group the fields.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from mcore_flash.checkpoint import directory
from mcore_flash.planning.hardware import HardwareProfile
from mcore_flash.planning.models import MODELS, ModelShape
from mcore_flash.runtime.config_checks import checked_and_derived
from mcore_flash.runtime.fsdp2_settings import Fsdp2Settings
from mcore_flash.runtime.launch_flags import resolve_launch_flags
from mcore_flash.transformer.recompute import RecomputeSettings

DEFAULT_PRESET = "tiny"

# The training hyper-parameters every preset sets when the flag was not given, and those
# TRAINING_PRESETS sets instead for a preset; a preset's model shape comes from ``MODELS``
# (:func:`preset_shape`). "tiny" is the default CPU job: a few hundred steps in minutes on
# 2 cores, deep enough to learn the built-in long-range copy task.
TRAINING_DEFAULTS = dict(
    seq_length=4096,
    micro_batch_size=1,
    global_batch_size=None,
    train_iters=1000,
    lr=3e-4,
    min_lr=3e-5,
    lr_warmup_iters=100,
)
TRAINING_PRESETS = {
    "tiny": dict(
        seq_length=256,
        micro_batch_size=8,
        global_batch_size=8,
        train_iters=1000,
        lr=3e-3,
        min_lr=3e-4,
        lr_warmup_iters=30,
    ),
}


@dataclass(frozen=True)
class TrainingConfig:
    """The resolved flags of one training run (field = flag, ``--num-layers`` -> ``num_layers``)
    and the values derived from them. Lengths are in tokens, batch sizes in sequences."""

    # model: the shape (``--model`` preset, any flag given overrides it)
    model: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    group_query_attention: bool  # True whenever num_query_groups != num_attention_heads
    seq_length: int
    max_position_embeddings: int
    position_embedding_type: str  # "rope" or "learned_absolute"
    rotary_base: int
    use_rope_scaling: bool
    rope_scaling_factor: float
    rotary_seq_len_interpolation_factor: Optional[int]
    norm_epsilon: float
    normalization: str  # "RMSNorm" or "LayerNorm"
    swiglu: bool
    untie_embeddings_and_output_weights: bool
    disable_bias_linear: bool
    add_qkv_bias: bool  # a bias on linear_qkv alone (Qwen2)
    qk_layernorm: bool  # per-head query/key norms (Qwen3)
    kv_channels: Optional[int]  # head size; None: hidden_size / num_attention_heads
    attention_dropout: float
    hidden_dropout: float
    attention_backend: Optional[str]  # None: by device
    window_size: Optional[tuple[int, int]]  # (left, right) tokens, -1 unbounded
    window_attn_skip_freq: Optional[int]
    # parallelism
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    # interleaved 1F1B: model chunks per pipeline rank (None: plain 1F1B); from either flag
    virtual_pipeline_model_parallel_size: Optional[int]  # resolved: None = one chunk per stage
    num_layers_per_virtual_pipeline_stage: Optional[int]  # None once resolved into the line above
    context_parallel_size: int
    cp_comm_type: str
    sequence_parallel: bool
    use_distributed_optimizer: bool  # True with --use-megatron-fsdp, which implies it
    overlap_grad_reduce: bool
    overlap_param_gather: bool  # the all-gather in the next forward (megatron's DDP hooks)
    grad_reduce_in_bf16: bool  # main gradients (and their reduction) in bf16 instead of fp32
    use_megatron_fsdp: bool  # ZeRO-3 by megatron-core's Megatron-FSDP (:mod:`.fsdp`)
    data_parallel_sharding_strategy: Optional[str]  # FSDP's; None without FSDP
    use_torch_fsdp2: bool  # torch FSDP2 around the model (:mod:`.fsdp2_settings`)
    fsdp2_offload_to_cpu: bool  # the flag; ``fsdp2`` below holds what flag and file resolve to
    fsdp2_config_path: Optional[str]
    no_gradient_accumulation_fusion: bool  # accepted as in Megatron-LM; nothing is fused here
    # minutes: a collective's timeout, and the watchdog's limit per iteration and per save
    distributed_timeout_minutes: float
    # host offload of the optimizer (megatron-core's HybridDeviceOptimizer)
    optimizer_cpu_offload: bool
    optimizer_offload_fraction: float  # of the optimizer state (parameters) stepped on the host
    use_precision_aware_optimizer: bool
    exp_avg_dtype: str  # "fp32" or "bf16": storage of Adam's moments (bf16: the host step's)
    exp_avg_sq_dtype: str
    overlap_cpu_optimizer_d2h_h2d: bool
    # activation recompute (the flags; ``recompute`` below is what they mean)
    recompute_granularity: Optional[str]
    recompute_method: Optional[str]
    recompute_num_layers: Optional[int]
    recompute_modules: Optional[tuple[str, ...]]
    activation_offload_layers: (
        int  # first N layers of each stage park their saved tensors on the host
    )
    # sequence tiling: tokens per tile; None: the whole sequence at once (megatron's)
    loss_compute_mode: str  # "default" or "chunk"
    loss_chunk_size: Optional[int]  # resolved: None unless loss_compute_mode == "chunk"
    mlp_chunk_size: Optional[int]
    # precision, optimiser and schedule
    bf16: bool
    fp16: bool
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    weight_decay: float
    clip_grad: float
    adam_beta1: float
    adam_beta2: float
    micro_batch_size: int  # sequences per micro-batch and data-parallel rank
    global_batch_size: int  # sequences per iteration, all data-parallel ranks together
    train_iters: int
    seed: int
    # data
    data_path: Optional[tuple[str, ...]]
    split: str
    tokenizer_type: Optional[str]
    tokenizer_model: Optional[str]
    make_vocab_size_divisible_by: int
    mock_data: bool
    reset_attention_mask: bool
    reset_position_ids: bool
    eod_mask_loss: bool
    data_cache_path: Optional[str]
    synthetic_key_depth: Optional[str]  # the built-in task's key placement; None: other data
    # device
    emulate_npu: bool
    # checkpoints and logging
    save: str
    load: Optional[str]
    ckpt_format: str  # "torch_dist" (megatron's dist_checkpointing) or "fsdp_dtensor" (with FSDP)
    async_save: bool  # torch_dist shards written in the background (``BackgroundSaves``)
    finetune: bool
    no_load_optim: bool
    no_load_rng: bool
    use_checkpoint_args: bool
    save_interval: int
    exit_interval: Optional[int]
    eval_interval: Optional[int]  # iterations between validations; None: no validation
    eval_iters: int  # global batches per validation
    exit_duration_in_mins: Optional[float]  # minutes from the start of the setup
    log_interval: int
    tensorboard_dir: Optional[str]
    hardware: Optional[HardwareProfile]  # the ``--hardware`` profile, loaded
    device_memory: Optional[str]
    dry_run: bool
    world_size: int
    # what the launch line's flags became where that needs saying (aliases, flags that change
    # nothing here, defaults a preset or Megatron-LM's rules chose): said once at the start
    notes: tuple[str, ...] = ()
    # derived (by __post_init__)
    data_parallel_size: int = field(init=False)  # world_size / (TP x PP x CP)
    # per iteration and data-parallel rank: global / (micro x DP)
    num_micro_batches: int = field(init=False)
    recompute: RecomputeSettings = field(init=False)
    fsdp2: Optional[Fsdp2Settings] = field(init=False)  # None without --use-torch-fsdp2

    def __post_init__(self):
        """Check the flags against each other and the world size (ValueError naming the flag)
        and resolve what follows from them: the derived fields, and the flags resolved on the
        way (global batch, virtual pipeline size, hardware profile, sharding). Runs again on
        ``dataclasses.replace``, so a changed config is checked as a parsed one is."""
        for name, value in checked_and_derived(self, self.world_size).items():
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """``{field: value}``, the values themselves (``dataclasses.asdict`` would turn the
        hardware profile and recompute settings into dicts)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


# The flags a TrainingConfig holds: every field but the world size, the notes and the derived ones.
FLAG_NAMES = tuple(
    field.name
    for field in dataclasses.fields(TrainingConfig)
    if field.init and field.name not in ("world_size", "notes")
)


def resolve_config(flags: Mapping[str, Any], world_size: Optional[int] = None) -> TrainingConfig:
    """The config of the parsed ``flags`` (``vars`` of the pretrain parser's namespace; other
    keys are ignored) for ``world_size`` ranks (default: env WORLD_SIZE, else 1, or TP x PP x CP
    for ``--dry-run``). A Megatron-LM or MindSpeed-LLM launch line's own flags are resolved
    first (:mod:`.launch_flags`: :class:`~.launch_flags.LaunchFlagsRefused` names every refused
    one). Raises ValueError naming the flag for settings that cannot work."""
    updates, notes = resolve_launch_flags(flags)
    flags = {**flags, **updates}
    values = {name: flags[name] for name in FLAG_NAMES}
    for name in ("data_path", "recompute_modules"):  # argparse's lists, frozen as the rest
        if values[name] is not None:
            values[name] = tuple(values[name])
    given_positions = values["max_position_embeddings"]  # on the line, not the checkpoint's
    if values["use_checkpoint_args"]:
        values.update(_checkpoint_model_flags(values))
    filled, preset_notes = _preset_values(values)
    values.update(filled)
    notes += preset_notes + _position_notes(values, given_positions)
    if world_size is None:
        model_parallel = (
            values["tensor_model_parallel_size"] * values["pipeline_model_parallel_size"]
        )
        model_parallel *= values["context_parallel_size"]
        world_size = int(os.environ.get("WORLD_SIZE", model_parallel if values["dry_run"] else 1))
    return TrainingConfig(**values, world_size=world_size, notes=tuple(notes))


def preset_shape(name: str) -> ModelShape:
    """The model shape of ``--model name``: the planner's preset of that name."""
    return MODELS[name]


def _checkpoint_model_flags(values: Mapping[str, Any]) -> dict[str, Any]:
    """``--use-checkpoint-args``: the checkpoint's value of every model flag left unset."""
    if not values["load"]:
        raise ValueError("--use-checkpoint-args needs --load")
    directory.check_checkpoint(
        values["load"], ["--use-checkpoint-args"]
    )  # before torch is imported
    saved = directory.read_model_args(values["load"])
    filled = {}
    for name, value in saved.items():
        if name == "vocab_size" or (
            name == "rope_scaling_factor" and not saved["use_rope_scaling"]
        ):
            continue  # the vocabulary comes from the tokenizer; a factor without scaling means nothing
        if values[name] is None:
            filled[name] = value
    return filled


def preset_defaults(name: str) -> dict[str, Any]:
    """The values ``--model name`` gives the model and schedule flags left unset (before the
    rules of :func:`_preset_values`: Megatron-LM's derived defaults, the warm-up cut)."""
    shape = preset_shape(name)
    defaults = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        max_position_embeddings=shape.max_position_embeddings,
        rotary_base=shape.rotary_base,
        use_rope_scaling=shape.rope_scaling,
        rope_scaling_factor=shape.rope_scaling_factor,
        norm_epsilon=shape.norm_epsilon,
        swiglu=shape.gated,
        untie_embeddings_and_output_weights=shape.untie_embeddings_and_output_weights,
        disable_bias_linear=not shape.add_bias_linear,
        add_qkv_bias=shape.add_qkv_bias,
        qk_layernorm=shape.qk_layernorm,
        kv_channels=shape.kv_channels,
        normalization=shape.normalization,
        position_embedding_type=shape.position_embedding_type,
        **TRAINING_DEFAULTS,
    )
    defaults.update(TRAINING_PRESETS.get(name, {}))
    return defaults


def _preset_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(filled, notes)``: the values ``--model`` (default tiny) gives the model/schedule flags
    left unset, and the defaults that follow from them (warm-up, GQA, ``--save``,
    ``--save-interval``). A shape flag given on the line takes what Megatron-LM derives from it
    (:func:`_derived_from_shape`), not the preset's. ``notes``: the warm-up cut."""
    name = values["model"] or DEFAULT_PRESET
    shape = preset_shape(name)
    defaults = {**preset_defaults(name), **_derived_from_shape(values)}
    if values["rope_scaling_factor"] is not None and not (
        values["use_rope_scaling"] or shape.rope_scaling
    ):
        raise ValueError(
            f"--rope-scaling-factor {values['rope_scaling_factor']} has no effect without --use-rope-scaling "
            f"(the {name} preset does not scale RoPE); add --use-rope-scaling"
        )
    filled = {
        "model": name,
        **{key: value for key, value in defaults.items() if values[key] is None},
    }
    resolved = {**values, **filled}
    notes = []
    if values["lr_warmup_iters"] is None:  # a short run keeps 10% warm-up rather than failing
        warmup = min(resolved["lr_warmup_iters"], resolved["train_iters"] // 10)
        if warmup != resolved["lr_warmup_iters"]:
            notes.append(
                f"--lr-warmup-iters {warmup}: the {name} preset's {resolved['lr_warmup_iters']}, "
                f"cut to 10% of --train-iters {resolved['train_iters']} (give --lr-warmup-iters to "
                "choose)"
            )
        filled["lr_warmup_iters"] = warmup
    if resolved["num_query_groups"] != resolved["num_attention_heads"]:
        filled["group_query_attention"] = True
    filled["save"] = _save_directory(values, name)
    if values["save_interval"] is None:
        filled["save_interval"] = resolved["train_iters"]
    return filled, notes


def _derived_from_shape(values: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron-LM's defaults of the shape flags that follow from a shape flag the line gives
    (its ``validate_args``): ``--num-query-groups`` = ``--num-attention-heads`` (1 with
    ``--group-query-attention``), ``--ffn-hidden-size`` = 4 x ``--hidden-size`` (SwiGLU: 2/3 of
    that, rounded down to a multiple of 64), ``--kv-channels`` = hidden / heads. A launch line
    that sets the heads means multi-head attention unless it says otherwise, not the preset's
    query groups."""
    derived = {}
    if values["num_attention_heads"] is not None:
        derived["num_query_groups"] = (
            1 if values["group_query_attention"] else values["num_attention_heads"]
        )
    if values["hidden_size"] is not None:
        swiglu = values["swiglu"]
        if swiglu is None:
            swiglu = preset_shape(values["model"] or DEFAULT_PRESET).gated
        four_h = 4 * values["hidden_size"]
        derived["ffn_hidden_size"] = int(four_h * 2 / 3 / 64) * 64 if swiglu else four_h
    if values["hidden_size"] is not None or values["num_attention_heads"] is not None:
        derived["kv_channels"] = None  # hidden / heads, megatron-core's own default
    return derived


def _save_directory(values: Mapping[str, Any], name: str) -> str:
    """``--save``, else the run in ``--load`` (a resume saves where it resumed from), else
    ``runs/<preset>``. Megatron-LM saves nothing without ``--save``; a resume that saved
    into ``runs/tiny`` instead would split one run over two directories. ``--finetune`` starts a
    new run from the checkpoint, which it must not write into: it needs its own ``--save``."""
    if values["save"]:
        return values["save"]
    if values["finetune"]:
        raise ValueError(
            f"--finetune starts a new run from the weights in --load {values['load']}: give it its "
            "own --save directory (without --save a run saves into --load, over the checkpoint it "
            "starts from)"
        )
    return values["load"] or os.path.join("runs", name)


def _position_notes(values: Mapping[str, Any], given_positions: Optional[int]) -> list[str]:
    """``--seq-length`` past ``--max-position-embeddings`` with RoPE: refused when the line gives
    both (Megatron-LM's ``validate_args`` asserts ``max_position_embeddings >= seq_length``
    whatever the position embedding); said once when the positions are the preset's or the
    checkpoint's (context extension: RoPE takes any position). Learned absolute positions are
    refused by :mod:`.config_checks` (a table of that many rows)."""
    seq, positions = values["seq_length"], values["max_position_embeddings"]
    if seq <= positions or values["position_embedding_type"] != "rope":
        return []
    if given_positions is not None:
        raise ValueError(
            f"--seq-length {seq} is above --max-position-embeddings {positions}: Megatron-LM refuses "
            f"this too; pass --max-position-embeddings {seq} (with RoPE it records the context the "
            "model is trained for)"
        )
    source = "checkpoint's" if values["use_checkpoint_args"] else f"{values['model']} preset's"
    return [
        f"--seq-length {seq} is past the {source} --max-position-embeddings {positions}: RoPE "
        "takes any position, and positions past it are new to the model unless RoPE is extended "
        "(--rotary-base, --use-rope-scaling, --rotary-seq-len-interpolation-factor); pass "
        f"--max-position-embeddings {seq} to record the longer context"
    ]
