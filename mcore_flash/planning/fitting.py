"""One layout up the memory ladder: the least partial recompute, Megatron-FSDP strategy or
host offload that makes it fit (:func:`climb_layout`; :mod:`.search` climbs every layout of
a device count).

A selective recompute mode that does not fit is retried with the fewest layers per
pipeline chunk recomputed whole that make it fit (``Layout.recompute_num_layers``:
recompute just enough, by bisection); one that still does not fit with each Megatron-FSDP
strategy it is given, or with the least host offload that fits: the least optimizer
offload fraction of :data:`OFFLOAD_FRACTIONS`, else the whole optimizer and the fewest
activation-offloaded layers per stage (:func:`least_offload`); on the streaming rung its
weights streamed from the host with the fewest activation-offloaded layers
(:func:`least_streaming`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

from .hardware import HOST_FIELDS, HardwareProfile
from .memory import plan_memory
from .models import ModelShape
from .parallel_layout import Layout
from .plans import MemoryPlan

__all__ = [
    "OFFLOAD_FRACTIONS",
    "climb_layout",
    "knows_host",
    "least_offload",
    "least_streaming",
    "replanned",
]

# the optimizer offload fractions the offload rung tries, least first
OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def _just_enough_recompute(
    plan: MemoryPlan, partial_recompute: bool, plan_kwargs: dict
) -> MemoryPlan:
    """``plan``, or when it does not fit and may, its least partial recompute that fits."""
    if not plan.fits and partial_recompute and plan.layout.recompute != "full":
        return _least_partial_recompute(plan, plan_kwargs) or plan
    return plan


def climb_layout(
    model: ModelShape,
    seq_length: int,
    layout: Layout,
    device_memory: int,
    partial_recompute: bool,
    fsdp_choices: Sequence[str],
    plan_kwargs: dict,
    host_offload: bool = False,
    moments: str = "fp32",
    streaming: bool = False,
) -> list[MemoryPlan]:
    """The plans of ``layout`` up the ladder: itself (with just enough partial recompute);
    if that does not fit, one plan per FSDP strategy of ``fsdp_choices`` (dp x cp > 1),
    each with just enough partial recompute, or with ``host_offload`` its least host
    offload that fits (:func:`least_offload`, host moments in ``moments``), or with
    ``streaming`` its weights streamed (:func:`least_streaming`), keeping the non-fitting
    first plan only when nothing fits either."""
    plan = _just_enough_recompute(
        plan_memory(model, seq_length, layout, device_memory=device_memory, **plan_kwargs),
        partial_recompute,
        plan_kwargs,
    )
    if (
        not plan.fits
        and streaming
        and layout.pp == 1  # the trainer runs FSDP2 at --pipeline-model-parallel-size 1
        and layout.fsdp is None
        and model.untie_embeddings_and_output_weights
        and knows_host(plan_kwargs["hardware"])
    ):
        return [least_streaming(plan, plan_kwargs) or plan]
    if (
        not plan.fits
        and host_offload
        and layout.distributed_optimizer
        and layout.fsdp is None
        and layout.vp == 1  # the trainer refuses the offloads with the interleaved schedule
        and knows_host(plan_kwargs["hardware"])
    ):
        return [least_offload(plan, plan_kwargs, moments) or plan]
    if (
        plan.fits
        or layout.sharding_ranks == 1
        or layout.fsdp is not None
        or not layout.distributed_optimizer
        or layout.pp > 1  # the trainer runs Megatron-FSDP at --pipeline-model-parallel-size 1
    ):
        return [plan]
    sharded = [
        _just_enough_recompute(
            plan_memory(
                model,
                seq_length,
                replace(layout, fsdp=strategy),
                device_memory=device_memory,
                **plan_kwargs,
            ),
            partial_recompute,
            plan_kwargs,
        )
        for strategy in fsdp_choices
    ]
    fitting = [p for p in sharded if p.fits]
    return fitting or [plan]


def knows_host(hardware: HardwareProfile) -> bool:
    """Whether ``hardware`` gives every host figure offload is planned with."""
    return all(getattr(hardware, name) is not None for name in HOST_FIELDS)


def least_offload(
    plan: MemoryPlan, plan_kwargs: dict, moments: str = "fp32"
) -> Optional[MemoryPlan]:
    """The fitting plan of ``plan``'s layout with the least host offload, Adam's host moments
    in ``moments``: the least optimizer offload fraction of :data:`OFFLOAD_FRACTIONS` (bf16
    moments: the whole optimizer only), else the whole optimizer and the fewest
    activation-offloaded layers per stage (device bytes fall as that number grows:
    bisection; an offloaded layer's MLP tiles are parked with the rest of it); None when
    even every layer offloaded does not fit (or the host cannot hold the optimizer)."""

    def planned(fraction: float, layers: int) -> MemoryPlan:
        return replanned(
            plan,
            plan_kwargs,
            optimizer_offload_fraction=fraction,
            activation_offload_layers=layers,
            host_moment_dtype=moments,
        )

    fractions = OFFLOAD_FRACTIONS if moments == "fp32" else (1.0,)
    for fraction in fractions:
        candidate = planned(fraction, 0)
        if candidate.fits:
            return candidate
        if candidate.host.fits is False:  # more offload only needs more host
            return None
    return _fewest_offloaded_layers(
        lambda layers: planned(1.0, layers), plan.model.num_layers // plan.layout.pp
    )


def least_streaming(plan: MemoryPlan, plan_kwargs: dict) -> Optional[MemoryPlan]:
    """The fitting plan of ``plan``'s layout (PP1) with its weights, gradients and optimizer
    state streamed from the host (``Layout.stream_weights``: FSDP2 with CPU offload, no
    distributed optimizer, fp32 gradients and moments, no optimizer offload) and the fewest
    activation-offloaded layers (none first); None when even every layer offloaded does not
    fit, or the host cannot hold the model's state."""

    def planned(layers: int) -> MemoryPlan:
        return replanned(
            plan,
            plan_kwargs,
            stream_weights=True,
            distributed_optimizer=False,
            grad_reduce_in_bf16=False,
            optimizer_offload_fraction=0.0,
            overlap_cpu_optimizer=False,
            host_moment_dtype="fp32",
            activation_offload_layers=layers,
        )

    candidate = planned(0)
    if candidate.fits:
        return candidate
    if candidate.host.fits is False:
        return None
    return _fewest_offloaded_layers(planned, plan.model.num_layers)


def _fewest_offloaded_layers(
    planned: Callable[[int], MemoryPlan], layers: int
) -> Optional[MemoryPlan]:
    """The fitting plan ``planned(n)`` with the fewest activation-offloaded layers ``n`` in
    ``1..layers`` (device bytes fall as ``n`` grows, host bytes rise: bisection), or None."""
    best, low, high = None, 1, layers
    while low <= high:
        mid = (low + high) // 2
        candidate = planned(mid)
        if candidate.fits:
            best, high = candidate, mid - 1
        elif candidate.device_fits:  # the host is full: more layers only add to it
            return best
        else:
            low = mid + 1
    return best


def replanned(plan: MemoryPlan, plan_kwargs: dict, **changes) -> MemoryPlan:
    """``plan`` again (with the plan keywords ``plan_kwargs``), its layout's fields ``changes``."""
    return plan_memory(
        plan.model,
        plan.seq_length,
        replace(plan.layout, **changes),
        device_memory=plan.device_memory,
        **plan_kwargs,
    )


def _least_partial_recompute(plan: MemoryPlan, plan_kwargs: dict) -> Optional[MemoryPlan]:
    """The fitting plan with the fewest layers per chunk recomputed whole (bytes fall as
    that number grows: bisection), or None if even all but one do not fit."""
    lay = plan.layout
    best, low, high = None, 1, lay.chunk_layers(plan.model.num_layers) - 1
    while low <= high:
        mid = (low + high) // 2
        candidate = plan_memory(
            plan.model,
            plan.seq_length,
            replace(lay, recompute_num_layers=mid),
            device_memory=plan.device_memory,
            **plan_kwargs,
        )
        if candidate.fits:
            best, high = candidate, mid - 1
        else:
            low = mid + 1
    return best
