"""``mcore-flash plan``: per-device memory of a layout, a layout search, standard vs fused.

    mcore-flash plan --model llama2-70b --seq-length 131072 --tp 8 --pp 2 --cp 16 \
        --num-devices 256 --recompute attention --sequence-parallel --use-distributed-optimizer [--json]
    mcore-flash plan --search --num-devices 256 --device-memory 64GB [--top 5]
    mcore-flash plan --longest --model llama3.1-70b --num-devices 8
    mcore-flash plan --num-devices 256 --from-pretrain-args <mcore-flash pretrain's flags>
    mcore-flash plan --compare-standard --model llama2-7b [--tp 1]

:func:`main` (``argv`` -> exit status) resolves ``--model``, ``--hardware`` and the sizes
once (:func:`resolve`) and prints a layout's plan with its predicted step time on
``--hardware`` (:mod:`.step_time`), the search's fitting layouts ranked by that step time,
or the standard vs fused comparison: text, or JSON with ``--json``. Exit status: 0; 1 when
the layout does not fit or the search finds nothing; 2 on an argument it refuses (the
message names the flag). The flags and their defaults are the trainer's where it has them
(:mod:`.plan_flags`). What each flag plans (packed documents, Megatron-FSDP, sequence
tiling, host offload and the search's climb to them, bf16 main gradients and host moments,
``--sensitivity``):
docs/planner.md, docs/step-time.md and ``--help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, NamedTuple, Optional

from .compare import DEFAULT_SEQ_LENGTHS, compare_standard
from .flops import check_mean_document_length
from .fsdp import PLANNED_STRATEGIES
from .hardware import HardwareProfile, load_hardware
from .longest import longest_sequence
from .memory import plan_memory
from .models import ModelShape, get_model
from .parallel_layout import Layout
from .plan_flags import (
    DTYPE_BYTES,
    build_parser,
    data_parallel_size,
    fill_defaults,
    fsdp_strategy,
    given_run_flags,
    host_moment_dtype,
    offload_fraction,
    resolve_flags,
    seq_tokens,
    stream_weights,
    tiles,
)
from .recipes import PlannedRun
from .report import (
    format_candidate,
    format_compare,
    format_gap,
    format_plan,
    format_search_header,
    format_sensitivity,
    format_step_time,
    launch_line,
)
from .search import (
    Candidate,
    closest_offload,
    default_global_batch_size,
    search_layouts,
    sensitivity,
)
from .step_time import predict_step_time
from .units import MiB, format_bytes, parse_bytes

# ``plan --from-pretrain-args``: the trainer's parser, given by the ``mcore-flash`` command
# (a layer above the planner): (its flags, world size or None) -> the run it would build
PretrainReader = Callable[[list, Optional[int]], PlannedRun]


class Inputs(NamedTuple):
    """What ``plan``'s name and size flags say, resolved once at the edge."""

    model: ModelShape  # --model
    hardware: HardwareProfile  # --hardware, with --hccl-buffsize's communicator buffers
    device_memory: int  # --device-memory, bytes (default the profile's capacity)
    min_free_memory: Optional[int]  # --min-free-memory, bytes (None: each plan's default)
    dtype_bytes: int  # --dtype: bytes per parameter and activation element


def resolve_args(args) -> Inputs:
    """Parsed ``args`` (not ``--from-pretrain-args``) resolved in place into the planner's terms
    (:func:`.plan_flags.resolve_flags`, the run's defaults filled), and their typed inputs."""
    fill_defaults(args)
    inputs = resolve(args)
    resolve_flags(args, inputs.model.num_layers, search=args.search or args.longest)
    return inputs


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


def _min_free_memory(value: Optional[str], device_memory: int) -> Optional[int]:
    """``--min-free-memory``: a size, or a share of ``device_memory`` ("5%"), in bytes; None
    when not given (each plan's default, :func:`.memory.default_min_free_memory`)."""
    if value is None:
        return None
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


