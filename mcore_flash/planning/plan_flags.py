"""The flags of ``mcore-flash plan``: its own short names, Megatron-LM's and the trainer's names
for the same settings (``--tensor-model-parallel-size``, ``--sequence-parallel``,
``--recompute-granularity`` ...), and the functions that resolve them into the planner's terms
(each ValueError names the flag).

Defaults: a single layout's plan takes the trainer's (``mcore-flash pretrain``'s) defaults,
so that the same flags plan the run the trainer builds; ``--search`` turns on sequence
parallelism, the distributed optimizer and overlapped gradient reduction unless told
otherwise, and writes every switch into each launch line.
"""

from __future__ import annotations

import argparse
from typing import Optional

from .activation_bytes import PROFILES
from .fsdp import FSDP_STRATEGIES
from .hardware import DEFAULT_HARDWARE, HARDWARE_PROFILES
from .memory import MIN_FREE_SHARE, MIN_FREE_SHARE_HOST
from .models import MODELS
from .parallel_layout import DEFAULT_LOSS_CHUNK_SIZE, HOST_MOMENT_BYTES
from .search import SEARCH_RECOMPUTE_MODES

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


# what the run is, when not --from-pretrain-args (whose trainer's flags say it)
DEFAULTS = {"model": "llama2-70b", "seq_length": 131072, "hardware": DEFAULT_HARDWARE}
# the dests that stay plan's own with --from-pretrain-args: how to plan and print, not what
PLANNING_OPTIONS = {
    "num_devices",
    "min_free_memory",
    "hccl_buffsize",
    "host_memory",
    "sensitivity",
    "profile",
    "runtime_reserve",
    "fragmentation",
    "tp_comm_overlap",
    "overlap_param_gather",
    "json",
    "mean_document_length",
    "from_pretrain_args",
}


def fill_defaults(args: argparse.Namespace) -> None:
    """The run's :data:`DEFAULTS` into ``args`` where its flags were not given."""
    for dest, value in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)


def given_run_flags(args: argparse.Namespace) -> list[str]:
    """The flags outside :data:`PLANNING_OPTIONS` that ``args`` sets away from their default."""
    parser = build_parser()
    given = []
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its actions only here
        dest = action.dest
        if dest in PLANNING_OPTIONS or dest == "help" or not action.option_strings:
            continue
        if (
            getattr(args, dest) != parser.get_default(dest)
            and action.option_strings[0] not in given
        ):
            given.append(action.option_strings[0])
    return given


def seq_tokens(text: str) -> int:
    """Tokens from ``"131072"`` or ``"128K"`` (K = 1024)."""
    text = text.strip().lower()
    if text.endswith("k"):
        return int(float(text[:-1]) * 1024)
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcore-flash plan",
        description="Per-device memory of a Megatron-Core layout with the fused attention; layout search.",
    )
    _add_run_flags(p)
    _add_memory_flags(p)
    _add_mode_flags(p)
    return p


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """What run is planned: the model, its sequences, the layout and the batch."""
    p.add_argument("--model", help=f"preset: {', '.join(MODELS)} (default {DEFAULTS['model']})")
    p.add_argument(
        "--seq-length",
        type=seq_tokens,
        help=f"tokens per sequence, e.g. 131072 or 128K (default {DEFAULTS['seq_length']})",
    )
    p.add_argument(
        "--mean-document-length",
        type=seq_tokens,
        metavar="N",
        help="mean tokens per document packed into a sequence with document masking, e.g. 8K: attention "
        "FLOPs scale by N/seq-length, memory does not (default: one document fills each sequence)",
    )
    p.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1)
    p.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1)
    p.add_argument(
        "--vp",
        "--virtual-pipeline-size",
        "--virtual-pipeline-model-parallel-size",
        dest="vp",
        type=int,
        help="interleaved chunks per rank (default 1)",
    )
    p.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        dest="vp_layers",
        type=int,
        metavar="N",
        help="the interleaved schedule by layers per chunk: --vp = layers / (--pp x N)",
    )
    devices = p.add_mutually_exclusive_group()
    devices.add_argument(
        "--dp", "--data-parallel-size", dest="dp", type=int, help="data-parallel size"
    )
    devices.add_argument(
        "--num-devices", type=int, help="total devices (dp = devices / (tp*pp*cp))"
    )
    _add_recompute_flags(p)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument(
        "--global-batch-size", type=int, help="sequences per step (default: about 4M tokens)"
    )


