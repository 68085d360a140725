"""Command-line flags of ``mcore-flash pretrain``, with Megatron-LM's names, and their checks.

Everything here is pure Python: flags are parsed and validated against the world size
before torch allocates anything, and each error names the flag to change.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from mcore_flash.data.datasets import parse_data_path
from mcore_flash.data.indexed import check_indexed_dataset
from mcore_flash.planning.hardware import HARDWARE_PROFILES, load_hardware
from mcore_flash.planning.models import MODELS
from mcore_flash.transformer.recompute import recompute_settings

DEFAULT_PRESET = "tiny"

# What a preset fills in when the flag was not given. "tiny" here is the default CPU job:
# small enough for a few hundred steps in minutes on 2 cores, deep enough (2 layers with
# 4 heads) to learn the built-in long-range copy task.
_TRAINING_PRESETS = {
    "tiny": dict(
        num_layers=2,
        hidden_size=128,
        ffn_hidden_size=352,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=256,
        max_position_embeddings=256,
        micro_batch_size=8,
        global_batch_size=8,
        train_iters=1000,
        lr=3e-3,
        min_lr=3e-4,
        lr_warmup_iters=30,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcore-flash pretrain",
        description="Pretrain a Llama-style GPT on megatron-core with the fused-attention spec.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument("--model", choices=sorted(MODELS), default=None, help=f"preset shape (default {DEFAULT_PRESET})")
    for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups"):
        model.add_argument(flag, type=int)
    model.add_argument("--group-query-attention", action="store_true")
    model.add_argument("--seq-length", type=int)
    model.add_argument("--max-position-embeddings", type=int)
    model.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"], help="(default rope)")
    model.add_argument("--rotary-base", type=int, help="RoPE base (raise it to extend the context: 'ABF')")
    model.add_argument("--use-rope-scaling", action="store_true", default=None,
                       help="Llama-3.1's RoPE frequency scaling (over 8192 original positions)")
    model.add_argument("--rope-scaling-factor", type=float, help="factor of --use-rope-scaling (Llama-3.1: 8)")
    model.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                       help="linear position interpolation: positions are divided by this factor")
    model.add_argument("--norm-epsilon", type=float, help="epsilon of RMSNorm/LayerNorm (default: the preset's)")
    model.add_argument("--normalization", choices=["RMSNorm", "LayerNorm"], help="(default RMSNorm)")
    model.add_argument("--swiglu", action="store_true", default=None)
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    model.add_argument("--disable-bias-linear", action="store_true", default=None)
    model.add_argument("--attention-dropout", type=float, default=0.0)
    model.add_argument("--hidden-dropout", type=float, default=0.0)
    model.add_argument("--attention-backend", choices=["npu", "cuda", "cpu", "reference"], default=None,
                       help="fused attention backend (default: by device)")  # fmt: skip
    model.add_argument("--window-size", type=_window_size, default=None, metavar="LEFT,RIGHT",
                       help="sliding-window attention: each token sees LEFT earlier and RIGHT later tokens "
                       "(-1 = unbounded; the right side is 0 under causal attention), e.g. 4095,0")  # fmt: skip
    model.add_argument("--window-attn-skip-freq", type=int, default=None,
                       help="every N-th layer uses full attention, the others the window (megatron's meaning)")

    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--context-parallel-size", type=int, default=1)
    par.add_argument("--cp-comm-type", choices=["p2p", "a2a"], default="p2p")
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--use-distributed-optimizer", action="store_true")
    par.add_argument("--overlap-grad-reduce", action="store_true")

    rec = p.add_argument_group("recompute")
    rec.add_argument("--recompute-granularity", choices=["full", "selective"])
    rec.add_argument("--recompute-method", choices=["uniform", "block"])
    rec.add_argument("--recompute-num-layers", type=int)
    rec.add_argument("--recompute-modules", nargs="*")

    opt = p.add_argument_group("precision, optimiser and schedule")
    opt.add_argument("--bf16", action="store_true")
    opt.add_argument("--fp16", action="store_true")
    opt.add_argument("--lr", type=float)
    opt.add_argument("--min-lr", type=float)
    opt.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    opt.add_argument("--lr-warmup-iters", type=int)
    opt.add_argument("--weight-decay", type=float, default=0.01)
    opt.add_argument("--clip-grad", type=float, default=1.0)
    opt.add_argument("--adam-beta1", type=float, default=0.9)
    opt.add_argument("--adam-beta2", type=float, default=0.95)
    opt.add_argument("--micro-batch-size", type=int)
    opt.add_argument("--global-batch-size", type=int)
    opt.add_argument("--train-iters", type=int)
    opt.add_argument("--seed", type=int, default=1234)

    data = p.add_argument_group("data")
    data.add_argument("--data-path", nargs="*", help="indexed-dataset prefixes (default: the built-in long-range task)")
    data.add_argument("--split", default="98,2,0")
    data.add_argument("--tokenizer-type", default=None)
    data.add_argument("--tokenizer-model", default=None)
    data.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                      help="pad the vocabulary to a multiple of this x TP (Megatron-LM's rule)")  # fmt: skip
    data.add_argument("--mock-data", action="store_true")
    data.add_argument("--reset-attention-mask", action="store_true",
                      help="document masking: no token attends across an EOD (packed THD batches, any CP size)")
    data.add_argument("--reset-position-ids", action="store_true", help="positions restart after every EOD")
    data.add_argument("--eod-mask-loss", action="store_true", help="no loss on EOD input tokens")
    data.add_argument("--data-cache-path", default=None)

    device = p.add_argument_group("device")
    device.add_argument("--emulate-npu", action="store_true",
                        help="rehearse the Ascend NPU code path on CPU processes: an emulated npu device, "
                             "HCCL-strict process groups and contract doubles of the torch_npu ops")  # fmt: skip

    ckpt = p.add_argument_group("checkpoints and logging")
    ckpt.add_argument("--save", default=None, help="checkpoint + metrics directory (default runs/<model>)")
    ckpt.add_argument("--load", default=None)
    ckpt.add_argument("--finetune", action="store_true",
                      help="load the weights only from --load and start at iteration 0 (no optimizer, scheduler or RNG "
                           "state): continued pretraining from a converted checkpoint")  # fmt: skip
    ckpt.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer and scheduler state")
    ckpt.add_argument("--no-load-rng", action="store_true", help="do not load the RNG states")
    ckpt.add_argument("--use-checkpoint-args", action="store_true",
                      help="take the model flags not given on the command line from the checkpoint in --load")  # fmt: skip
    ckpt.add_argument("--save-interval", type=int, default=None)
    ckpt.add_argument("--exit-interval", type=int, default=None, help="save and exit after iteration N (same schedule)")
    ckpt.add_argument("--log-interval", type=int, default=10)
    ckpt.add_argument("--tensorboard-dir", default=None)
    ckpt.add_argument("--hardware", default=None, metavar="NAME|FILE.json",
                      help=f"device profile ({', '.join(HARDWARE_PROFILES)} or a JSON file, as for `mcore-flash plan "
                           "--hardware`): adds MFU (model TFLOP/s per device / the profile's BF16 peak) to the log")  # fmt: skip
    ckpt.add_argument("--device-memory", default="64GB", help="per-device memory the --dry-run plan checks against")
    ckpt.add_argument("--dry-run", action="store_true",
                      help="validate flags and build one rank's model on the meta device (WORLD_SIZE from env)")  # fmt: skip
    return p


def parse_args(
    argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None, parser: Optional[argparse.ArgumentParser] = None
) -> argparse.Namespace:
    """Parse (with ``parser``, default :func:`build_parser`'s), fill preset defaults and
    validate against ``world_size`` (env WORLD_SIZE or 1)."""
    args = (parser or build_parser()).parse_args(argv)
    if args.use_checkpoint_args:
        apply_checkpoint_args(args)
    apply_preset(args)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", args.tensor_model_parallel_size
                                        * args.pipeline_model_parallel_size * args.context_parallel_size
                                        if args.dry_run else 1))  # fmt: skip
    args.world_size = world_size
    validate_args(args)
    return args


def apply_checkpoint_args(args: argparse.Namespace) -> None:
    """``--use-checkpoint-args``: every model flag left unset takes the checkpoint's value."""
    if not args.load:
        raise ValueError("--use-checkpoint-args needs --load")
    from mcore_flash.training.checkpointing import read_model_args

    saved = read_model_args(args.load)
    for name, value in saved.items():
        if name == "vocab_size" or (name == "rope_scaling_factor" and not saved["use_rope_scaling"]):
            continue  # the vocabulary comes from the tokenizer; a factor without scaling means nothing
        if getattr(args, name) is None:
            setattr(args, name, value)


def apply_preset(args: argparse.Namespace) -> None:
    """Fill every model/schedule flag the user left unset from ``--model`` (default tiny)."""
    args.model = args.model or DEFAULT_PRESET
    shape = MODELS[args.model]
    defaults = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        seq_length=4096,
        max_position_embeddings=shape.max_position_embeddings,
        rotary_base=shape.rotary_base,
        use_rope_scaling=shape.rope_scaling,
        rope_scaling_factor=shape.rope_scaling_factor,
        norm_epsilon=shape.norm_epsilon,
        swiglu=shape.gated,
        untie_embeddings_and_output_weights=shape.untie_embeddings_and_output_weights,
        disable_bias_linear=not shape.add_bias_linear,
        normalization=shape.normalization,
        position_embedding_type=shape.position_embedding_type,
        micro_batch_size=1,
        global_batch_size=None,
        train_iters=1000,
        lr=3e-4,
        min_lr=3e-5,
        lr_warmup_iters=100,
    )
    defaults.update(_TRAINING_PRESETS.get(args.model, {}))
    warmup_given = args.lr_warmup_iters is not None
    if args.rope_scaling_factor is not None and not (args.use_rope_scaling or shape.rope_scaling):
        raise ValueError(
            f"--rope-scaling-factor {args.rope_scaling_factor} has no effect without --use-rope-scaling "
            f"(the {args.model} preset does not scale RoPE); add --use-rope-scaling"
        )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not warmup_given:  # a short run keeps 10% warm-up rather than failing
        args.lr_warmup_iters = min(args.lr_warmup_iters, args.train_iters // 10)
    if args.num_query_groups != args.num_attention_heads:
        args.group_query_attention = True
    args.save = args.save or os.path.join("runs", args.model)
    if args.save_interval is None:
        args.save_interval = args.train_iters


def _window_size(text: str) -> tuple[int, int]:
    """argparse type of ``--window-size``: ``LEFT,RIGHT``, each -1 or >= 0."""
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (two integers, e.g. 4095,0), got {text!r}") from None
    if min(left, right) < -1:
        raise argparse.ArgumentTypeError(f"LEFT and RIGHT must be -1 (unbounded) or >= 0, got {text!r}")
    return left, right


def validate_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for settings that cannot work (before any allocation)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp), ("--micro-batch-size", args.micro_batch_size),
                        ("--train-iters", args.train_iters), ("--seq-length", args.seq_length),
                        ("--log-interval", args.log_interval), ("--save-interval", args.save_interval)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.world_size % (tp * pp * cp):
        raise ValueError(
            f"world size {args.world_size} is not divisible by --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size x --context-parallel-size = {tp} x {pp} x {cp}"
        )
    dp = args.world_size // (tp * pp * cp)
    args.data_parallel_size = dp
    if args.num_attention_heads % tp:
        raise ValueError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads {args.num_attention_heads}"
        )
    if args.num_query_groups >= tp and args.num_query_groups % tp:
        raise ValueError(f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}")
    if args.num_layers % pp:
        raise ValueError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if cp > 1 and args.seq_length % (2 * cp):
        raise ValueError(
            f"--seq-length {args.seq_length} must be divisible by 2 x --context-parallel-size = {2 * cp} "
            "(load-balanced causal context parallelism splits it into 2*cp chunks)"
        )
    if args.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.sequence_parallel and args.seq_length % (tp * cp):
        raise ValueError(f"--seq-length {args.seq_length} must be divisible by --tensor-model-parallel-size {tp} with --sequence-parallel")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp}"
        )
    if not 0 <= args.lr_warmup_iters < args.train_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --train-iters {args.train_iters})")
    if args.emulate_npu and args.dry_run:
        raise ValueError("--emulate-npu and --dry-run exclude each other: the dry run builds on the meta device")
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 exclude each other; pick one")
    rope_flags = [flag for flag, given in (("--use-rope-scaling", args.use_rope_scaling),
                  ("--rotary-seq-len-interpolation-factor", args.rotary_seq_len_interpolation_factor)) if given]  # fmt: skip
    if rope_flags and args.position_embedding_type != "rope":
        raise ValueError(f"{rope_flags[0]} needs --position-embedding-type rope")
    if len(rope_flags) == 2:
        raise ValueError(
            "--use-rope-scaling and --rotary-seq-len-interpolation-factor are two ways of extending RoPE; pick one"
        )
    if args.rope_scaling_factor <= 0:
        raise ValueError(f"--rope-scaling-factor must be > 0, got {args.rope_scaling_factor}")
    if args.rotary_seq_len_interpolation_factor is not None and args.rotary_seq_len_interpolation_factor < 1:
        raise ValueError(
            f"--rotary-seq-len-interpolation-factor must be >= 1, got {args.rotary_seq_len_interpolation_factor}"
        )
    if args.norm_epsilon <= 0:
        raise ValueError(f"--norm-epsilon must be > 0, got {args.norm_epsilon}")
    if args.max_position_embeddings < args.seq_length and args.position_embedding_type == "learned_absolute":
        raise ValueError("--max-position-embeddings must be >= --seq-length with learned_absolute positions")
    for flag in ("finetune", "no_load_optim", "no_load_rng"):
        if getattr(args, flag) and not args.load:
            raise ValueError(f"--{flag.replace('_', '-')} needs --load (the checkpoint to start from)")
    args.hardware = load_hardware(args.hardware) if args.hardware else None  # ValueError names --hardware
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path exclude each other; drop one")
    _check_document_flags(args)
    if args.window_attn_skip_freq is not None and (args.window_size is None or args.window_attn_skip_freq < 1):
        raise ValueError("--window-attn-skip-freq needs --window-size and a value >= 1")
    if args.data_path:
        prefixes, _ = parse_data_path(args.data_path)
        for prefix in prefixes:
            check_indexed_dataset(prefix, arg="--data-path", scan_tokens=0)
    args.recompute = recompute_settings(
        args.recompute_granularity, args.recompute_method, args.recompute_num_layers, args.recompute_modules
    )
    if args.recompute.config.get("recompute_granularity") == "full":
        per_stage = args.num_layers // pp
        if args.recompute_num_layers > per_stage:
            raise ValueError(
                f"--recompute-num-layers {args.recompute_num_layers} exceeds the {per_stage} layers per pipeline stage"
            )


def _check_document_flags(args) -> None:
    """RoPE positions come from the packed layout (megatron-core's THD RoPE restarts them per
    document), so with RoPE the two reset flags only make sense together."""
    if args.position_embedding_type != "rope" or args.reset_attention_mask == args.reset_position_ids:
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
