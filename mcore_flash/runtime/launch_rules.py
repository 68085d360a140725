"""What each value-dependent flag of a Megatron-LM or MindSpeed-LLM launch line does here.

Each rule of :data:`mcore_flash.runtime.launch_flags.LAUNCH_FLAGS` takes the flag's value and
the whole parsed line (``flags``: the namespace as a dict, our flags and theirs) and returns an
:class:`Outcome`: our flags to set (an alias), a note said once (unchanged, or what an alias
became), or a refusal (why, and the equivalent). The schedule rules follow Megatron-LM's
``validate_args`` and ``get_optimizer_param_scheduler`` (``megatron/training/arguments.py``,
``training.py``): samples become iterations of ``--global-batch-size``; the decay runs to
the end of training. Pure Python.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

# MindSpeed-LLM's --context-parallel-algo values built here, as our --cp-comm-type
CP_COMM_TYPES = {"megatron_cp_algo": "p2p", "ulysses_cp_algo": "a2a"}


class Outcome(NamedTuple):
    """What one flag of a launch line does here: ``updates`` to our flags, a ``note`` said once,
    or a ``refusal`` (the reason and the equivalent)."""

    updates: dict
    note: Optional[str] = None
    refusal: Optional[str] = None


def alias(updates: dict, means: str) -> Outcome:
    return Outcome(updates, means)


def unchanged(why: str) -> Outcome:
    return Outcome({}, why)


def refused(why: str) -> Outcome:
    return Outcome({}, refusal=why)


# megatron-core's defaults, what the model and the optimizer use here
MEGATRON_INIT_METHOD_STD = 0.02  # TransformerConfig's init_method_std
MEGATRON_ADAM_EPS = 1e-8  # OptimizerConfig's adam_eps
MEGATRON_INITIAL_LOSS_SCALE = 2.0**32  # OptimizerConfig's initial_loss_scale (fp16 only)


def schedule_iters(flags: Mapping[str, Any]) -> Optional[int]:
    """Iterations of the line's schedule: ``--train-iters``, or ``--train-samples`` over
    ``--global-batch-size`` (Megatron-LM's ``update_train_iters``); None when neither is given."""
    if flags.get("train_samples") is not None and flags.get("global_batch_size"):
        return flags["train_samples"] // flags["global_batch_size"]
    return flags.get("train_iters")


def needs_batch(flag: str, flags: Mapping[str, Any]) -> Optional[Outcome]:
    """The refusal of a sample-counted flag without ``--global-batch-size``, else None."""
    if flags.get("global_batch_size"):
        return None
    return refused(
        f"counts sequences; give --global-batch-size too (the sequences per iteration) so that it "
        f"becomes iterations ({flag} is Megatron-LM's sample-based schedule)"
    )


def train_samples(value: int, flags: Mapping[str, Any]) -> Outcome:
    if flags.get("train_iters") is not None:
        return refused(
            "--train-iters is given too; give one of them (Megatron-LM asserts the same)"
        )
    missing = needs_batch("--train-samples", flags)
    if missing:
        return missing
    batch = flags["global_batch_size"]
    iters = value // batch
    rest = (
        f", the last {value % batch} samples dropped as Megatron-LM does" if value % batch else ""
    )
    return alias(
        {"train_iters": iters},
        f"--train-iters {iters} ({value} samples / --global-batch-size {batch}{rest})",
    )


def lr_warmup_samples(value: int, flags: Mapping[str, Any]) -> Outcome:
    if flags.get("train_samples") is None:
        return refused(
            "belongs to a --train-samples schedule (Megatron-LM asserts the same): use "
            "--lr-warmup-iters with --train-iters"
        )
    if flags.get("lr_warmup_iters") is not None:
        return refused("--lr-warmup-iters is given too; give one of them")
    missing = needs_batch("--lr-warmup-samples", flags)
    if missing:
        return missing
    batch = flags["global_batch_size"]
    iters = round(value / batch)
    exact = "" if value % batch == 0 else f", rounded from {value / batch:.2f}"
    return alias(
        {"lr_warmup_iters": iters}, f"--lr-warmup-iters {iters} ({value} samples / {batch}{exact})"
    )


def lr_warmup_fraction(value: float, flags: Mapping[str, Any]) -> Outcome:
    if flags.get("lr_warmup_iters") is not None or flags.get("lr_warmup_samples") is not None:
        return refused(
            "a warm-up length is given too (--lr-warmup-iters / --lr-warmup-samples); give one of "
            "them (Megatron-LM asserts the same)"
        )
    if not 0 <= value < 1:
        return refused(f"must be in [0, 1) (a share of the decay), got {value}")
    iters = schedule_iters(flags)
    if iters is None:
        return refused(
            "is a share of the schedule: give --train-iters or --train-samples with "
            "--global-batch-size"
        )
    warmup = round(value * iters)
    exact = "" if value * iters == warmup else f", rounded from {value * iters:.2f}"
    return alias(
        {"lr_warmup_iters": warmup},
        f"--lr-warmup-iters {warmup} ({value} x {iters} iterations of decay{exact})",
    )


def decay_length(flag: str, counted: str, expected: str) -> Callable:
    """The rule of ``--lr-decay-iters`` / ``--lr-decay-samples``: the decay here runs to the
    end of training (``expected``: the line's ``--train-iters`` / ``--train-samples``)."""

    def rule(value: int, flags: Mapping[str, Any]) -> Outcome:
        end = flags.get(expected)
        if end is None:
            return refused(
                f"belongs to a --{expected.replace('_', '-')} schedule (Megatron-LM asserts the "
                f"same); give that, or drop {flag}"
            )
        if value == end:
            return unchanged(f"the decay runs over the {end} {counted} of training, as here")
        return refused(
            f"ends the decay at {value} {counted}, not at the end of training ({end}); the "
            f"decay here always runs to --{expected.replace('_', '-')} (a separate decay length "
            f"is not a flag here yet): drop {flag}"
        )

    return rule


def equal_or_refused(expected: float, why: str, refusal: str) -> Callable:
    """A rule: ``expected`` is what runs here anyway (unchanged), any other value refused."""

    def rule(value: float, flags: Mapping[str, Any]) -> Outcome:
        if value == expected:
            return unchanged(why)
        return refused(refusal.format(value=value, expected=expected))

    return rule


def init_method_std(value: float, flags: Mapping[str, Any]) -> Outcome:
    if value == MEGATRON_INIT_METHOD_STD:
        return unchanged("megatron-core's default std 0.02, which the weights are drawn with here")
    loaded = [flag for flag in ("finetune", "no_load_optim") if flags.get(flag)]
    if loaded:
        return unchanged(
            f"the weights come from the checkpoint in --load (--{loaded[0].replace('_', '-')}), "
            "so no weight is drawn"
        )
    return refused(
        f"weights drawn here use megatron-core's default std {MEGATRON_INIT_METHOD_STD} (the flag "
        "is not wired to the model yet); drop it, or start from a checkpoint (--load with "
        "--finetune or --no-load-optim)"
    )


def initial_loss_scale(value: float, flags: Mapping[str, Any]) -> Outcome:
    if not flags.get("fp16"):
        return unchanged("loss scaling applies to --fp16 only (megatron-core scales no bf16 loss)")
    if value == MEGATRON_INITIAL_LOSS_SCALE:
        return unchanged("megatron-core's default 2^32, which --fp16 starts from here")
    return refused(
        "--fp16 starts its dynamic loss scale at megatron-core's 2^32 here (not a flag yet): "
        "drop it, or train with --bf16"
    )


def vocab_size(value: int, flags: Mapping[str, Any]) -> Outcome:
    if flags.get("tokenizer_type") == "NullTokenizer":
        return refused(
            "the trainer's NullTokenizer takes no vocabulary size yet: preprocess and train with "
            "a tokenizer file (--tokenizer-type HuggingFaceTokenizer --tokenizer-model)"
        )
    return unchanged(
        "the vocabulary comes from the tokenizer (Megatron-LM reads it for NullTokenizer only)"
    )


def transformer_impl(value: str, flags: Mapping[str, Any]) -> Outcome:
    if value == "local":
        return unchanged("the flash spec is built from megatron-core's local modules")
    return refused(
        f"{value}: Transformer Engine is not used here (no Ascend build); the flash spec is "
        "megatron-core's local modules with fused attention and norms: drop it, or pass local"
    )


def distributed_backend(value: str, flags: Mapping[str, Any]) -> Outcome:
    if value in ("nccl", "hccl"):
        return unchanged(
            "the collective library follows the device: HCCL on an Ascend NPU, NCCL on a GPU, "
            "gloo on the CPU"
        )
    return refused(
        f"{value}: the collective library follows the device here (HCCL, NCCL or gloo on the "
        "CPU); drop it"
    )


def sparse_mode(value: int, flags: Mapping[str, Any]) -> Outcome:
    if value in (0, 2, 3):
        return unchanged(
            "causal attention: the fused kernel applies the causal mask itself and picks its own "
            "sparse mode"
        )
    return refused(
        f"mode {value} (a band or prefix mask of npu_fusion_attention) is not built here: drop it "
        "(causal), or use --window-size LEFT,0 for a sliding window"
    )


def rotary_percent(value: float, flags: Mapping[str, Any]) -> Outcome:
    if value == 1.0:
        return unchanged("every head dimension rotates, as here")
    return refused(
        f"{value}: partial rotary embeddings are not built here (every head dimension rotates): "
        "drop it"
    )


def num_layer_list(value: str, flags: Mapping[str, Any]) -> Outcome:
    try:
        counts = [int(item) for item in value.split(",")]
    except ValueError:
        return refused(f"{value!r}: expected comma-separated layer counts, e.g. 4,4,4,4")
    pp = flags.get("pipeline_model_parallel_size") or 1
    layers = flags.get("num_layers")
    if len(counts) != pp or (layers is not None and sum(counts) != layers):
        return refused(
            f"{value} must give one count per pipeline stage (--pipeline-model-parallel-size {pp}) "
            f"summing to --num-layers {layers}"
        )
    if len(set(counts)) == 1:
        return unchanged(f"{counts[0]} layers per stage, the even split that runs here")
    return refused(
        f"{value}: uneven pipeline stages are not built here (the stages split --num-layers "
        "evenly); drop it and choose a --pipeline-model-parallel-size that divides --num-layers"
    )


def rope_scaling_type(value: str, flags: Mapping[str, Any]) -> Outcome:
    if value == "llama3":
        return alias(
            {"use_rope_scaling": True},
            "--use-rope-scaling (Llama-3.1's frequency scaling, megatron-core's, factor "
            "--rope-scaling-factor)",
        )
    return refused(
        f"{value}: only Llama-3.1's scaling (llama3, our --use-rope-scaling) is built here; "
        "extend RoPE with --rotary-base or --rotary-seq-len-interpolation-factor otherwise"
    )


def use_rotary_position_embeddings(value: bool, flags: Mapping[str, Any]) -> Outcome:
    if flags.get("position_embedding_type") not in (None, "rope"):
        return refused(
            f"contradicts --position-embedding-type {flags['position_embedding_type']}: give one"
        )
    return alias({"position_embedding_type": "rope"}, "--position-embedding-type rope")


def recompute_activations(value: bool, flags: Mapping[str, Any]) -> Outcome:
    if flags.get("recompute_granularity") not in (None, "selective"):
        return refused(
            f"is selective recompute, and --recompute-granularity {flags['recompute_granularity']} "
            "is given too: give one"
        )
    return alias(
        {"recompute_granularity": "selective"},
        "--recompute-granularity selective (core_attn: the attention sub-block, as Megatron-LM)",
    )


def context_parallel_algo(value: str, flags: Mapping[str, Any]) -> Outcome:
    if value not in CP_COMM_TYPES:
        return refused(
            f"{value} is not built here: ring (megatron_cp_algo, our --cp-comm-type p2p) or "
            "Ulysses (ulysses_cp_algo, --cp-comm-type a2a)"
        )
    comm = CP_COMM_TYPES[value]
    if flags.get("cp_comm_type") not in (None, comm):
        return refused(f"contradicts --cp-comm-type {flags['cp_comm_type']}: give one")
    return alias({"cp_comm_type": comm}, f"--cp-comm-type {comm}")


def tokenizer_name_or_path(value: str, flags: Mapping[str, Any]) -> Outcome:
    if flags.get("tokenizer_type") != "PretrainedFromHF":
        return refused(
            "MindSpeed-LLM reads it with --tokenizer-type PretrainedFromHF only: add that, or "
            "give --tokenizer-model"
        )
    if flags.get("tokenizer_model") is not None:
        return refused("--tokenizer-model is given too; give one of them")
    return alias(
        {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": value},
        f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {value} (the tokenizer.json in "
        "that directory)",
    )
