"""Plans as text: what ``mcore-flash plan`` (and ``pretrain --dry-run``) prints.

The data classes (:class:`.memory.MemoryPlan`, :class:`.step_time.StepTime`,
:class:`.search.Candidate`) hold numbers and their JSON form (``to_dict``); the words and
tables are made here.
"""

from __future__ import annotations

from typing import Optional

from . import activation_bytes as act
from .models import ModelShape
from .parallel_layout import Layout, offload_text, recompute_text, shape_flags, tiling_text
from .plans import ESTIMATED_CATEGORIES, OFFLOAD_CATEGORIES, MemoryPlan, launch_command
from .search import Candidate, OffloadGap
from .step_time import (
    BREAKDOWN_KEYS,
    FSDP_BREAKDOWN_KEYS,
    OFFLOAD_BREAKDOWN_KEYS,
    TILING_BREAKDOWN_KEYS,
    StepTime,
)
from .units import format_bytes

__all__ = [
    "verdict",
    "documents_line",
    "format_plan",
    "sharding_text",
    "format_step_time",
    "format_candidate",
    "format_compare",
    "format_host",
    "format_sensitivity",
    "format_gap",
]


def verdict(plan: MemoryPlan) -> str:
    """``FITS`` / ``DOES NOT FIT`` with the bytes needed, available and left (or over)."""
    if plan.device_memory is None:
        return f"needs {format_bytes(plan.total)} per device (no --device-memory given)"
    word = "FITS" if plan.fits else "DOES NOT FIT"
    sign = "free" if plan.headroom >= 0 else "over"
    text = (
        f"{word}: {format_bytes(plan.total)} of {format_bytes(plan.device_memory)} per device "
        f"({format_bytes(abs(plan.headroom))} {sign}"
        + (
            f"; at least {format_bytes(plan.min_free_memory)} to keep free, --min-free-memory)"
            if plan.min_free_memory
            else ")"
        )
    )
    host = plan.host
    if host is not None and host.fits is not None and (plan.layout.offloads or not host.fits):
        text += (
            f"; host {format_bytes(host.per_node)} of {format_bytes(host.host_memory)} per node "
            f"({format_bytes(abs(host.headroom))} {'free' if host.fits else 'over'})"
        )
    return text


def documents_line(plan: MemoryPlan) -> str:
    """The packed documents (mean tokens each) and their attention-kernel FLOPs relative
    to one document per sequence (``mean_document_length / seq_length``)."""
    return (
        f"documents: packed, mean {plan.mean_document_length:,} tokens (document masking): attention-kernel "
        f"FLOPs x {plan.mean_document_length / plan.seq_length:.4g} of one document per sequence"
    )