def _add_memory_flags(p: argparse.ArgumentParser) -> None:
    """The device and host memory, the sharding, the offloads, the tiles and the precision."""
    p.add_argument(
        "--device-memory",
        help="device memory a process can allocate, e.g. 60.97GiB (binary; default the hardware profile's "
        "capacity as torch/torch_npu report it, not the datasheet's HBM)",
    )
    p.add_argument(
        "--min-free-memory",
        help=f"device memory a fitting plan leaves free: a size (3GiB) or a share of --device-memory (default "
        f"{MIN_FREE_SHARE:.0%}%, {MIN_FREE_SHARE_HOST:.0%}% for a layout with state on the host, offload or streaming: "
        "the plan's transient buffers and fragmentation are estimates)",
    )
    p.add_argument(
        "--hccl-buffsize",
        type=int,
        metavar="MB",
        help="HCCL_BUFFSIZE the run exports (MB): each HCCL communicator holds 2 x this outside the allocator "
        "(default HCCL's 200; Ascend profiles only)",
    )
    p.add_argument(
        "--use-megatron-fsdp",
        action="store_true",
        help="shard over the dp x cp ranks with megatron-core's Megatron-FSDP (implies the distributed "
        "optimizer); with --search: try this strategy for every layout that does not fit without it (default: "
        "ZeRO-3 only when nothing fits below it)",
    )
    p.add_argument(
        "--data-parallel-sharding-strategy",
        dest="sharding_strategy",
        choices=FSDP_STRATEGIES,
        help="Megatron-FSDP's strategy (default optim_grads_params = ZeRO-3; needs --use-megatron-fsdp)",
    )
    p.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="torch FSDP2 fully_shard over the dp x cp ranks (the trainer's flag; with --fsdp2-offload-to-cpu: "
        "weights, gradients and optimizer state on the host, streamed unit by unit; PP1, no distributed "
        "optimizer)",
    )
    p.add_argument(
        "--fsdp2-offload-to-cpu",
        action="store_true",
        help="FSDP2's CPUOffloadPolicy (the trainer's flag; needs --use-torch-fsdp2)",
    )
    p.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        help="the optimizer state (fp32 master, Adam m, v) of --optimizer-offload-fraction of each rank's shard "
        "lives and steps on the host (megatron-core's HybridDeviceOptimizer; needs the distributed optimizer)",
    )
    p.add_argument(
        "--optimizer-offload-fraction",
        type=float,
        metavar="F",
        help="share of the shard offloaded, in [0, 1] (default 1.0; needs --optimizer-cpu-offload)",
    )
    p.add_argument(
        "--overlap-cpu-optimizer-d2h-h2d",
        dest="overlap_cpu_optimizer",
        action="store_true",
        help="step time: the offloaded optimizer's copies overlap its host step",
    )
    p.add_argument(
        "--activation-offload-layers",
        type=int,
        default=0,
        metavar="N",
        help="the first N layers of each pipeline stage keep what they save for backward in host memory",
    )
    p.add_argument(
        "--grad-reduce-in-bf16",
        dest="grad_reduce_in_bf16",
        action="store_true",
        help="bf16 main gradients (Megatron-LM's flag; needs --dtype bf16): 2 B per gradient-buffer element, "
        "plus the distributed optimizer's fp32 gradients of its device shard; --search tries them anyway on "
        "the offload rung when nothing fits with fp32 gradients",
    )
    for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype"):
        p.add_argument(
            flag,
            choices=tuple(HOST_MOMENT_BYTES),
            default="fp32",
            help="Adam's moments on the host in bf16 (the trainer's host step; both flags alike, the whole "
            "optimizer offloaded); --search tries them anyway on the offload rung when the host is too small",
        )
    _add_tile_flags(p)
    p.add_argument(
        "--host-memory",
        help="host memory per node, e.g. 2TB (binary; default the hardware profile's, an assumption for the 910B)",
    )
    p.add_argument(
        "--no-offload",
        dest="offload",
        action="store_false",
        help="--search: stop the ladder at ZeRO-3 (no host offload)",
    )


