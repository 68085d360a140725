"""Command-line flags of ``mcore-flash pretrain``, with Megatron-LM's names.

The edge of the trainer: :func:`parse_config` turns ``argv`` into the frozen, checked
:class:`~mcore_flash.runtime.config.TrainingConfig` (presets and checks live in
:mod:`mcore_flash.runtime.config`). Everything here is pure Python: flags are parsed and
validated against the world size before torch allocates anything, and each error names
the flag to change. A Megatron-LM or MindSpeed-LLM launch line is taken as written: their
flags that are not ours are registered and resolved by :mod:`mcore_flash.runtime.launch_flags`;
an unknown flag gets "did you mean" from both vocabularies, never argparse's usage dump.
``--help`` shows every flag's default (a preset's as the ``tiny`` preset's value).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any, Mapping, Optional, Sequence

from mcore_flash.data.synthetic import KEY_DEPTHS
from mcore_flash.planning.hardware import HARDWARE_PROFILES
from mcore_flash.planning.models import MODELS
from mcore_flash.planning.parallel_layout import HOST_MOMENT_BYTES
from mcore_flash.runtime.config import (
    DEFAULT_PRESET,
    TRAINING_DEFAULTS,
    TrainingConfig,
    preset_defaults,
    resolve_config,
)
from mcore_flash.runtime.config_checks import (
    CKPT_FORMATS,
    DEFAULT_SHARDING_STRATEGY,
    SHARDING_STRATEGIES,
)
from mcore_flash.runtime.launch_flags import LaunchFlagsRefused, add_launch_flags
from mcore_flash.runtime.launch_semantics import ATTENTION_BACKENDS


class _DefaultsOnceFormatter(argparse.HelpFormatter):
    """argparse's ``ArgumentDefaultsHelpFormatter``, but a flag's default is shown once: not
    when its help already says it ("(default tiny)", "default: the preset's") or when there
    is none to show (``None``: the help says who decides; ``False``: a switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text  # ``is``: a default of 0 or 0.0 is shown (``0.0 == False``)
        return text + " (default: %(default)s)"


class FlagParser(argparse.ArgumentParser):
    """argparse without its usage dump: an error is one ``prog: error:`` message (exit code 2,
    as argparse), and an unknown flag gets "did you mean" among every flag the parser knows:
    ours and the Megatron-LM / MindSpeed-LLM flags of :mod:`.launch_flags`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the flags)\n")

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(self._unknown(unknown))
        return parsed

    def _unknown(self, tokens: Sequence[str]) -> str:
        """One line per unknown flag in ``tokens`` (argparse's leftovers), with its near names."""
        flags = [token.split("=", 1)[0] for token in tokens if token.startswith("-")]
        if not flags:
            return f"unexpected argument(s): {' '.join(tokens)}"
        known = list(self._option_string_actions)
        lines = []
        for flag in flags:
            started = [name for name in known if name.startswith(flag)]  # an abbreviation
            near = (started + difflib.get_close_matches(flag, known, n=3, cutoff=0.6))[:3]
            hint = (
                f"did you mean {' or '.join(near)}?"
                if near
                else "neither a flag of this trainer nor a Megatron-LM / MindSpeed-LLM flag it "
                "maps (docs/launch-scripts.md)"
            )
            lines.append(f"unknown flag {flag}: {hint}")
        return "\n".join(lines)


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _preset(dest: str, rule: str = "", after: str = "") -> str:
    """The ``(default: ...)`` of a flag the ``--model`` preset fills: the default preset's value
    and, for a schedule flag, the other presets' (``TRAINING_DEFAULTS``); ``rule``: how the
    default follows from another flag first; ``after``: what limits it."""
    tiny = preset_defaults(DEFAULT_PRESET)[dest]
    text = f"the --model preset's, {DEFAULT_PRESET}: {_shown(tiny)}"
    others = TRAINING_DEFAULTS.get(dest, tiny)
    if others != tiny:
        shown = "--micro-batch-size x data-parallel size" if others is None else _shown(others)
        text += f", the others: {shown}"
    return f"(default: {rule}{text}{after})".replace("%", "%%")


def build_parser() -> FlagParser:
    p = FlagParser(
        prog="mcore-flash pretrain",
        description="Pretrain a Llama-style GPT on megatron-core with the fused-attention spec. "
        "Takes Megatron-LM's and MindSpeed-LLM's GPT launch lines (docs/launch-scripts.md).",
        formatter_class=_DefaultsOnceFormatter,
        allow_abbrev=False,  # as Megatron-LM's: a foreign flag never matches a prefix of ours
    )
    _add_model_flags(p.add_argument_group("model"))
    _add_attention_flags(p.add_argument_group("attention"))
    _add_parallel_flags(p.add_argument_group("parallelism"))
    _add_recompute_flags(p.add_argument_group("recompute and sequence tiling"))
    _add_schedule_flags(p.add_argument_group("precision, optimiser and schedule"))
    _add_data_flags(p.add_argument_group("data"))
    _add_checkpoint_flags(p.add_argument_group("checkpoints, logging and device"))
    add_launch_flags(p)
    return p


def _add_model_flags(model) -> None:
    model.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help=f"preset shape and schedule: every flag below marked 'the --model preset's' takes "
        f"its value unless given (default {DEFAULT_PRESET})",
    )
    model.add_argument("--num-layers", type=int, help=_preset("num_layers"))
    model.add_argument("--hidden-size", type=int, help=_preset("hidden_size"))
    model.add_argument(
        "--ffn-hidden-size",
        type=int,
        help=_preset(
            "ffn_hidden_size",
            "with --hidden-size given, Megatron-LM's 4 x hidden (2/3 of it with --swiglu, "
            "rounded down to a multiple of 64); else ",
        ),
    )
    model.add_argument("--num-attention-heads", type=int, help=_preset("num_attention_heads"))
    model.add_argument(
        "--num-query-groups",
        type=int,
        help=_preset(
            "num_query_groups",
            "with --num-attention-heads given, the heads (1 with --group-query-attention), "
            "Megatron-LM's; else ",
        ),
    )
    model.add_argument(
        "--group-query-attention",
        action="store_true",
        help="grouped-query attention: on by itself when --num-query-groups differs from the "
        "heads; with --num-attention-heads but no --num-query-groups, 1 group (Megatron-LM's)",
    )
    model.add_argument("--seq-length", type=int, help="tokens per sample " + _preset("seq_length"))
    model.add_argument(
        "--max-position-embeddings",
        type=int,
        help="positions the model is for; at least --seq-length when given "
        + _preset("max_position_embeddings"),
    )
    model.add_argument(
        "--position-embedding-type",
        choices=["rope", "learned_absolute"],
        help=_preset("position_embedding_type"),
    )
    model.add_argument(
        "--rotary-base",
        type=int,
        help="RoPE base (raise it to extend the context: 'ABF') " + _preset("rotary_base"),
    )
    model.add_argument(
        "--use-rope-scaling",
        action="store_true",
        default=None,
        help="Llama-3.1's RoPE frequency scaling (over 8192 original positions) "
        + _preset("use_rope_scaling"),
    )
    model.add_argument(
        "--rope-scaling-factor",
        type=float,
        help="factor of --use-rope-scaling (Llama-3.1: 8) " + _preset("rope_scaling_factor"),
    )
    model.add_argument(
        "--rotary-seq-len-interpolation-factor",
        type=int,
        default=None,
        help="linear position interpolation: positions are divided by this factor (default: none)",
    )
    model.add_argument(
        "--norm-epsilon", type=float, help="epsilon of RMSNorm/LayerNorm " + _preset("norm_epsilon")
    )
    model.add_argument(
        "--normalization", choices=["RMSNorm", "LayerNorm"], help=_preset("normalization")
    )
    for flag, dest, text in (
        ("--swiglu", "swiglu", "gated SiLU MLP"),
        (
            "--untie-embeddings-and-output-weights",
            "untie_embeddings_and_output_weights",
            "separate output layer",
        ),
        ("--disable-bias-linear", "disable_bias_linear", "no bias on any linear layer"),
        (
            "--add-qkv-bias",
            "add_qkv_bias",
            "a bias on the query/key/value projection alone (Qwen2/Qwen2.5)",
        ),
        (
            "--qk-layernorm",
            "qk_layernorm",
            "normalise queries and keys per head (Qwen3; --normalization's norm)",
        ),
    ):
        model.add_argument(flag, action="store_true", default=None, help=f"{text} {_preset(dest)}")
    model.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="attention head size (default: --hidden-size / --num-attention-heads, or the "
        "preset's head size when neither is given)",
    )
    model.add_argument(
        "--attention-dropout", type=float, default=0.0, help="dropout of the attention scores"
    )
    model.add_argument(
        "--hidden-dropout", type=float, default=0.0, help="dropout after attention and MLP"
    )