def format_plan(plan: MemoryPlan, launch: Optional[str] = None) -> str:
    """The plan's breakdown: model and layout, per-layer activations by module, the worst
    stage's bytes by category, overheads, the verdict, notes and ``launch`` (default the
    plan's launch command)."""
    lay, model = plan.layout, plan.model
    lines = [
        f"{' '.join([model.name, *shape_flags(model)])}: {plan.total_parameters:,} parameters; seq {plan.seq_length:,}, micro-batch "
        f"{lay.micro_batch_size}, activations {plan.dtype_bytes} B ({plan.profile} profile)",
        f"layout: TP{lay.tp}{' SP' if lay.sp else ''} x PP{lay.pp}"
        f"{f' (v={lay.vp})' if lay.vp > 1 else ''} x CP{lay.cp} x DP{lay.dp} = {lay.num_devices} devices; "
        f"recompute {recompute_text(lay, model.num_layers)}; "
        f"{_optimizer_text(lay)} optimizer; "
        f"{'bf16 main gradients (--grad-reduce-in-bf16); ' if lay.grad_reduce_in_bf16 else ''}"
        f"{sharding_text(lay)}"
        f"{f'{tiling_text(lay)}; ' if lay.tiled else ''}"
        f"micro-batches/step {lay.num_microbatches or 'n/a'}",
        "",
        f"per-layer activations (one micro-batch, this device{', layers not recomputed whole' if lay.recompute_num_layers else ''}): "
        f"{format_bytes(plan.layer_bytes)}",
    ]
    if plan.mean_document_length is not None:
        lines.insert(1, documents_line(plan))
    for module, nbytes in act.by_module(plan.layer_terms).items():
        lines.append(f"  {module:<36} {format_bytes(nbytes):>12}")
    worst = plan.worst_stage
    lines += [
        "",
        f"per device (stage {worst.stage} of {lay.pp}: {worst.layers} layers, {worst.in_flight} in flight, "
        f"{worst.parameters:,} parameters):",
    ]
    for name in plan.categories:
        estimated = ESTIMATED_CATEGORIES + OFFLOAD_CATEGORIES
        mark = "  (estimate)" if name in estimated else ""
        lines.append(f"  {name:<26} {format_bytes(worst.bytes[name]):>12}{mark}")
    lines.append(f"  {'total':<26} {format_bytes(worst.total):>12}")
    if lay.pp > 1:
        lines.append(
            "stages: " + ", ".join(f"{st.stage}: {format_bytes(st.total)}" for st in plan.stages)
        )
    if lay.offloads and plan.host is not None:
        lines += ["", format_host(plan)]
    lines += [
        "",
        f"compute overhead: recompute +{plan.recompute_overhead:.1%}, pipeline bubble +{plan.pipeline_bubble:.1%}",
        verdict(plan),
    ]
    lines += [f"note: {note}" for note in plan.notes]
    lines += ["", "launch: " + (launch_command(plan) if launch is None else launch)]
    return "\n".join(lines)


def format_host(plan: MemoryPlan) -> str:
    """The fullest node's host bytes by category (host offload)."""
    host = plan.host
    lines = [f"host per node ({host.ranks_per_node} ranks; {offload_text(plan.layout)}):"]
    for name, nbytes in {**host.by_category, "host_reserved": host.reserved}.items():
        mark = "  (assumption)" if name in ("host_runtime", "host_reserved") else ""
        lines.append(f"  {name:<26} {format_bytes(nbytes):>12}{mark}")
    lines.append(f"  {'total':<26} {format_bytes(host.per_node):>12}")
    return "\n".join(lines)


def format_sensitivity(rows: list[dict]) -> str:
    """:func:`.search.sensitivity`'s rows: per assumed figure and factor, the change of the
    predicted tokens/s per device and whether the plan still fits."""
    lines = ["sensitivity (each assumed hardware figure scaled; tokens/s per device, fit):"]
    for r in rows:
        fits = {True: "fits", False: "DOES NOT FIT", None: "-"}[r["fits"]]
        lines.append(
            f"  {r['field']:<30} x{r['factor']:<4g} {r['tokens_per_s_change']:>+8.1%}  {fits}"
        )
    return "\n".join(lines)


def format_gap(gap: OffloadGap) -> str:
    """Why nothing fits with all host offload and what would close the gap."""
    lay, plan = gap.plan.layout, gap.plan
    lines = [
        f"closest with everything offloaded: TP{lay.tp} PP{lay.pp} CP{lay.cp} DP{lay.dp}, recompute "
        f"{recompute_text(lay, plan.model.num_layers)}, {offload_text(lay)}: "
        f"{format_bytes(plan.total)} per device ({format_bytes(abs(gap.device_over))} "
        f"{'over' if gap.device_over > 0 else 'free'}), host {format_bytes(plan.host.per_node)} per node "
        f"({format_bytes(abs(gap.host_over))} {'over' if gap.host_over > 0 else 'free'})"
    ]
    if gap.device_over > 0:
        bf16 = gap.bf16_gradients
        lines.append(
            f"with bf16 main gradients (--grad-reduce-in-bf16, which the search tried too): "
            f"{format_bytes(bf16.total)} per device ({'fits' if bf16.device_fits else 'still over'}); "
            "closes the device gap: more devices"
        )
    if gap.host_over > 0:
        narrow = gap.narrow_state.host
        lines.append(
            f"closes the host gap: {format_bytes(plan.host.per_node)} of host memory per node (--host-memory); "
            f"with bf16 main gradients and bf16 host moments (--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16, "
            f"which the search tried too): {format_bytes(narrow.per_node)} per node "
            f"({'fits' if narrow.fits else 'still over'})"
        )
    return "\n".join(lines)