def _add_mode_flags(p: argparse.ArgumentParser) -> None:
    """The hardware and the step time's options, the output, and the modes (--search,
    --compare-standard, --from-pretrain-args)."""
    p.add_argument(
        "--sensitivity",
        action="store_true",
        help="how the prediction moves when each assumed hardware figure halves or doubles",
    )
    p.add_argument(
        "--profile",
        choices=[k for k in PROFILES if k != "korthikanti"],
        default="npu",
        help="device kernels' saved tensors (default npu)",
    )
    precision = p.add_mutually_exclusive_group()
    precision.add_argument(
        "--dtype",
        choices=tuple(DTYPE_BYTES),
        default="bf16",
        help="weights' and activations' dtype (default bf16: the planner plans mixed precision, main "
        "gradients and optimizer in fp32, which the trainer trains with --bf16)",
    )
    for flag in ("--bf16", "--fp16"):
        precision.add_argument(flag, dest="dtype", action="store_const", const=flag[2:])
    p.add_argument(
        "--runtime-reserve",
        default="2GiB",
        help="fixed reserve for runtime/collectives (default 2GiB)",
    )
    p.add_argument(
        "--fragmentation",
        type=float,
        default=0.05,
        help="fraction of dynamic memory lost (default 0.05)",
    )
    p.add_argument(
        "--hardware",
        metavar="NAME|FILE.json",
        help=f"device profile for the step time: {', '.join(HARDWARE_PROFILES)} or a JSON file with the same "
        f"fields (docs/step-time.md; default {DEFAULT_HARDWARE})",
    )
    p.add_argument(
        "--tp-comm-overlap", action="store_true", help="step time: TP collectives overlap the GEMMs"
    )
    _add_switches(p)
    p.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="step time: the distributed optimizer's parameter all-gather overlaps the first forward",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--from-pretrain-args",
        nargs=argparse.REMAINDER,
        metavar="PRETRAIN_FLAGS",
        help="last: plan the run `mcore-flash pretrain PRETRAIN_FLAGS` builds, read by the trainer's own "
        "parser with its defaults (its shape flags, --hardware and --device-memory included; world size "
        "--num-devices, else WORLD_SIZE, else TP x PP x CP); what pretrain --dry-run plans",
    )
    p.add_argument(
        "--search", action="store_true", help="enumerate TP/PP/CP/recompute layouts that fit"
    )
    p.add_argument(
        "--longest",
        action="store_true",
        help="the longest sequence --num-devices train: the largest multiple of --longest-step tokens "
        "for which --search finds a layout, with that layout",
    )
    p.add_argument(
        "--longest-step",
        type=seq_tokens,
        default=8192,
        help="--longest's granularity (default 8192)",
    )
    p.add_argument(
        "--top",
        type=int,
        default=5,
        help="layouts shown by --search, with their step-time breakdown (default 5)",
    )
    p.add_argument(
        "--max-tp", type=int, default=8, help="largest TP --search tries (default 8: one node)"
    )
    p.add_argument(
        "--interleave",
        default="1",
        help="--search: virtual pipeline sizes to try, e.g. 1,2 (default 1)",
    )
    p.add_argument(
        "--compare-standard",
        action="store_true",
        help="standard vs fused attention by sequence length",
    )
    p.add_argument(
        "--seq-lengths", help="--compare-standard lengths, e.g. 1K,4K,128K (default 1K..128K)"
    )
    p.add_argument(
        "--attention-dropout", type=float, default=0.0, help="--compare-standard: attention dropout"
    )


# (on, off, dest, what): the trainer's switches, off by default there and in a single plan
SWITCHES = (
    ("--sequence-parallel", "--no-sequence-parallel", "sequence_parallel", "sequence parallelism"),
    (
        "--use-distributed-optimizer",
        "--no-distributed-optimizer",
        "distributed_optimizer",
        "the distributed optimizer (ZeRO-1)",
    ),
    (
        "--overlap-grad-reduce",
        "--no-overlap-grad-reduce",
        "overlap_grad_reduce",
        "gradient reduction overlapped with backward, in buckets (off: after the last backward, in one "
        "bucket, which the step time counts)",
    ),
)


def _add_switches(p: argparse.ArgumentParser) -> None:
    """Each of :data:`SWITCHES` as the trainer's flag and its ``--no-`` form."""
    for on, off, dest, what in SWITCHES:
        group = p.add_mutually_exclusive_group()
        group.add_argument(
            on,
            dest=dest,
            action="store_true",
            default=None,
            help=f"{what} (default: off, as the trainer; --search: on)",
        )
        group.add_argument(off, dest=dest, action="store_false", default=None)