def _add_attention_flags(attention) -> None:
    attention.add_argument(
        "--attention-backend",
        default=None,
        metavar="{" + ",".join(ATTENTION_BACKENDS) + "}",
        help="the fused attention kernel's implementation (default: by device; Megatron-LM's "
        "kernel names are refused, docs/launch-scripts.md)",
    )
    attention.add_argument(
        "--window-size",
        type=_window_size,
        default=None,
        metavar="LEFT,RIGHT",
        help="sliding-window attention: each token sees LEFT earlier and RIGHT later tokens "
        "(-1 = unbounded; the right side is 0 under causal attention), e.g. 4095,0 "
        "(default: none, full causal attention)",
    )
    attention.add_argument(
        "--window-attn-skip-freq",
        type=int,
        default=None,
        help="every N-th layer uses full attention, the others the window (megatron's meaning; "
        "default: none, every layer uses the window)",
    )


def _add_parallel_flags(par) -> None:
    par.add_argument(
        "--tensor-model-parallel-size", type=int, default=1, help="ranks each layer is split over"
    )
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages")
    vp_default = "(default: none, one model chunk per stage)"
    par.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="the interleaved 1F1B schedule: each pipeline rank holds (layers per stage / N) "
        f"model chunks of N layers {vp_default}",
    )
    par.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=int,
        default=None,
        help=f"the interleaved 1F1B schedule with this many model chunks per pipeline rank {vp_default}",
    )
    par.add_argument(
        "--context-parallel-size", type=int, default=1, help="ranks each sequence is split over"
    )
    par.add_argument(
        "--cp-comm-type",
        choices=["p2p", "a2a"],
        default=None,
        help="context parallelism by a ring (p2p) or all-to-all (a2a, Ulysses) (default p2p)",
    )
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--use-distributed-optimizer", action="store_true")
    par.add_argument("--overlap-grad-reduce", action="store_true")
    par.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="the distributed optimizer's parameter all-gather runs bucket by bucket in the next "
        "forward instead of at the end of the step (needs --use-distributed-optimizer and "
        "--overlap-grad-reduce, as in Megatron-LM)",
    )
    par.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="keep and reduce the main gradients in bf16 (half the bytes of fp32; needs --bf16)",
    )
    par.add_argument(
        "--use-megatron-fsdp",
        action="store_true",
        help="ZeRO-3: shard weights, gradients and optimizer state over the data x context parallel "
        "ranks with megatron-core's Megatron-FSDP (implies --use-distributed-optimizer)",
    )
    par.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="shard weights, gradients and optimizer state over the data x context parallel ranks "
        "with torch FSDP2 (fully_shard per transformer layer and embedding; Megatron-LM's flag)",
    )
    par.add_argument(
        "--fsdp2-offload-to-cpu",
        action="store_true",
        help="with --use-torch-fsdp2: weights, gradients and optimizer state on the host, each "
        "layer's weights copied to the device while it computes, the optimizer step on the host",
    )
    par.add_argument(
        "--fsdp2-config-path",
        default=None,
        help="MindSpeed's FSDP2 YAML file; keys read: offload_to_cpu, pin_memory, "
        "reshard_after_forward, param_dtype, reduce_dtype (others are refused); default: none "
        "(the flags decide)",
    )
    par.add_argument(
        "--data-parallel-sharding-strategy",
        choices=SHARDING_STRATEGIES,
        default=None,
        help="what Megatron-FSDP shards: optim (ZeRO-1), optim_grads (ZeRO-2), optim_grads_params "
        f"(ZeRO-3); default {DEFAULT_SHARDING_STRATEGY} with --use-megatron-fsdp",
    )
    par.add_argument(
        "--no-gradient-accumulation-fusion",
        action="store_true",
        help="accepted as Megatron-LM's (which needs it with Megatron-FSDP); no kernel fuses it here",
    )
    par.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10,
        help="a collective that takes longer fails (torch.distributed's and megatron's groups), and a "
        "rank whose iteration or save takes longer dumps its stacks and exits with code 3 (the watchdog, "
        "docs/fault-tolerance.md); fractions allowed (Megatron-LM takes whole minutes)",
    )


