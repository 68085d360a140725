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
import importlib.util
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping, Optional

from mcore_flash.data.datasets import parse_data_path
from mcore_flash.data.indexed import check_indexed_dataset
from mcore_flash.planning.hardware import HardwareProfile, load_hardware
from mcore_flash.planning.models import MODELS, ModelShape
from mcore_flash.transformer.recompute import RecomputeSettings, recompute_settings

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
    virtual_pipeline_model_parallel_size: Optional[int]
    num_layers_per_virtual_pipeline_stage: Optional[int]
    context_parallel_size: int
    cp_comm_type: str
    sequence_parallel: bool
    use_distributed_optimizer: bool  # True with --use-megatron-fsdp, which implies it
    overlap_grad_reduce: bool
    overlap_param_gather: bool  # the all-gather in the next forward (megatron's DDP hooks)
    grad_reduce_in_bf16: bool  # main gradients (and their reduction) in bf16 instead of fp32
    use_megatron_fsdp: bool  # ZeRO-3 by megatron-core's Megatron-FSDP (:mod:`.fsdp`)
    data_parallel_sharding_strategy: Optional[str]  # FSDP's; None without FSDP
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
    # derived
    world_size: int
    data_parallel_size: int  # world_size / (TP x PP x CP)
    num_micro_batches: int  # per iteration and data-parallel rank: global / (micro x DP)
    recompute: RecomputeSettings

    def to_dict(self) -> dict[str, Any]:
        """``{field: value}``, the values themselves (``dataclasses.asdict`` would turn the
        hardware profile and recompute settings into dicts)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


DERIVED = ("world_size", "data_parallel_size", "num_micro_batches", "recompute")
# The flags a TrainingConfig holds: every field but the derived ones.
FLAG_NAMES = tuple(
    field.name for field in dataclasses.fields(TrainingConfig) if field.name not in DERIVED
)


def resolve_config(flags: Mapping[str, Any], world_size: Optional[int] = None) -> TrainingConfig:
    """The config of the parsed ``flags`` (``vars`` of the pretrain parser's namespace; other
    keys are ignored) for ``world_size`` ranks (default: env WORLD_SIZE, else 1, or TP x PP x CP
    for ``--dry-run``). Raises ValueError naming the flag for settings that cannot work."""
    values = {name: flags[name] for name in FLAG_NAMES}
    for name in ("data_path", "recompute_modules"):  # argparse's lists, frozen as the rest
        if values[name] is not None:
            values[name] = tuple(values[name])
    if values["use_checkpoint_args"]:
        values.update(_checkpoint_model_flags(values))
    values.update(_preset_values(values))
    if world_size is None:
        model_parallel = (
            values["tensor_model_parallel_size"] * values["pipeline_model_parallel_size"]
        )
        model_parallel *= values["context_parallel_size"]
        world_size = int(os.environ.get("WORLD_SIZE", model_parallel if values["dry_run"] else 1))
    values.update(_checked_and_derived(SimpleNamespace(**values), world_size))
    return TrainingConfig(**values)


def preset_shape(name: str) -> ModelShape:
    """The model shape of ``--model name``: the planner's preset of that name."""
    return MODELS[name]


def _checkpoint_model_flags(values: Mapping[str, Any]) -> dict[str, Any]:
    """``--use-checkpoint-args``: the checkpoint's value of every model flag left unset."""
    if not values["load"]:
        raise ValueError("--use-checkpoint-args needs --load")
    from mcore_flash.training.checkpointing import read_model_args

    saved = read_model_args(values["load"])
    filled = {}
    for name, value in saved.items():
        if name == "vocab_size" or (
            name == "rope_scaling_factor" and not saved["use_rope_scaling"]
        ):
            continue  # the vocabulary comes from the tokenizer; a factor without scaling means nothing
        if values[name] is None:
            filled[name] = value
    return filled