def _add_recompute_flags(p: argparse.ArgumentParser) -> None:
    """``--recompute MODE`` and the trainer's (Megatron-LM's) recompute flags for the same."""
    p.add_argument(
        "--recompute",
        choices=SEARCH_RECOMPUTE_MODES,
        help="what every layer recomputes (default none); the trainer's --recompute-granularity, "
        "--recompute-method and --recompute-modules say the same",
    )
    p.add_argument("--recompute-granularity", choices=("full", "selective"))
    p.add_argument("--recompute-method", choices=("uniform", "block"))
    p.add_argument(
        "--recompute-modules",
        nargs="+",
        metavar="MODULE",
        help="with --recompute-granularity selective (default core_attn) or full --recompute-method block: "
        "qkv plans as --recompute qkv, core_attn as attention, other modules as none (an upper bound)",
    )
    p.add_argument(
        "--recompute-num-layers",
        type=int,
        metavar="N",
        help="partial recompute: the first N layers of each pipeline chunk recomputed whole, --recompute for the "
        "others (the trainer's --recompute-method block; default 0)",
    )


def _add_tile_flags(p: argparse.ArgumentParser) -> None:
    """The sequence tiling flags, the trainer's names (docs/planner.md, "Sequence tiling")."""
    p.add_argument(
        "--loss-compute-mode",
        choices=("default", "chunk"),
        default="default",
        help="chunk: the output layer and the cross-entropy per tile of --loss-chunk-size tokens (the "
        "trainer's flag); --search tries tiles anyway once nothing fits on ZeRO-3",
    )
    p.add_argument(
        "--loss-chunk-size",
        type=int,
        metavar="N",
        help=f"tokens per loss tile with --loss-compute-mode chunk (default {DEFAULT_LOSS_CHUNK_SIZE}; under "
        "sequence parallelism a multiple of --tp)",
    )
    p.add_argument(
        "--mlp-chunk-size",
        type=int,
        metavar="N",
        help="every MLP in tiles of N tokens, each recomputed in its backward (the trainer's flag; under "
        "sequence parallelism a multiple of --tp; default: untiled)",
    )


def stream_weights(args) -> bool:
    """Whether ``--use-torch-fsdp2 --fsdp2-offload-to-cpu`` stream the weights
    (``Layout.stream_weights``); ValueError naming the flag for one without the other, or
    with ``--search`` / ``--longest`` (which climb to streaming themselves)."""
    fsdp2, offload = args.use_torch_fsdp2, args.fsdp2_offload_to_cpu
    if not (fsdp2 or offload):
        return False
    if not (fsdp2 and offload):
        raise ValueError(
            "--use-torch-fsdp2 and --fsdp2-offload-to-cpu: the planner plans them together (weights, gradients "
            "and optimizer state streamed from the host); give both"
        )
    if args.search or args.longest:
        raise ValueError(
            "--use-torch-fsdp2 --fsdp2-offload-to-cpu with --search/--longest: the search climbs to streaming "
            "when no layout fits below it; drop the flags"
        )
    return True


def fsdp_strategy(args) -> Optional[str]:
    """The strategy of ``--use-megatron-fsdp [--data-parallel-sharding-strategy S]``, or None."""
    if args.sharding_strategy and not args.use_megatron_fsdp:
        raise ValueError(
            "--data-parallel-sharding-strategy needs --use-megatron-fsdp (megatron DDP does not take it)"
        )
    if args.use_megatron_fsdp and not args.distributed_optimizer:
        raise ValueError(
            "--use-megatron-fsdp implies the distributed optimizer: drop --no-distributed-optimizer"
        )
    if not args.use_megatron_fsdp:
        return None
    return args.sharding_strategy or "optim_grads_params"


def offload_fraction(args) -> float:
    """The optimizer offload fraction of ``--optimizer-cpu-offload [--optimizer-offload-fraction F]``."""
    if args.optimizer_offload_fraction is not None and not args.optimizer_cpu_offload:
        raise ValueError("--optimizer-offload-fraction needs --optimizer-cpu-offload")
    if not args.optimizer_cpu_offload:
        return 0.0
    fraction = 1.0 if args.optimizer_offload_fraction is None else args.optimizer_offload_fraction
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction {fraction}: a fraction in (0, 1]")
    return fraction


def host_moment_dtype(args) -> str:
    """The host moments' dtype of ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` (planned alike)."""
    if args.exp_avg_dtype != args.exp_avg_sq_dtype:
        raise ValueError(
            f"--exp-avg-dtype {args.exp_avg_dtype} and --exp-avg-sq-dtype {args.exp_avg_sq_dtype}: the planner "
            "plans both moments in one dtype; give them alike"
        )
    return args.exp_avg_dtype