def sharding_text(layout) -> str:
    """``"Megatron-FSDP <strategy> over <dp*cp> ranks (ZeRO-3); "`` for an FSDP layout, else empty."""
    if layout.fsdp is None:
        return ""
    return f"Megatron-FSDP {layout.fsdp} over {layout.sharding_ranks} ranks (ZeRO-3); "


def _optimizer_text(layout: Layout) -> str:
    """Where the layout's optimizer state lives, in a word or three."""
    if layout.stream_weights:
        return "host-sharded (FSDP2 streaming)"
    return "distributed" if layout.distributed_optimizer else "replicated"


def format_step_time(step: StepTime) -> str:
    """A headline (step time, tokens/s per device, MFU on which devices), then one line per
    non-zero part of the breakdown (seconds and share of the step) and the assumptions it
    rests on: with host offload or streaming the host link's bandwidth and the host
    optimizer's speed, with sequence tiling the tiles' GEMM efficiency."""
    total, hw = step.step_time_s, step.hardware
    devices = (
        f"{step.layout.num_devices} x {hw.name} ({hw.peak_bf16_tflops:g} TFLOP/s peak x "
        f"{hw.achievable_fraction:g} achievable)"
    )
    lines = [
        f"step time on {devices}: {total:.3f} s; {step.tokens_per_s_per_device:,.0f} tokens/s per "
        f"device; MFU {step.mfu:.1%} (Megatron convention {step.mfu_megatron:.1%})",
    ]
    after_logits = BREAKDOWN_KEYS.index("logits") + 1  # the tiles' parts follow the logits
    keys = BREAKDOWN_KEYS[:after_logits] + TILING_BREAKDOWN_KEYS + BREAKDOWN_KEYS[after_logits:]
    for key in keys + FSDP_BREAKDOWN_KEYS + OFFLOAD_BREAKDOWN_KEYS:
        seconds = step.breakdown.get(key, 0.0)
        if seconds:
            lines.append(f"  {key:<26} {seconds:>10.3f} s  {seconds / total:>6.1%}")
    if any(key in step.breakdown for key in OFFLOAD_BREAKDOWN_KEYS):
        lines.append(
            f"  assumption: host-device copies at {hw.host_device_bandwidth / 1e9:g} GB/s "
            f"(host_device_bandwidth), the host's Adam step (and a streamed run's gradient adds) at "
            f"{hw.host_optimizer_elements_per_s:g} parameters/s per node "
            "(host_optimizer_elements_per_s); not measured, --sensitivity"
        )
    if "tile_efficiency" in step.details:
        lines.append(
            f"  assumption: the tiles' GEMMs at {step.details['tile_efficiency']:g} x the untiled speed "
            "(tile_efficiency, not measured; --sensitivity)"
        )
    return "\n".join(lines)


def launch_line(candidate: Candidate) -> str:
    """The candidate's launch command with the environment it exports (``NAME=value ...``)."""
    env = " ".join(f"{name}={value}" for name, value in candidate.launch_env.items())
    return f"{env} {candidate.launch_command}" if env else candidate.launch_command