def _add_recompute_flags(rec) -> None:
    rec.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        help="(default: none, every layer keeps its activations)",
    )
    rec.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        help="(default: none; --recompute-granularity full needs one)",
    )
    rec.add_argument(
        "--recompute-num-layers",
        type=int,
        help="(default: none; --recompute-granularity full needs it)",
    )
    rec.add_argument(
        "--recompute-modules",
        nargs="*",
        help="(default core_attn with --recompute-granularity selective; ours: qkv)",
    )
    rec.add_argument(
        "--activation-offload-layers",
        type=int,
        default=0,
        metavar="N",
        help="park what the first N layers of each pipeline stage keep for backward in (pinned) host "
        "memory between their forward and backward, prefetched one layer ahead (0: off)",
    )
    rec.add_argument(
        "--loss-compute-mode",
        choices=["default", "chunk"],
        default="default",
        help="chunk: the output layer and the vocab-parallel cross-entropy per tile of "
        "--loss-chunk-size tokens, never the whole sequence's logits (MindSpeed-LLM's flag; "
        "docs/sequence-tiling.md)",
    )
    rec.add_argument(
        "--loss-chunk-size",
        type=int,
        metavar="N",
        help="tokens per loss tile with --loss-compute-mode chunk (default 1024; under "
        "--sequence-parallel a multiple of --tensor-model-parallel-size)",
    )
    rec.add_argument(
        "--mlp-chunk-size",
        type=int,
        metavar="N",
        help="compute each MLP in tiles of N tokens, each tile's intermediates recomputed in its "
        "backward (ALST's TiledMLP; under --sequence-parallel a multiple of "
        "--tensor-model-parallel-size; default: untiled)",
    )