def _preset_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values ``--model`` (default tiny) gives the model/schedule flags left unset, and the
    defaults that follow from them (warm-up, GQA, ``--save``, ``--save-interval``)."""
    name = values["model"] or DEFAULT_PRESET
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
    if values["lr_warmup_iters"] is None:  # a short run keeps 10% warm-up rather than failing
        filled["lr_warmup_iters"] = min(resolved["lr_warmup_iters"], resolved["train_iters"] // 10)
    if resolved["num_query_groups"] != resolved["num_attention_heads"]:
        filled["group_query_attention"] = True
    filled["save"] = values["save"] or os.path.join("runs", name)
    if values["save_interval"] is None:
        filled["save_interval"] = resolved["train_iters"]
    return filled


def _checked_and_derived(args: SimpleNamespace, world_size: int) -> dict[str, Any]:
    """Raise ValueError naming the flag for settings that cannot work (before any allocation);
    returns the derived values and the flags resolved on the way (batch size, hardware)."""
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    at_least_one = {
        "--tensor-model-parallel-size": tp,
        "--pipeline-model-parallel-size": pp,
        "--context-parallel-size": cp,
        "--micro-batch-size": args.micro_batch_size,
        "--train-iters": args.train_iters,
        "--seq-length": args.seq_length,
        "--log-interval": args.log_interval,
        "--save-interval": args.save_interval,
    }
    for flag, value in at_least_one.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise ValueError(
            f"--exit-duration-in-mins must be a positive number of minutes, got {args.exit_duration_in_mins}"
        )
    if not 0 < args.distributed_timeout_minutes < float("inf"):
        raise ValueError(
            "--distributed-timeout-minutes must be a positive number of minutes (fractions "
            f"allowed: 0.5 = 30 s), got {args.distributed_timeout_minutes}"
        )
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size x --context-parallel-size = {tp} x {pp} x {cp}"
        )
    dp = world_size // (tp * pp * cp)
    _check_model_layout(args, tp, pp, cp)
    global_batch_size = (
        args.micro_batch_size * dp if args.global_batch_size is None else args.global_batch_size
    )
    if global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(
            f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp}"
        )
    if not 0 <= args.lr_warmup_iters < args.train_iters:
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --train-iters {args.train_iters})"
        )
    if not 0 <= args.min_lr <= args.lr:
        raise ValueError(
            f"--min-lr {args.min_lr:g} must be in [0, --lr {args.lr:g}]: the decay ends there; "
            "lower --min-lr (0 with --lr 0)"
        )
    if args.emulate_npu and args.dry_run:
        raise ValueError(
            "--emulate-npu and --dry-run exclude each other: the dry run builds on the meta device"
        )
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 exclude each other; pick one")
    _check_positions(args)
    for flag in ("finetune", "no_load_optim", "no_load_rng"):
        if getattr(args, flag) and not args.load:
            raise ValueError(
                f"--{flag.replace('_', '-')} needs --load (the checkpoint to start from)"
            )
    hardware = (
        load_hardware(args.hardware) if args.hardware else None
    )  # ValueError names --hardware
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path exclude each other; drop one")
    _check_document_flags(args)
    key_depth = _synthetic_key_depth(args)
    _check_validation(args)
    if args.window_attn_skip_freq is not None and (
        args.window_size is None or args.window_attn_skip_freq < 1
    ):
        raise ValueError("--window-attn-skip-freq needs --window-size and a value >= 1")
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ValueError(
            "--grad-reduce-in-bf16 keeps the main gradients in the bf16 of the parameters: add --bf16"
        )
    sharding = _check_sharding(args, dp * cp)
    _check_optimizer_offload(args)
    _check_moment_dtypes(args)
    _check_overlap_param_gather(args)
    if args.data_path:
        prefixes, _ = parse_data_path(args.data_path)
        for prefix in prefixes:
            check_indexed_dataset(prefix, arg="--data-path", scan_tokens=0)
    vp = _virtual_pipeline_size(args, pp, global_batch_size // (args.micro_batch_size * dp))
    recompute = _recompute(args, pp * (vp or 1))
    _check_activation_offload(args, pp)
    return dict(
        virtual_pipeline_model_parallel_size=vp,
        world_size=world_size,
        data_parallel_size=dp,
        global_batch_size=global_batch_size,
        num_micro_batches=global_batch_size // (args.micro_batch_size * dp),
        hardware=hardware,
        recompute=recompute,
        synthetic_key_depth=key_depth,
        **sharding,
    )


def _recompute(args: SimpleNamespace, chunks: int) -> RecomputeSettings:
    """What the ``--recompute-*`` flags mean; full recompute of at most the layers of one of the
    ``chunks`` (pipeline stages x virtual stages) megatron's block recomputes within."""
    recompute = recompute_settings(
        args.recompute_granularity,
        args.recompute_method,
        args.recompute_num_layers,
        args.recompute_modules,
    )
    if recompute.config.get("recompute_granularity") == "full":
        per_chunk = args.num_layers // chunks
        if args.recompute_num_layers > per_chunk:
            where = (
                "virtual pipeline stage"
                if args.virtual_pipeline_model_parallel_size
                else "pipeline stage"
            )
            raise ValueError(
                f"--recompute-num-layers {args.recompute_num_layers} exceeds the {per_chunk} layers per {where}"
            )
    return recompute