def tiles(args) -> tuple[Optional[int], Optional[int]]:
    """The ``(loss, MLP)`` tiles of ``--loss-compute-mode chunk [--loss-chunk-size N]`` and
    ``--mlp-chunk-size N`` (tokens; None: untiled), refused by name as the trainer refuses
    them (a multiple of TP under sequence parallelism: :class:`.parallel_layout.Layout`)."""
    chunk = args.loss_compute_mode == "chunk"
    if args.loss_chunk_size is not None and not chunk:
        raise ValueError(
            "--loss-chunk-size applies to --loss-compute-mode chunk (the default mode computes the whole "
            "sequence's logits): add --loss-compute-mode chunk or drop the size"
        )
    loss = None
    if chunk:
        loss = DEFAULT_LOSS_CHUNK_SIZE if args.loss_chunk_size is None else args.loss_chunk_size
    for flag, value in (("--loss-chunk-size", loss), ("--mlp-chunk-size", args.mlp_chunk_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be a positive number of tokens, got {value}")
    return loss, args.mlp_chunk_size


def data_parallel_size(args) -> int:
    unit = args.tp * args.pp * args.cp
    if args.num_devices is not None:
        if args.num_devices % unit:
            raise ValueError(
                f"--num-devices {args.num_devices} is not divisible by tp*pp*cp = {unit}"
            )
        return args.num_devices // unit
    return args.dp or 1


def resolve_flags(args: argparse.Namespace, num_layers: int, search: bool) -> None:
    """Rewrite ``args`` in the planner's terms, once: the switches of :data:`SWITCHES`
    (unset: off for one layout, as the trainer; on for ``search``), ``recompute`` and
    ``recompute_num_layers`` from either vocabulary (:func:`recompute_from_flags`), ``vp``
    from ``--num-layers-per-virtual-pipeline-stage`` (of ``num_layers``). ValueError naming
    the flag."""
    if args.use_megatron_fsdp and args.distributed_optimizer is None:
        args.distributed_optimizer = True  # the trainer's rule: Megatron-FSDP implies it
    for _, _, dest, _ in SWITCHES:
        if getattr(args, dest) is None:
            setattr(args, dest, search)
    trainer = (args.recompute_granularity, args.recompute_method, args.recompute_modules)
    if args.recompute is not None and any(trainer):
        raise ValueError(
            "--recompute and --recompute-granularity/--recompute-method/--recompute-modules say the same "
            "thing twice: give one"
        )
    if args.recompute is None:
        args.recompute, args.recompute_num_layers = recompute_from_flags(
            *trainer[:2], args.recompute_num_layers, trainer[2]
        )
    args.recompute_num_layers = args.recompute_num_layers or 0
    args.vp = _virtual_pipeline(args, num_layers)


def recompute_from_flags(
    granularity: Optional[str],
    method: Optional[str],
    num_layers: Optional[int],
    modules: Optional[list[str]],
) -> tuple[str, int]:
    """``(--recompute mode, layers recomputed whole per chunk)`` of the trainer's flags, as
    :func:`.recipes.plan_for_pretrain_args` reads a trainer's config: full by ``uniform`` is
    ``full``; full by ``block`` is partial (``num_layers`` whole, the others by ``modules``);
    selective recomputes ``modules`` (default ``core_attn``). ``qkv`` plans as ``qkv``,
    ``core_attn`` as ``attention``, anything else as ``none`` (an upper bound)."""
    if granularity is None:
        if method or modules:
            raise ValueError(
                "--recompute-method and --recompute-modules need --recompute-granularity"
            )
        return "none", num_layers or 0
    if granularity == "selective":
        if method:
            raise ValueError("--recompute-method applies to --recompute-granularity full")
        return _module_mode(modules or ["core_attn"]), 0
    if method is None:
        raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
    if method == "uniform":
        return "full", 0
    if not num_layers:
        raise ValueError(
            "--recompute-method block needs --recompute-num-layers N (layers per chunk)"
        )
    return _module_mode(modules or []), num_layers


def _module_mode(modules: list[str]) -> str:
    if "qkv" in modules:
        return "qkv"
    return "attention" if "core_attn" in modules else "none"


def _virtual_pipeline(args: argparse.Namespace, num_layers: int) -> int:
    """Chunks per rank of ``--vp`` or ``--num-layers-per-virtual-pipeline-stage``."""
    if args.vp_layers is None:
        return args.vp or 1
    if args.vp is not None:
        raise ValueError(
            "--vp and --num-layers-per-virtual-pipeline-stage say the same thing twice: give one"
        )
    per_rank, left = divmod(num_layers, args.pp)
    if args.vp_layers < 1 or left or per_rank % args.vp_layers:
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {args.vp_layers}: the model's {num_layers} layers over "
            f"--pp {args.pp} are not whole chunks of it"
        )
    return per_rank // args.vp_layers