def main(argv: Optional[list[str]] = None, pretrain_reader: Optional[PretrainReader] = None) -> int:
    """``mcore-flash plan ARGV``; ``pretrain_reader`` reads ``--from-pretrain-args``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.from_pretrain_args is not None:
            return _plan_pretrain_args(args, pretrain_reader)
        inputs = resolve_args(args)
        if args.compare_standard and args.mean_document_length is not None:
            raise ValueError(
                "--mean-document-length changes FLOPs, not the saved bytes --compare-standard compares; drop it"
            )
        check_mean_document_length(args.seq_length, args.mean_document_length)
        if args.compare_standard:
            return _compare(args, inputs.model, inputs.dtype_bytes)
        if (args.search or args.longest) and args.num_devices is None:
            parser.error(f"{'--search' if args.search else '--longest'} needs --num-devices")
        if args.longest:
            return _longest(args, inputs)
        if args.search:
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
    dp = data_parallel_size(args)
    loss_chunk_size, mlp_chunk_size = tiles(args)
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
        fsdp=fsdp_strategy(args),
        optimizer_offload_fraction=offload_fraction(args),
        activation_offload_layers=args.activation_offload_layers,
        overlap_cpu_optimizer=args.overlap_cpu_optimizer,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        host_moment_dtype=host_moment_dtype(args),
        overlap_grad_reduce=args.overlap_grad_reduce,
        loss_chunk_size=loss_chunk_size,
        mlp_chunk_size=mlp_chunk_size,
        stream_weights=stream_weights(args),
    )
    return _print_plan(args, inputs, args.seq_length, layout)


def _plan_pretrain_args(args, pretrain_reader: Optional[PretrainReader]) -> int:
    """``plan [OPTIONS] --from-pretrain-args FLAGS``: the plan of the run the trainer builds
    from ``FLAGS`` (its model shape, layout, precision, hardware and device memory)."""
    if pretrain_reader is None:
        raise ValueError(
            "--from-pretrain-args reads the trainer's flags: run it as `mcore-flash plan`"
        )
    given = given_run_flags(args)
    if given:
        raise ValueError(
            f"{', '.join(given)} before --from-pretrain-args: the trainer's flags say what the run is; give "
            "them after --from-pretrain-args as pretrain takes them (or drop them)"
        )
    run = pretrain_reader(args.from_pretrain_args, args.num_devices)
    hardware = _with_hccl_buffsize(run.hardware, args.hccl_buffsize)
    inputs = Inputs(
        model=run.model,
        hardware=hardware,
        device_memory=run.device_memory,
        min_free_memory=_min_free_memory(args.min_free_memory, run.device_memory),
        dtype_bytes=run.dtype_bytes,
    )
    check_mean_document_length(run.seq_length, args.mean_document_length)
    return _print_plan(args, inputs, run.seq_length, run.layout)


def _print_plan(args, inputs: Inputs, seq_length: int, layout: Layout) -> int:
    """Print (or ``--json``) the plan of ``layout`` with its step time and launch line;
    0 when it fits, 1 when not."""
    model, hardware, device_memory, _, dtype_bytes = inputs
    if layout.grad_reduce_in_bf16 and dtype_bytes != 2:
        raise ValueError("--grad-reduce-in-bf16 needs --bf16 (--dtype bf16)")
    plan = plan_memory(
        model,
        seq_length,
        layout,
        device_memory=device_memory,
        hardware=hardware,
        **_plan_kwargs(args, inputs),
    )
    step = predict_step_time(
        model,
        seq_length,
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
    loss_chunk_size, mlp_chunk_size = tiles(args)
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
        fsdp_choices=(fsdp_strategy(args),) if args.use_megatron_fsdp else PLANNED_STRATEGIES,
        climb="each" if args.use_megatron_fsdp else "needed",
        offload=args.offload,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        host_moment_dtype=host_moment_dtype(args),
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
    print(
        format_search_header(
            args.model,
            args.seq_length,
            args.mean_document_length,
            f"{args.num_devices} x {hardware.name} with {format_bytes(device_memory)}",
            len(found),
            len(shown),
        )
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
                    "; host offload and weight streaming too)"
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


def _longest(args, inputs: Inputs) -> int:
    """``plan --longest``: the longest multiple of ``--longest-step`` tokens that
    ``--num-devices`` train (:func:`.longest.longest_sequence` over the search), with its
    fastest layout; 1 when not even one step fits."""

    def search(seq_length: int) -> list[Candidate]:
        return search_candidates(
            argparse.Namespace(**{**vars(args), "seq_length": seq_length}), inputs
        )

    def progress(seq_length: int, found: int) -> None:
        verdict = {0: "nothing fits", 1: "1 layout fits"}.get(found, f"{found} layouts fit")
        print(f"[plan --longest] {seq_length:,} tokens: {verdict}", file=sys.stderr, flush=True)

    found = longest_sequence(search, args.longest_step, progress=progress)
    devices = (
        f"{args.num_devices} x {inputs.hardware.name} with {format_bytes(inputs.device_memory)}"
    )
    beyond = "the limit" if found.beyond is None else f"{found.beyond:,} does not"
    if args.json:
        best = found.candidates[0].to_dict() if found.candidates else None
        out = {"seq_length": found.seq_length, "beyond": found.beyond, "step": args.longest_step}
        print(json.dumps({**out, "layout": best}, indent=2))
    elif not found.seq_length:
        print(f"{args.model} on {devices}: not even {args.longest_step:,} tokens fit")
    else:
        print(
            f"{args.model} on {devices}: the longest sequence that fits is {found.seq_length:,} tokens "
            f"(multiples of {args.longest_step:,}; {beyond}); its fastest layout:"
        )
        print(format_candidate(1, found.candidates[0]))
    return 0 if found.seq_length else 1


def _compare(args, model: ModelShape, dtype_bytes: int) -> int:
    lengths = (
        [seq_tokens(x) for x in args.seq_lengths.split(",")]
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