def _virtual_pipeline_size(args: SimpleNamespace, pp: int, micro_batches: int) -> Optional[int]:
    """Model chunks per pipeline rank of the interleaved schedule, from Megatron-LM's
    ``--virtual-pipeline-model-parallel-size V`` or ``--num-layers-per-virtual-pipeline-stage
    N`` (V = layers per stage / N); None (plain 1F1B) for neither or V = 1.

    megatron-core's interleaved schedule runs the micro-batches in groups of PP per chunk
    (``microbatch_group_size_per_vp_stage``): the micro-batches per iteration must be a
    multiple of PP. Offloads and Megatron-FSDP are not validated with it (refused)."""
    size, per_stage = (
        args.virtual_pipeline_model_parallel_size,
        args.num_layers_per_virtual_pipeline_stage,
    )
    if size is not None and per_stage is not None:
        raise ValueError(
            "--virtual-pipeline-model-parallel-size and --num-layers-per-virtual-pipeline-stage exclude "
            "each other (as in Megatron-LM); give one"
        )
    if size is None and per_stage is None:
        return None
    flag = (
        "--virtual-pipeline-model-parallel-size"
        if size is not None
        else "--num-layers-per-virtual-pipeline-stage"
    )
    value = size if size is not None else per_stage
    stage_layers = args.num_layers // pp
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")
    if pp == 1:
        raise ValueError(
            f"{flag} interleaves pipeline stages: it needs --pipeline-model-parallel-size > 1"
        )
    if stage_layers % value:
        raise ValueError(
            f"{flag} {value} does not divide the {stage_layers} layers per pipeline stage "
            f"(--num-layers {args.num_layers} / --pipeline-model-parallel-size {pp})"
        )
    vp = size if size is not None else stage_layers // per_stage
    if vp == 1:
        return None
    if micro_batches % pp:
        raise ValueError(
            f"{flag}: the interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size "
            f"{pp}, and this run has {micro_batches} per iteration (--global-batch-size / (--micro-batch-size x "
            f"data-parallel size)); raise --global-batch-size to a multiple of {pp} micro-batches"
        )
    for name, on in (
        ("--optimizer-cpu-offload", args.optimizer_cpu_offload),
        ("--activation-offload-layers", args.activation_offload_layers),
    ):
        if on:
            raise ValueError(
                f"{flag} with {name} is not validated here (the offloads are tested with one model chunk "
                "per rank); drop one of them"
            )
    return vp


def _synthetic_key_depth(args: SimpleNamespace) -> Optional[str]:
    """``--synthetic-key-depth``: the built-in task's key placement ("fixed" unless given), None
    with other data, where the flag would do nothing (refused)."""
    if args.data_path or args.mock_data:
        if args.synthetic_key_depth is not None:
            source = "--data-path" if args.data_path else "--mock-data"
            raise ValueError(
                f"--synthetic-key-depth places the key of the built-in task, which {source} replaces; "
                f"drop one of them"
            )
        return None
    return args.synthetic_key_depth or "fixed"


def _check_validation(args: SimpleNamespace) -> None:
    """``--eval-interval``: at least 1, on data with a validation split (the built-in task
    has none; ``--mock-data`` has one, megatron's split 1,1,1)."""
    if args.eval_interval is None:
        return
    if args.eval_interval < 1 or args.eval_iters < 1:
        raise ValueError(
            f"--eval-interval {args.eval_interval} and --eval-iters {args.eval_iters} must be >= 1"
        )
    if not (args.data_path or args.mock_data):
        raise ValueError(
            "--eval-interval needs a validation set: the built-in task has none; give --data-path "
            "with a --split whose second weight is above 0 (e.g. 98,2,0), or --mock-data"
        )
    weights = args.split.replace("/", ",").split(",")
    if args.data_path and (len(weights) < 2 or float(weights[1]) <= 0):
        raise ValueError(
            f"--eval-interval needs a validation split: --split {args.split} gives it no "
            "documents; e.g. --split 98,2,0"
        )


