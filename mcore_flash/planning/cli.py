"""``mcore-flash plan``: per-device memory of a layout, a layout search, standard vs fused.

    mcore-flash plan --model llama2-70b --seq-length 131072 --tp 8 --pp 2 --cp 16 \
        --num-devices 256 --recompute attention --device-memory 64GB [--json]
    mcore-flash plan --search --num-devices 256 --device-memory 64GB [--top 5]
    mcore-flash plan --compare-standard --model llama2-7b [--tp 1]

:func:`main` (``argv`` -> exit status) resolves ``--model``, ``--hardware`` and the sizes
once (:func:`resolve`) and prints a layout's plan with its predicted step time on
``--hardware`` (:mod:`.step_time`), the search's fitting layouts ranked by that step time,
or the standard vs fused comparison: text, or JSON with ``--json``. Exit status: 0; 1 when
the layout does not fit or the search finds nothing; 2 on an argument it refuses (the
message names the flag). Megatron-LM's long flag names (``--tensor-model-parallel-size``
...) are accepted too. What each flag plans (packed documents, Megatron-FSDP, sequence
tiling, host offload and the search's climb to them, bf16 main gradients and host moments,
``--sensitivity``):
docs/planner.md, docs/step-time.md and ``--help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NamedTuple, Optional

from .activation_bytes import PROFILES
from .compare import DEFAULT_SEQ_LENGTHS, compare_standard
from .flops import check_mean_document_length
from .fsdp import FSDP_STRATEGIES, PLANNED_STRATEGIES
from .hardware import DEFAULT_HARDWARE, HARDWARE_PROFILES, HardwareProfile, load_hardware
from .memory import MIN_FREE_SHARE, plan_memory
from .models import MODELS, ModelShape, get_model
from .parallel_layout import DEFAULT_LOSS_CHUNK_SIZE, HOST_MOMENT_BYTES, Layout
from .report import (
    format_candidate,
    format_compare,
    format_gap,
    format_plan,
    format_sensitivity,
    format_step_time,
    launch_line,
)
from .search import (
    SEARCH_RECOMPUTE_MODES,
    Candidate,
    closest_offload,
    default_global_batch_size,
    search_layouts,
    sensitivity,
)
from .step_time import predict_step_time
from .units import MiB, format_bytes, parse_bytes

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _seq(text: str) -> int:
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
    p.add_argument(
        "--model", default="llama2-70b", help=f"preset: {', '.join(MODELS)} (default llama2-70b)"
    )
    p.add_argument(
        "--seq-length", type=_seq, default=131072, help="tokens per sequence, e.g. 131072 or 128K"
    )
    p.add_argument(
        "--mean-document-length",
        type=_seq,
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
        dest="vp",
        type=int,
        default=1,
        help="interleaved chunks per rank",
    )
    devices = p.add_mutually_exclusive_group()
    devices.add_argument(
        "--dp", "--data-parallel-size", dest="dp", type=int, help="data-parallel size"
    )
    devices.add_argument(
        "--num-devices", type=int, help="total devices (dp = devices / (tp*pp*cp))"
    )
    p.add_argument("--recompute", choices=SEARCH_RECOMPUTE_MODES, default="none")
    p.add_argument(
        "--recompute-num-layers",
        type=int,
        default=0,
        metavar="N",
        help="partial recompute: the first N layers of each pipeline chunk recomputed whole, --recompute for the "
        "others (Megatron's --recompute-method block; default 0)",
    )
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument(
        "--global-batch-size", type=int, help="sequences per step (default: about 4M tokens)"
    )
    p.add_argument(
        "--device-memory",
        help="device memory a process can allocate, e.g. 60.97GiB (binary; default the hardware profile's "
        "capacity as torch/torch_npu report it, not the datasheet's HBM)",
    )
    p.add_argument(
        "--min-free-memory",
        default=f"{MIN_FREE_SHARE:.0%}",
        help="device memory a fitting plan leaves free: a size (3GiB) or a share of --device-memory (default %(default)s: "
        "the plan's transient buffers and fragmentation are estimates)",
    )
    p.add_argument(
        "--hccl-buffsize",
        type=int,
        metavar="MB",
        help="HCCL_BUFFSIZE the run exports (MB): each HCCL communicator holds 2 x this outside the allocator "
        "(default HCCL's 200; Ascend profiles only)",
    )
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    p.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false")
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
    p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bf16", help="activation dtype")
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
        default=DEFAULT_HARDWARE,
        metavar="NAME|FILE.json",
        help=f"device profile for the step time: {', '.join(HARDWARE_PROFILES)} or a JSON file with the same "
        f"fields (docs/step-time.md; default {DEFAULT_HARDWARE})",
    )
    p.add_argument(
        "--tp-comm-overlap", action="store_true", help="step time: TP collectives overlap the GEMMs"
    )
    p.add_argument(
        "--no-overlap-grad-reduce",
        dest="overlap_grad_reduce",
        action="store_false",
        help="launch without --overlap-grad-reduce: megatron's DDP reduces the gradients after the "
        "last backward (the step time counts it), in one bucket",
    )
    p.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="step time: the distributed optimizer's parameter all-gather overlaps the first forward",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--search", action="store_true", help="enumerate TP/PP/CP/recompute layouts that fit"
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
    return p


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


def _fsdp(args) -> Optional[str]:
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


def _offload_fraction(args) -> float:
    """The optimizer offload fraction of ``--optimizer-cpu-offload [--optimizer-offload-fraction F]``."""
    if args.optimizer_offload_fraction is not None and not args.optimizer_cpu_offload:
        raise ValueError("--optimizer-offload-fraction needs --optimizer-cpu-offload")
    if not args.optimizer_cpu_offload:
        return 0.0
    fraction = 1.0 if args.optimizer_offload_fraction is None else args.optimizer_offload_fraction
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction {fraction}: a fraction in (0, 1]")
    return fraction


def _host_moment_dtype(args) -> str:
    """The host moments' dtype of ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` (planned alike)."""
    if args.exp_avg_dtype != args.exp_avg_sq_dtype:
        raise ValueError(
            f"--exp-avg-dtype {args.exp_avg_dtype} and --exp-avg-sq-dtype {args.exp_avg_sq_dtype}: the planner "
            "plans both moments in one dtype; give them alike"
        )
    return args.exp_avg_dtype