def _add_schedule_flags(opt) -> None:
    opt.add_argument("--bf16", action="store_true")
    opt.add_argument("--fp16", action="store_true")
    opt.add_argument("--lr", type=float, help="peak learning rate " + _preset("lr"))
    opt.add_argument("--min-lr", type=float, help="where the decay ends " + _preset("min_lr"))
    opt.add_argument(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine"],
        default="cosine",
        help="from --lr down to --min-lr over the iterations after the warm-up",
    )
    opt.add_argument(
        "--lr-warmup-iters",
        type=int,
        help="linear warm-up from 0 "
        + _preset("lr_warmup_iters", after="; at most 10% of --train-iters, said when cut"),
    )
    opt.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's weight decay")
    opt.add_argument(
        "--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this"
    )
    opt.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's beta1")
    opt.add_argument("--adam-beta2", type=float, default=0.95, help="Adam's beta2")
    opt.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="step the optimizer state on the host (megatron-core's HybridDeviceOptimizer; needs "
        "--use-distributed-optimizer --use-precision-aware-optimizer --bf16, and a device: NPU or GPU)",
    )
    opt.add_argument(
        "--optimizer-offload-fraction",
        type=float,
        default=1.0,
        help="share of the optimizer state (by parameters) kept and stepped on the host",
    )
    opt.add_argument(
        "--use-precision-aware-optimizer",
        action="store_true",
        help="megatron-core's precision-aware optimizer state (with the distributed optimizer)",
    )
    for flag, moment in (("--exp-avg-dtype", "first"), ("--exp-avg-sq-dtype", "second")):
        opt.add_argument(
            flag,
            choices=tuple(HOST_MOMENT_BYTES),  # the planner's, for the same flags
            default="fp32",
            help=f"storage dtype of Adam's {moment} moment (Megatron-LM's flag); bf16 needs "
            "--optimizer-cpu-offload: the host step widens it to fp32 for the update",
        )
    opt.add_argument(
        "--overlap-cpu-optimizer-d2h-h2d",
        action="store_true",
        help="overlap the offloaded optimizer's gradient and parameter copies with its host step",
    )
    opt.add_argument(
        "--micro-batch-size",
        type=int,
        help="sequences per micro-batch and data-parallel rank " + _preset("micro_batch_size"),
    )
    opt.add_argument(
        "--global-batch-size",
        type=int,
        help="sequences per iteration " + _preset("global_batch_size"),
    )
    opt.add_argument("--train-iters", type=int, help="iterations " + _preset("train_iters"))
    opt.add_argument(
        "--seed", type=int, default=1234, help="of the weights, the data order and dropout"
    )
    opt.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="validation loss on the --split validation set every N iterations and at the end "
        "(default: none)",
    )
    opt.add_argument(
        "--eval-iters",
        type=int,
        default=100,
        help="global batches per validation; 0 turns validation off (Megatron-LM's meaning)",
    )