def _check_overlap_param_gather(args: SimpleNamespace) -> None:
    """``--overlap-param-gather``: Megatron-LM's conditions (the distributed optimizer and
    ``--overlap-grad-reduce``); Megatron-FSDP and the offloaded optimizer gather their own way."""
    if not args.overlap_param_gather:
        return
    if args.use_megatron_fsdp:
        raise ValueError(
            "--overlap-param-gather is for --use-distributed-optimizer: Megatron-FSDP gathers "
            "parameters in the forward pass already (optim_grads_params); drop the flag"
        )
    if not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        raise ValueError(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce "
            "(as in Megatron-LM); add them or drop the flag"
        )
    if args.optimizer_cpu_offload:
        raise ValueError(
            "--overlap-param-gather with --optimizer-cpu-offload is not validated here (the "
            "host optimizer copies the parameters back itself); drop one of them"
        )


def _check_activation_offload(args: SimpleNamespace, pp: int) -> None:
    """``--activation-offload-layers N``: 0..layers per stage; one layer per checkpoint; not with
    Megatron-FSDP (its unsharded weights are gathered buffers, not yet told apart: untested)."""
    n = args.activation_offload_layers
    per_stage = args.num_layers // pp
    if not 0 <= n <= per_stage:
        raise ValueError(
            f"--activation-offload-layers {n}: choose 0..{per_stage} (the layers per pipeline stage)"
        )
    if not n:
        return
    if args.recompute_method == "uniform" and (args.recompute_num_layers or 1) > 1:
        raise ValueError(
            "--activation-offload-layers with --recompute-method uniform needs --recompute-num-layers 1 "
            "(a checkpoint of several layers keeps one input for all; offload parks it per layer)"
        )
    if args.use_megatron_fsdp:
        raise ValueError(
            "--activation-offload-layers and --use-megatron-fsdp exclude each other (not validated: "
            "FSDP's gathered weights must not be parked); drop one"
        )


def _check_model_layout(args: SimpleNamespace, tp: int, pp: int, cp: int) -> None:
    """The heads, layers and sequence split evenly over the TP/PP/CP ranks."""
    if args.num_attention_heads % tp:
        raise ValueError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if args.kv_channels is not None and args.kv_channels < 1:
        raise ValueError(f"--kv-channels must be >= 1, got {args.kv_channels}")
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads {args.num_attention_heads}"
        )
    if args.num_query_groups >= tp and args.num_query_groups % tp:
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}"
        )
    if args.num_layers % pp:
        raise ValueError(
            f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}"
        )
    if cp > 1 and args.seq_length % (2 * cp):
        raise ValueError(
            f"--seq-length {args.seq_length} must be divisible by 2 x --context-parallel-size = {2 * cp} "
            "(load-balanced causal context parallelism splits it into 2*cp chunks)"
        )
    if args.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.sequence_parallel and args.seq_length % (tp * cp):
        raise ValueError(
            f"--seq-length {args.seq_length} must be divisible by --tensor-model-parallel-size {tp} with --sequence-parallel"
        )


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DEFAULT_SHARDING_STRATEGY = "optim_grads_params"  # ZeRO-3, Megatron-LM's recommended one
CKPT_FORMATS = ("torch_dist", "fsdp_dtensor")


