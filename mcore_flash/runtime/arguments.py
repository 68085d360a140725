"""Command-line flags of ``mcore-flash pretrain``, with Megatron-LM's names.

The edge of the trainer: :func:`parse_config` turns ``argv`` into the frozen, checked
:class:`~mcore_flash.runtime.config.TrainingConfig` (presets and checks live in
:mod:`mcore_flash.runtime.config`). Everything here is pure Python: flags are parsed and
validated against the world size before torch allocates anything, and each error names
the flag to change.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping, Optional, Sequence

from mcore_flash.data.synthetic import KEY_DEPTHS
from mcore_flash.planning.hardware import HARDWARE_PROFILES
from mcore_flash.planning.models import MODELS
from mcore_flash.planning.parallel_layout import HOST_MOMENT_BYTES
from mcore_flash.runtime.config import DEFAULT_PRESET, TrainingConfig, resolve_config
from mcore_flash.runtime.config_checks import (
    CKPT_FORMATS,
    DEFAULT_SHARDING_STRATEGY,
    SHARDING_STRATEGIES,
)


class _DefaultsOnceFormatter(argparse.HelpFormatter):
    """argparse's ``ArgumentDefaultsHelpFormatter``, but a flag's default is shown once: not
    when its help already says it ("(default tiny)", "default: the preset's") or when there
    is none to show (``None``: the preset or the device decides; ``False``: a switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcore-flash pretrain",
        description="Pretrain a Llama-style GPT on megatron-core with the fused-attention spec.",
        formatter_class=_DefaultsOnceFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help=f"preset shape (default {DEFAULT_PRESET})",
    )
    for flag in (
        "--num-layers",
        "--hidden-size",
        "--ffn-hidden-size",
        "--num-attention-heads",
        "--num-query-groups",
    ):
        model.add_argument(flag, type=int)
    model.add_argument("--group-query-attention", action="store_true")
    model.add_argument("--seq-length", type=int)
    model.add_argument("--max-position-embeddings", type=int)
    model.add_argument(
        "--position-embedding-type", choices=["rope", "learned_absolute"], help="(default rope)"
    )
    model.add_argument(
        "--rotary-base", type=int, help="RoPE base (raise it to extend the context: 'ABF')"
    )
    model.add_argument(
        "--use-rope-scaling",
        action="store_true",
        default=None,
        help="Llama-3.1's RoPE frequency scaling (over 8192 original positions)",
    )
    model.add_argument(
        "--rope-scaling-factor", type=float, help="factor of --use-rope-scaling (Llama-3.1: 8)"
    )
    model.add_argument(
        "--rotary-seq-len-interpolation-factor",
        type=int,
        default=None,
        help="linear position interpolation: positions are divided by this factor",
    )
    model.add_argument(
        "--norm-epsilon", type=float, help="epsilon of RMSNorm/LayerNorm (default: the preset's)"
    )
    model.add_argument(
        "--normalization", choices=["RMSNorm", "LayerNorm"], help="(default RMSNorm)"
    )
    model.add_argument("--swiglu", action="store_true", default=None)
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    model.add_argument("--disable-bias-linear", action="store_true", default=None)
    model.add_argument(
        "--add-qkv-bias",
        action="store_true",
        default=None,
        help="a bias on the query/key/value projection alone (Qwen2/Qwen2.5)",
    )
    model.add_argument(
        "--qk-layernorm",
        action="store_true",
        default=None,
        help="normalise queries and keys per head (Qwen3; --normalization's norm)",
    )
    model.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="attention head size (default --hidden-size / --num-attention-heads)",
    )
    model.add_argument("--attention-dropout", type=float, default=0.0)
    model.add_argument("--hidden-dropout", type=float, default=0.0)
    model.add_argument(
        "--attention-backend",
        choices=["npu", "cuda", "cpu", "reference"],
        default=None,
        help="fused attention backend (default: by device)",
    )
    model.add_argument(
        "--window-size",
        type=_window_size,
        default=None,
        metavar="LEFT,RIGHT",
        help="sliding-window attention: each token sees LEFT earlier and RIGHT later tokens "
        "(-1 = unbounded; the right side is 0 under causal attention), e.g. 4095,0",
    )
    model.add_argument(
        "--window-attn-skip-freq",
        type=int,
        default=None,
        help="every N-th layer uses full attention, the others the window (megatron's meaning)",
    )

    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="the interleaved 1F1B schedule: each pipeline rank holds (layers per stage / N) model chunks of N layers",
    )
    par.add_argument(
        "--virtual-pipeline-model-parallel-size",
        type=int,
        default=None,
        help="the interleaved 1F1B schedule with this many model chunks per pipeline rank",
    )
    par.add_argument("--context-parallel-size", type=int, default=1)
    par.add_argument("--cp-comm-type", choices=["p2p", "a2a"], default="p2p")
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

    rec = p.add_argument_group("recompute")
    rec.add_argument("--recompute-granularity", choices=["full", "selective"])
    rec.add_argument("--recompute-method", choices=["uniform", "block"])
    rec.add_argument("--recompute-num-layers", type=int)
    rec.add_argument("--recompute-modules", nargs="*")
    rec.add_argument(
        "--activation-offload-layers",
        type=int,
        default=0,
        metavar="N",
        help="park what the first N layers of each pipeline stage keep for backward in (pinned) host "
        "memory between their forward and backward, prefetched one layer ahead (0: off)",
    )

    tiles = p.add_argument_group("sequence tiling (docs/sequence-tiling.md)")
    tiles.add_argument(
        "--loss-compute-mode",
        choices=["default", "chunk"],
        default="default",
        help="chunk: the output layer and the vocab-parallel cross-entropy per tile of "
        "--loss-chunk-size tokens, never the whole sequence's logits (MindSpeed-LLM's flag)",
    )
    tiles.add_argument(
        "--loss-chunk-size",
        type=int,
        metavar="N",
        help="tokens per loss tile with --loss-compute-mode chunk (default 1024; under "
        "--sequence-parallel a multiple of --tensor-model-parallel-size)",
    )
    tiles.add_argument(
        "--mlp-chunk-size",
        type=int,
        metavar="N",
        help="compute each MLP in tiles of N tokens, each tile's intermediates recomputed in its "
        "backward (ALST's TiledMLP; under --sequence-parallel a multiple of "
        "--tensor-model-parallel-size; default: untiled)",
    )

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
    opt.add_argument("--micro-batch-size", type=int)
    opt.add_argument("--global-batch-size", type=int)
    opt.add_argument("--train-iters", type=int)
    opt.add_argument("--seed", type=int, default=1234)
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
        help="global batches per validation (Megatron-LM's default, 100)",
    )

    data = p.add_argument_group("data")
    data.add_argument(
        "--data-path",
        nargs="*",
        help="indexed-dataset prefixes (default: the built-in long-range task)",
    )
    data.add_argument("--split", default="98,2,0")
    data.add_argument("--tokenizer-type", default=None)
    data.add_argument("--tokenizer-model", default=None)
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
    data.add_argument("--data-cache-path", default=None)
    data.add_argument(
        "--synthetic-key-depth",
        choices=KEY_DEPTHS,
        default=None,
        help="ours, the built-in task only: where each document's key sits. fixed (default): "
        "always --seq-length - K - 2 tokens before its copy (the main job); uniform: at a "
        "uniformly random depth, the layout of `mcore-flash evaluate --task needle`. A checkpoint "
        "records it: resuming with the other placement is refused",
    )

    device = p.add_argument_group("device")
    device.add_argument(
        "--emulate-npu",
        action="store_true",
        help="rehearse the Ascend NPU code path on CPU processes: an emulated npu device, "
        "HCCL-strict process groups and contract doubles of the torch_npu ops",
    )

    ckpt = p.add_argument_group("checkpoints and logging")
    ckpt.add_argument(
        "--save", default=None, help="checkpoint + metrics directory (default runs/<model>)"
    )
    ckpt.add_argument("--load", default=None)
    ckpt.add_argument(
        "--ckpt-format",
        choices=CKPT_FORMATS,
        default=None,
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
    ckpt.add_argument("--save-interval", type=int, default=None)
    ckpt.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="save and exit after iteration N (same schedule)",
    )
    ckpt.add_argument(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        help="save and exit 0 after the first iteration that ends past this many minutes of the run "
        "(setup included; every rank agrees), to stop inside a scheduler's wall-time limit",
    )
    ckpt.add_argument("--log-interval", type=int, default=10)
    ckpt.add_argument("--tensorboard-dir", default=None)
    ckpt.add_argument(
        "--hardware",
        default=None,
        metavar="NAME|FILE.json",
        help=f"device profile ({', '.join(HARDWARE_PROFILES)} or a JSON file, as for `mcore-flash plan "
        "--hardware`): adds MFU (model TFLOP/s per device / the profile's BF16 peak) to the log",
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
    return p


def parse_config(
    argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None
) -> TrainingConfig:
    """The trainer's config for ``argv``, checked against ``world_size`` (default: env
    WORLD_SIZE, else 1, or TP x PP x CP for ``--dry-run``); ValueError names the flag."""
    return resolve_config(vars(build_parser().parse_args(argv)), world_size)


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