def _add_data_flags(data) -> None:
    data.add_argument(
        "--data-path",
        nargs="*",
        help="indexed-dataset prefixes (default: the built-in long-range task)",
    )
    data.add_argument(
        "--split", default="98,2,0", help="train, validation, test weights of --data-path"
    )
    data.add_argument(
        "--tokenizer-type",
        default=None,
        help="ByteTokenizer, HuggingFaceTokenizer, SentencePieceTokenizer or NullTokenizer "
        "(default: the tokenizer stored with the checkpoint in --load, else ByteTokenizer)",
    )
    data.add_argument(
        "--tokenizer-model",
        default=None,
        help="the tokenizer's file or directory (default: none, for ByteTokenizer)",
    )
    data.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this x TP (Megatron-LM's rule)",
    )
    data.add_argument("--mock-data", action="store_true")
    data.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="document masking: no token attends across an EOD (packed THD batches, any CP size)",
    )
    data.add_argument(
        "--reset-position-ids", action="store_true", help="positions restart after every EOD"
    )
    data.add_argument("--eod-mask-loss", action="store_true", help="no loss on EOD input tokens")
    data.add_argument(
        "--data-cache-path",
        default=None,
        help="where megatron caches the dataset indices, a directory every rank reads "
        "(default: SAVE/data/cache)",
    )
    data.add_argument(
        "--synthetic-key-depth",
        choices=KEY_DEPTHS,
        default=None,
        help="ours, the built-in task only: where each document's key sits. fixed (default): "
        "always --seq-length - K - 2 tokens before its copy (the main job); uniform: at a "
        "uniformly random depth, the layout of `mcore-flash evaluate --task needle`. A checkpoint "
        "records it: resuming with the other placement is refused",
    )