def _check_sharding(args: SimpleNamespace, dp_cp: int) -> dict[str, Any]:
    """``--use-megatron-fsdp`` and the flags that go with it; returns the resolved strategy,
    checkpoint format and optimizer choice.

    Megatron-FSDP shards over the data x context parallel ranks and implies the distributed
    optimizer (megatron-core 0.19 forces it; Megatron-LM requires ``--use-distributed-optimizer``
    with it). Its optimizer state saves only as ``fsdp_dtensor`` (megatron-core's
    ``optimizer/distrib_optimizer.py: sharded_state_dict``), ``torch_dist`` only without it.
    """
    fsdp = args.use_megatron_fsdp
    strategy = args.data_parallel_sharding_strategy
    if strategy is not None and not fsdp:
        raise ValueError(
            f"--data-parallel-sharding-strategy {strategy} is Megatron-FSDP's: add --use-megatron-fsdp "
            "(without it --use-distributed-optimizer shards the optimizer state)"
        )
    ckpt_format = args.ckpt_format or ("fsdp_dtensor" if fsdp else "torch_dist")
    if fsdp and ckpt_format != "fsdp_dtensor":
        raise ValueError(
            "--use-megatron-fsdp saves its sharded parameters and optimizer state as --ckpt-format "
            f"fsdp_dtensor (megatron-core refuses {ckpt_format} for them): pass --ckpt-format fsdp_dtensor"
        )
    if not fsdp and ckpt_format != "torch_dist":
        raise ValueError(
            f"--ckpt-format {ckpt_format} holds Megatron-FSDP's sharded state: add --use-megatron-fsdp, "
            "or use --ckpt-format torch_dist"
        )
    if args.async_save and ckpt_format != "torch_dist":
        raise ValueError(
            f"--async-save writes --ckpt-format torch_dist checkpoints in the background (as Megatron-LM); "
            f"{ckpt_format} (--use-megatron-fsdp) saves synchronously here: drop --async-save"
        )
    if not fsdp:
        return dict(ckpt_format=ckpt_format)
    strategy = strategy or DEFAULT_SHARDING_STRATEGY
    if args.fp16:
        raise ValueError(
            "--use-megatron-fsdp with --fp16 is not supported here (its loss scaling of sharded "
            "gradients is untested); train with --bf16"
        )
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(
            "--use-megatron-fsdp with --pipeline-model-parallel-size > 1 is not supported here: shard with "
            "Megatron-FSDP over data x context parallel ranks at --pipeline-model-parallel-size 1, or "
            "pipeline with --use-distributed-optimizer"
        )
    from mcore_flash.training.fsdp import upstream_defect

    defect = upstream_defect(strategy, dp_cp)
    if defect:
        raise ValueError(defect)
    return dict(
        ckpt_format=ckpt_format,
        data_parallel_sharding_strategy=strategy,
        use_distributed_optimizer=True,
    )


def _check_optimizer_offload(args: SimpleNamespace) -> None:
    """``--optimizer-cpu-offload`` (megatron-core's ``HybridDeviceOptimizer``) and its flags.

    It steps the optimizer state of a fraction of the parameters on the host. megatron-core
    builds it only for the distributed optimizer with precision-aware state (Megatron-LM's
    recipe: the three flags together), and its copy of fp32 parameters fails ("can't optimize
    a non-leaf Tensor", ``optimizer/distrib_optimizer.py``), so the parameters are bf16; with
    Megatron-FSDP it fails pinning a DTensor (``cpu_offloading/hybrid_optimizer.py``). Whether
    the device has a host to offload to is checked once the device is known
    (:mod:`mcore_flash.training.offload`).
    """
    offload_flags = {
        "--optimizer-offload-fraction": args.optimizer_offload_fraction != 1.0,
        "--overlap-cpu-optimizer-d2h-h2d": args.overlap_cpu_optimizer_d2h_h2d,
    }
    for flag, given in offload_flags.items():
        if given and not args.optimizer_cpu_offload:
            raise ValueError(
                f"{flag} sets how --optimizer-cpu-offload works: add --optimizer-cpu-offload"
            )
    if not 0.0 <= args.optimizer_offload_fraction <= 1.0:
        raise ValueError(
            f"--optimizer-offload-fraction must be in [0, 1] (the share of the optimizer state on the host), "
            f"got {args.optimizer_offload_fraction}"
        )
    distributed = args.use_distributed_optimizer or args.use_megatron_fsdp  # FSDP implies it
    if args.use_precision_aware_optimizer and not distributed:
        raise ValueError("--use-precision-aware-optimizer needs --use-distributed-optimizer")
    if (
        args.use_precision_aware_optimizer
        and not args.optimizer_cpu_offload
        and importlib.util.find_spec("transformer_engine") is None
    ):
        raise ValueError(
            "--use-precision-aware-optimizer on the device steps with Transformer Engine's FusedAdam, "
            "which is not installed (megatron-core's optimizer/optimizer_config.py): use it with "
            "--optimizer-cpu-offload, or drop it"
        )
    if not args.optimizer_cpu_offload:
        return
    needed = {
        "--use-distributed-optimizer": distributed,
        "--use-precision-aware-optimizer": args.use_precision_aware_optimizer,
        "--bf16": args.bf16,
    }
    for flag, given in needed.items():
        if not given:
            raise ValueError(
                f"--optimizer-cpu-offload needs {flag} (megatron-core offloads the distributed optimizer's "
                "precision-aware state of bf16 parameters: --use-distributed-optimizer "
                "--use-precision-aware-optimizer --bf16)"
            )
    if args.use_megatron_fsdp:
        raise ValueError(
            "--optimizer-cpu-offload with --use-megatron-fsdp fails in megatron-core (HybridDeviceOptimizer "
            "pins DTensor parameters, which torch cannot): offload with --use-distributed-optimizer only"
        )