def _tiles(args) -> tuple[Optional[int], Optional[int]]:
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


def _dp(args) -> int:
    unit = args.tp * args.pp * args.cp
    if args.num_devices is not None:
        if args.num_devices % unit:
            raise ValueError(
                f"--num-devices {args.num_devices} is not divisible by tp*pp*cp = {unit}"
            )
        return args.num_devices // unit
    return args.dp or 1


class Inputs(NamedTuple):
    """What ``plan``'s name and size flags say, resolved once at the edge."""

    model: ModelShape  # --model
    hardware: HardwareProfile  # --hardware, with --hccl-buffsize's communicator buffers
    device_memory: int  # --device-memory, bytes (default the profile's capacity)
    min_free_memory: int  # --min-free-memory, bytes
    dtype_bytes: int  # --dtype: bytes per parameter and activation element


def resolve(args) -> Inputs:
    """The typed inputs of parsed ``args`` (ValueError naming the flag for a bad one)."""
    hardware = _with_hccl_buffsize(load_hardware(args.hardware), args.hccl_buffsize)
    if args.device_memory is None:
        device_memory = hardware.capacity
    else:
        try:
            device_memory = parse_bytes(args.device_memory)
        except ValueError as error:
            raise ValueError(f"--device-memory {args.device_memory}: {error}") from None
        if not 0 < device_memory <= hardware.hbm_bytes:
            raise ValueError(
                f"--device-memory {args.device_memory}: must be positive and at most the HBM of --hardware "
                f"{hardware.name} ({format_bytes(hardware.hbm_bytes)}); what a process can allocate is less: "
                f"leave the flag out for the profile's capacity ({format_bytes(hardware.capacity)})"
            )
    return Inputs(
        model=get_model(args.model),
        hardware=hardware,
        device_memory=device_memory,
        min_free_memory=_min_free_memory(args.min_free_memory, device_memory),
        dtype_bytes=DTYPE_BYTES[args.dtype],
    )


def _min_free_memory(value: str, device_memory: int) -> int:
    """``--min-free-memory``: a size, or a share of ``device_memory`` ("5%"), in bytes."""
    text = value.strip()
    try:
        free = (
            int(float(text[:-1]) / 100 * device_memory) if text.endswith("%") else parse_bytes(text)
        )
    except (ValueError, OverflowError):
        free = -1
    if not 0 <= free < device_memory:
        raise ValueError(
            f"--min-free-memory {value}: give a size (3GiB) or a share (5%) of the device memory "
            f"({format_bytes(device_memory)}), at least 0 and less than all of it"
        )
    return free