def _add_checkpoint_flags(ckpt) -> None:
    ckpt.add_argument(
        "--emulate-npu",
        action="store_true",
        help="rehearse the Ascend NPU code path on CPU processes: an emulated npu device, "
        "HCCL-strict process groups and contract doubles of the torch_npu ops",
    )
    ckpt.add_argument(
        "--save",
        default=None,
        help="checkpoint + metrics directory (default: --load when given, a run saving where it "
        "resumed from; else runs/<model>; --finetune needs its own)",
    )
    ckpt.add_argument(
        "--load",
        default=None,
        help="resume from the checkpoint there, or start from scratch while it holds none (said "
        "so); --finetune, --no-load-optim and --use-checkpoint-args need one there (default: "
        "none, random weights)",
    )
    ckpt.add_argument(
        "--ckpt-format",
        default=None,
        metavar="{" + ",".join(CKPT_FORMATS) + "}",
        help="torch_dist (megatron's dist_checkpointing), or fsdp_dtensor (torch DCP of Megatron-FSDP's "
        "DTensors); default: fsdp_dtensor with --use-megatron-fsdp, else torch_dist",
    )
    ckpt.add_argument(
        "--async-save",
        action="store_true",
        help="write torch_dist checkpoints in the background (megatron-core's asynchronous "
        "dist-checkpoint writer) while training goes on; published once every rank has written",
    )
    ckpt.add_argument(
        "--finetune",
        action="store_true",
        help="load the weights only from --load and start at iteration 0 (no optimizer, scheduler or RNG "
        "state): continued pretraining from a converted checkpoint",
    )
    ckpt.add_argument(
        "--no-load-optim", action="store_true", help="do not load the optimizer and scheduler state"
    )
    ckpt.add_argument("--no-load-rng", action="store_true", help="do not load the RNG states")
    ckpt.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="take the model flags not given on the command line from the checkpoint in --load",
    )
    ckpt.add_argument(
        "--save-interval",
        type=int,
        default=None,
        help="(default: --train-iters, one checkpoint at the end)",
    )
    ckpt.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="save and exit after iteration N (same schedule; default: none)",
    )
    ckpt.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="save and exit 0 after the first iteration that ends past this many minutes of the run "
        "(setup included; every rank agrees), to stop inside a scheduler's wall-time limit "
        "(default: none)",
    )
    ckpt.add_argument(
        "--log-interval", type=int, default=10, help="iterations between progress lines"
    )
    ckpt.add_argument(
        "--tensorboard-dir", default=None, help="TensorBoard event files (default: none)"
    )
    ckpt.add_argument(
        "--hardware",
        default=None,
        metavar="NAME|FILE.json",
        help=f"device profile ({', '.join(HARDWARE_PROFILES)} or a JSON file, as for `mcore-flash plan "
        "--hardware`): adds MFU (model TFLOP/s per device / the profile's BF16 peak) to the log "
        "(default: none, no MFU)",
    )
    ckpt.add_argument(
        "--device-memory",
        default=None,
        help="per-device memory the --dry-run plan checks against (default the --hardware profile's capacity: "
        "what torch_npu can allocate of a 910B, 60.97 GiB)",
    )
    ckpt.add_argument(
        "--dry-run",
        action="store_true",
        help="validate flags and build one rank's model on the meta device (WORLD_SIZE from env)",
    )


def parse_config(
    argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None
) -> TrainingConfig:
    """The trainer's config for ``argv``, checked against ``world_size`` (default: env
    WORLD_SIZE, else 1, or TP x PP x CP for ``--dry-run``); ValueError names the flag
    (:class:`~.launch_flags.LaunchFlagsRefused`: every refused flag, in ``argv``'s order);
    a flag argparse cannot read exits 2 with one message (:class:`FlagParser`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = vars(build_parser().parse_args(argv))
    try:
        return resolve_config(flags, world_size)
    except LaunchFlagsRefused as refused:
        raise refused.in_order(argv) from None


def parse_args(
    argv: Optional[Sequence[str]] = None,
    world_size: Optional[int] = None,
    parser: Optional[argparse.ArgumentParser] = None,
) -> argparse.Namespace:
    """For the tools that add flags to :func:`build_parser`'s (``parser``): the fields of the
    checked :class:`TrainingConfig` (:func:`resolve_tool_config`) plus the tool's own flags, as
    one namespace. The trainer itself uses :func:`parse_config`."""
    flags = vars((parser or build_parser()).parse_args(argv))
    return argparse.Namespace(**{**flags, **resolve_tool_config(flags, world_size).to_dict()})


def resolve_tool_config(
    flags: Mapping[str, Any], world_size: Optional[int] = None
) -> TrainingConfig:
    """The :class:`TrainingConfig` of a tool's parsed ``flags`` (evaluate, generate: the model
    it loads and the layout it runs at). The tools run one model chunk per pipeline stage:
    the interleaved schedule's flags are refused."""
    if (
        flags["virtual_pipeline_model_parallel_size"]
        or flags["num_layers_per_virtual_pipeline_stage"]
    ):
        raise ValueError(
            "--virtual-pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage: evaluation "
            "and generation run one model chunk per pipeline stage; drop the flag (a checkpoint saved "
            "with the interleaved schedule loads at any pipeline layout)"
        )
    return resolve_config(flags, world_size)


def _window_size(text: str) -> tuple[int, int]:
    """argparse type of ``--window-size``: ``LEFT,RIGHT``, each -1 or >= 0."""
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LEFT,RIGHT (two integers, e.g. 4095,0), got {text!r}"
        ) from None
    if min(left, right) < -1:
        raise argparse.ArgumentTypeError(
            f"LEFT and RIGHT must be -1 (unbounded) or >= 0, got {text!r}"
        )
    return left, right