def _check_moment_dtypes(args: SimpleNamespace) -> None:
    """``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` bf16: Adam's moments stored narrower. Only the
    offloaded optimizer's host step (:mod:`mcore_flash.training.host_adam`) has such a step here
    (megatron-core passes the dtypes to Transformer Engine's FusedAdam alone), so all the state
    must be on the host: ``--optimizer-cpu-offload`` at fraction 1."""
    narrow = [
        f"{flag} {dtype}"
        for flag, dtype in (
            ("--exp-avg-dtype", args.exp_avg_dtype),
            ("--exp-avg-sq-dtype", args.exp_avg_sq_dtype),
        )
        if dtype != "fp32"
    ]
    if not narrow:
        return
    if not args.optimizer_cpu_offload:
        raise ValueError(
            f"{narrow[0]} is stepped by the host optimizer only (the device's Adam without Transformer "
            "Engine keeps fp32 moments): add --optimizer-cpu-offload --use-precision-aware-optimizer "
            "--use-distributed-optimizer --bf16, or drop the flag"
        )
    if args.optimizer_offload_fraction != 1.0:
        raise ValueError(
            f"{narrow[0]} with --optimizer-offload-fraction {args.optimizer_offload_fraction}: the part "
            "kept on the device would step with fp32 moments; offload it all (--optimizer-offload-fraction "
            "1) or drop the flag"
        )


def _check_positions(args: SimpleNamespace) -> None:
    """RoPE extension flags, epsilon and the learned position table."""
    extensions = {
        "--use-rope-scaling": args.use_rope_scaling,
        "--rotary-seq-len-interpolation-factor": args.rotary_seq_len_interpolation_factor,
    }
    rope_flags = [flag for flag, given in extensions.items() if given]
    if rope_flags and args.position_embedding_type != "rope":
        raise ValueError(f"{rope_flags[0]} needs --position-embedding-type rope")
    if len(rope_flags) == 2:
        raise ValueError(
            "--use-rope-scaling and --rotary-seq-len-interpolation-factor are two ways of extending RoPE; pick one"
        )
    if args.rope_scaling_factor <= 0:
        raise ValueError(f"--rope-scaling-factor must be > 0, got {args.rope_scaling_factor}")
    if (
        args.rotary_seq_len_interpolation_factor is not None
        and args.rotary_seq_len_interpolation_factor < 1
    ):
        raise ValueError(
            f"--rotary-seq-len-interpolation-factor must be >= 1, got {args.rotary_seq_len_interpolation_factor}"
        )
    if args.norm_epsilon <= 0:
        raise ValueError(f"--norm-epsilon must be > 0, got {args.norm_epsilon}")
    if (
        args.max_position_embeddings < args.seq_length
        and args.position_embedding_type == "learned_absolute"
    ):
        raise ValueError(
            "--max-position-embeddings must be >= --seq-length with learned_absolute positions"
        )


def _check_document_flags(args: SimpleNamespace) -> None:
    """RoPE positions come from the packed layout (megatron-core's THD RoPE restarts them per
    document), so with RoPE the two reset flags only make sense together."""
    if (
        args.position_embedding_type != "rope"
        or args.reset_attention_mask == args.reset_position_ids
    ):
        return
    if args.reset_attention_mask:
        raise ValueError(
            "--reset-attention-mask with RoPE restarts positions at every document (megatron-core's THD "
            "RoPE): pass --reset-position-ids too"
        )
    raise ValueError(
        "--reset-position-ids with RoPE needs --reset-attention-mask (RoPE positions restart per document "
        "only in packed batches); add it, or drop --reset-position-ids"
    )