def format_search_header(
    model: str,
    seq_length: int,
    mean_document_length: Optional[float],
    devices: str,
    found: int,
    shown: int,
) -> str:
    """``plan --search``'s first line: what was searched on ``devices`` (text), how many
    layouts fit (``found``) and how many follow (``shown``), fastest predicted step first."""
    tokens = f"{seq_length:,} tokens"
    if mean_document_length is not None:
        tokens += f" (documents of mean {mean_document_length:,})"
    if found == 0:
        verdict = "no layout fits"
    elif found == 1:
        verdict = "1 layout fits:"
    elif shown == found:
        verdict = f"{found} layouts fit, fastest predicted step first:"
    elif shown == 1:
        verdict = f"{found} layouts fit; the one with the fastest predicted step:"
    else:
        verdict = (
            f"{found} layouts fit; the {shown} with the fastest predicted step, fastest first:"
        )
    return f"{model} at {tokens} on {devices}: {verdict}"


def format_candidate(rank: int, candidate: Candidate) -> str:
    """One ranked layout of ``mcore-flash plan --search``: its summary line, its step-time
    breakdown, its notes and its launch command."""
    plan, step, lay = candidate.plan, candidate.step, candidate.plan.layout
    lines = [
        f"\n{rank}. TP{lay.tp}{' SP' if lay.sp else ''} PP{lay.pp}{f' v{lay.vp}' if lay.vp > 1 else ''} "
        f"CP{lay.cp} DP{lay.dp}, recompute {recompute_text(lay, plan.model.num_layers)}"
        f"{f', Megatron-FSDP {lay.fsdp}' if lay.fsdp else ''}"
        f"{f', {tiling_text(lay)}' if lay.tiled else ''}"
        f"{f', {offload_text(lay)}' if offload_text(lay) else ''} (rung: {candidate.rung}): "
        f"{step.step_time_s:.2f} s per step, "
        f"{step.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {step.mfu:.1%}; "
        f"{format_bytes(plan.total)} per device ({format_bytes(plan.headroom)} free); recompute "
        f"+{plan.recompute_overhead:.1%}, bubble +{plan.pipeline_bubble:.1%} ({lay.num_microbatches} micro-batches)"
        + (
            f"; host {format_bytes(plan.host.per_node)} per node ({format_bytes(plan.host.headroom)} free)"
            if lay.offloads and plan.host is not None
            else ""
        )
    ]
    lines += ["  " + line for line in format_step_time(step).splitlines()[1:]]
    lines += [f"   note: {note}" for note in plan.notes]
    lines.append(f"   {launch_line(candidate)}")
    return "\n".join(lines)


def format_compare(
    rows: list[dict], model: ModelShape, micro_batch_size: int, tp: int, heads: Optional[int] = None
) -> str:
    """The table of :func:`.compare.compare_standard`'s ``rows`` (bytes per device by
    sequence length); ``heads`` per device defaults to ``num_attention_heads / tp``."""
    heads = heads or model.num_attention_heads // tp
    lines = [
        f"{model.name}: standard vs fused attention, saved for backward per device "
        f"(b={micro_batch_size}, {heads} heads per device, {model.num_layers} layers)",
        f"{'seq':>7} {'[b,h,s,s] tensor':>17} {'core attn std':>14} {'core attn fused':>16} "
        f"{'layer std':>11} {'layer fused':>12} {'all layers std':>15} {'all fused':>11} {'ratio':>7}",
    ]
    for r in rows:
        seq = r["seq_length"]
        label = f"{seq // 1024}K" if seq % 1024 == 0 else str(seq)
        lines.append(
            f"{label:>7} {format_bytes(r['scores_bytes']):>17} {format_bytes(r['standard_core_attention_bytes']):>14} "
            f"{format_bytes(r['fused_core_attention_bytes']):>16} {format_bytes(r['standard_layer_bytes']):>11} "
            f"{format_bytes(r['fused_layer_bytes']):>12} {format_bytes(r['standard_all_layers_bytes']):>15} "
            f"{format_bytes(r['fused_all_layers_bytes']):>11} {r['ratio']:>6.1f}x"
        )
    return "\n".join(lines)