def _with_hccl_buffsize(hardware: HardwareProfile, megabytes: Optional[int]) -> HardwareProfile:
    """``hardware`` whose communicators hold 2 x ``--hccl-buffsize`` MB (unchanged for None)."""
    if megabytes is None:
        return hardware
    if hardware.collective_library != "hccl":
        raise ValueError(
            f"--hccl-buffsize: --hardware {hardware.name} does not use HCCL; its collective library's "
            "buffers are the profile's communicator_buffer_bytes"
        )
    if not 0 < 2 * megabytes * MiB < hardware.capacity:
        raise ValueError(
            f"--hccl-buffsize {megabytes}: HCCL_BUFFSIZE is a positive number of MB whose double fits the "
            f"device ({format_bytes(hardware.capacity)}); HCCL's default is 200"
        )
    return hardware.with_(communicator_buffer_bytes=2 * megabytes * MiB)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        inputs = resolve(args)
        if args.compare_standard and args.mean_document_length is not None:
            raise ValueError(
                "--mean-document-length changes FLOPs, not the saved bytes --compare-standard compares; drop it"
            )
        check_mean_document_length(args.seq_length, args.mean_document_length)
        if args.compare_standard:
            return _compare(args, inputs.model, inputs.dtype_bytes)
        if args.search:
            if args.num_devices is None:
                parser.error("--search needs --num-devices")
            return _search(args, inputs)
        return _plan(args, inputs)
    except ValueError as error:
        print(f"mcore-flash plan: {error}", file=sys.stderr)
        return 2


def _plan_kwargs(args, inputs: Inputs) -> dict:
    return dict(
        min_free_memory=inputs.min_free_memory,
        host_memory=None if args.host_memory is None else parse_bytes(args.host_memory),
        profile=args.profile,
        dtype_bytes=inputs.dtype_bytes,
        runtime_reserve=parse_bytes(args.runtime_reserve),
        fragmentation=args.fragmentation,
        mean_document_length=args.mean_document_length,
    )


def _step_options(args) -> dict:
    return dict(
        tp_comm_overlap=args.tp_comm_overlap,
        overlap_param_gather=args.overlap_param_gather,
    )


def _plan(args, inputs: Inputs) -> int:
    model, hardware, device_memory, _, dtype_bytes = inputs
    dp = _dp(args)
    loss_chunk_size, mlp_chunk_size = _tiles(args)
    gbs = args.global_batch_size or default_global_batch_size(
        args.seq_length, args.micro_batch_size, dp
    )
    layout = Layout(
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        dp=dp,
        vp=args.vp,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        recompute_num_layers=args.recompute_num_layers,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=gbs,
        distributed_optimizer=args.distributed_optimizer,
        fsdp=_fsdp(args),
        optimizer_offload_fraction=_offload_fraction(args),
        activation_offload_layers=args.activation_offload_layers,
        overlap_cpu_optimizer=args.overlap_cpu_optimizer,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        host_moment_dtype=_host_moment_dtype(args),
        overlap_grad_reduce=args.overlap_grad_reduce,
        loss_chunk_size=loss_chunk_size,
        mlp_chunk_size=mlp_chunk_size,
    )
    if layout.grad_reduce_in_bf16 and dtype_bytes != 2:
        raise ValueError("--grad-reduce-in-bf16 needs --bf16 (--dtype bf16)")
    plan = plan_memory(
        model,
        args.seq_length,
        layout,
        device_memory=device_memory,
        hardware=hardware,
        **_plan_kwargs(args, inputs),
    )
    step = predict_step_time(
        model,
        args.seq_length,
        layout,
        hardware,
        mean_document_length=args.mean_document_length,
        dtype_bytes=dtype_bytes,
        activation_profile=args.profile,
        **_step_options(args),
    )
    rows = (
        sensitivity(Candidate(plan, step), plan_kwargs=_plan_kwargs(args, inputs))
        if args.sensitivity
        else None
    )
    candidate = Candidate(plan, step)
    if args.json:
        extra = {} if rows is None else {"sensitivity": rows}
        print(json.dumps({**candidate.to_dict(), **extra}, indent=2))
    else:
        text = format_plan(plan, launch_line(candidate)) + "\n\n" + format_step_time(step)
        print(text + ("" if rows is None else "\n\n" + format_sensitivity(rows)))
    return 0 if plan.fits is not False else 1


def search_candidates(args, inputs: Inputs) -> list[Candidate]:
    """Every layout ``plan --search`` finds for parsed ``args``, best predicted step time
    first (it shows the first ``--top``)."""
    if args.grad_reduce_in_bf16 and inputs.dtype_bytes != 2:
        raise ValueError("--grad-reduce-in-bf16 needs --bf16 (--dtype bf16)")
    loss_chunk_size, mlp_chunk_size = _tiles(args)
    return search_layouts(
        inputs.model,
        args.seq_length,
        args.num_devices,
        inputs.device_memory,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        vp_choices=[int(v) for v in args.interleave.split(",")],
        max_tp=args.max_tp,
        sequence_parallel=args.sequence_parallel,
        distributed_optimizer=args.distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        fsdp_choices=(_fsdp(args),) if args.use_megatron_fsdp else PLANNED_STRATEGIES,
        climb="each" if args.use_megatron_fsdp else "needed",
        offload=args.offload,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        host_moment_dtype=_host_moment_dtype(args),
        loss_chunk_size=loss_chunk_size,
        mlp_chunk_size=mlp_chunk_size,
        hardware=inputs.hardware,
        step_options=_step_options(args),
        **_plan_kwargs(args, inputs),
    )


def _search(args, inputs: Inputs) -> int:
    model, hardware, device_memory, _, dtype_bytes = inputs
    found = search_candidates(args, inputs)
    shown = found[: args.top]
    rows = (
        sensitivity(
            shown[0], plan_kwargs=_plan_kwargs(args, inputs), step_options=_step_options(args)
        )
        if args.sensitivity and shown
        else None
    )
    gap = None
    if not found and args.offload and args.distributed_optimizer:
        gap = closest_offload(
            model,
            args.seq_length,
            args.num_devices,
            device_memory,
            hardware=hardware,
            search_options=dict(
                micro_batch_size=args.micro_batch_size,
                global_batch_size=args.global_batch_size,
                max_tp=args.max_tp,
                sequence_parallel=args.sequence_parallel,
            ),
            **_plan_kwargs(args, inputs),
        )
    if args.json:
        out = {
            "num_fitting": len(found),
            "hardware": hardware.to_dict(),
            "layouts": [c.to_dict() for c in shown],
        }
        if rows is not None:
            out["sensitivity"] = rows
        if gap is not None:
            out["offload_gap"] = gap.to_dict()
        print(json.dumps(out, indent=2))
        return 0 if found else 1
    tokens = f"{args.seq_length:,} tokens"
    if args.mean_document_length is not None:
        tokens += f" (documents of mean {args.mean_document_length:,})"
    print(
        f"{args.model} at {tokens} on {args.num_devices} x {hardware.name} with {format_bytes(device_memory)}: "
        f"{len(found)} layouts fit; best {len(shown)} by predicted step time:"
    )
    for rank, candidate in enumerate(shown, 1):
        print(format_candidate(rank, candidate))
    if rows is not None:
        print("\n" + format_sensitivity(rows))
    if not found:
        print(
            "nothing fits: add devices, a longer pipeline or context parallelism, or recompute"
            + (
                " (ZeRO-3 with Megatron-FSDP was tried too"
                + (
                    "; host offload too)"
                    if args.offload
                    else "; host offload was not: drop --no-offload)"
                )
                if args.distributed_optimizer
                else ", or ZeRO-3 (drop --no-distributed-optimizer)"
            )
        )
        if gap is not None:
            print(format_gap(gap))
    return 0 if found else 1


def _compare(args, model: ModelShape, dtype_bytes: int) -> int:
    lengths = (
        [_seq(x) for x in args.seq_lengths.split(",")]
        if args.seq_lengths
        else list(DEFAULT_SEQ_LENGTHS)
    )
    rows = compare_standard(
        model,
        lengths,
        micro_batch_size=args.micro_batch_size,
        tp=args.tp,
        cp=args.cp,
        sequence_parallel=args.sequence_parallel,
        profile=args.profile,
        dtype_bytes=dtype_bytes,
        attention_dropout=args.attention_dropout,
    )
    if args.json:
        print(
            json.dumps({"model": args.model, "tp": args.tp, "cp": args.cp, "rows": rows}, indent=2)
        )
    else:
        print(format_compare(rows, model, args.micro_batch_size, args.tp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
