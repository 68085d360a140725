"""Megatron DDP's device and host bytes of weights, gradients and optimizer state, per rank.

Optimizer offload and bf16 main gradients with the distributed optimizer (megatron's DDP) are
counted exactly, per data-parallel rank (:func:`rank_shards`, :func:`ddp_state_bytes`,
:func:`ddp_host_bytes`; tests/emulation/test_offload_memory.py measures them on the emulated
NPU): megatron's buffer layout (:func:`.parameters.ddp_buffer`: padded buffers, each rank's
shard), the optimizer's parameter order, and ``HybridDeviceOptimizer`` moving whole
parameters to the host in that order while the offloaded elements are below ``F`` x the
rank's shard; a plan's ``weights``, ``gradients`` and ``optimizer_state`` are then the worst
rank's (:func:`exact_ddp_stage`). Without offload and bf16 gradients the plan's DDP rows count
parameters (``P``, ``12 P / (dp cp)``), not the padded buffers
(:func:`device_gradient_bytes`).

The host side of the offloaded optimizer, per rank: ``host_optimizer_state`` = 12 B (fp32
master, Adam m, v) per offloaded shard element and the 4-byte step counter of each offloaded
parameter, ``host_gradient_copy`` = 4 B (megatron's pinned fp32 copy of the gradient,
``pin_cpu_grads``) per offloaded element (the rank's own: a node sums its ranks',
:mod:`.host_offload`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from .models import ModelShape
from .parallel_layout import HOST_MOMENT_BYTES, Layout
from .parameters import optimizer_order, stage_ddp_buffers
from .units import BF16_BYTES, FP32_BYTES

__all__ = [
    "device_gradient_bytes",
    "main_gradient_bytes",
    "RankShard",
    "rank_shards",
    "offloaded_parameters",
    "ddp_state_bytes",
    "ddp_host_bytes",
    "exact_ddp_state",
    "exact_ddp_stage",
]

HOST_MASTER_BYTES = 4  # the fp32 master copy per offloaded element (Adam's m, v: HOST_MOMENT_BYTES)
HOST_GRADIENT_BYTES = 4  # megatron's pinned fp32 gradient copy per offloaded element
ADAM_MOMENT_BYTES = 8  # Adam's exp_avg + exp_avg_sq, fp32, per element
STEP_COUNTER_BYTES = 4  # torch AdamW's 0-dim fp32 "step" per parameter (fused: on its device)


def main_gradient_bytes(layout: Layout) -> int:
    """Bytes per element of the main-gradient buffer: 2 with ``--grad-reduce-in-bf16``, else 4."""
    return BF16_BYTES if layout.grad_reduce_in_bf16 else FP32_BYTES


def device_gradient_bytes(parameters: int, layout: Layout) -> int:
    """The device's gradient bytes of ``parameters`` elements (one stage, one TP rank) under
    megatron's DDP: the gradient buffer, 4 B/element (fp32), or with bf16 main gradients
    2 B/element plus the fp32 gradients the optimizer gives the part of its fp32 master
    shard kept on the device (megatron's ``_copy_model_grads_to_main_grads``): 4 B x
    ``S (1 - F)``, ``S = parameters / (dp * cp)`` with the distributed optimizer (else
    ``parameters``), ``F`` the optimizer offload fraction. The plan uses it without the
    distributed optimizer (exact there: no padding, no offload); with it, bf16 gradients
    and offload are counted per rank from megatron's layout (:func:`ddp_state_bytes`)."""
    if not layout.grad_reduce_in_bf16:
        return parameters * FP32_BYTES
    shard = Fraction(parameters, layout.sharding_ranks if layout.distributed_optimizer else 1)
    kept = shard * (1 - Fraction(layout.optimizer_offload_fraction))
    return parameters * BF16_BYTES + int(math.ceil(kept * FP32_BYTES))


@dataclass(frozen=True)
class RankShard:
    """One data x context parallel rank's distributed-optimizer shard of one pipeline stage
    under megatron's DDP: ``buffer_elements`` (the stage's DDP buffers, padding included: what
    the bf16 weights and the main gradients take, the same on every rank), the real
    ``elements`` of its shard in ``parameters`` parameters (shards of), and of those the
    ``offloaded_elements`` in ``offloaded_parameters`` that ``HybridDeviceOptimizer`` keeps on
    the host."""

    rank: int
    buffer_elements: int
    elements: int
    parameters: int
    offloaded_elements: int = 0
    offloaded_parameters: int = 0

    @property
    def kept_elements(self) -> int:
        return self.elements - self.offloaded_elements

    @property
    def kept_parameters(self) -> int:
        return self.parameters - self.offloaded_parameters


def offloaded_parameters(elements: list[int], fraction: float) -> int:
    """How many of a rank's shard parameters (``elements`` each, in the optimizer's order)
    megatron's ``HybridDeviceOptimizer`` moves to the host at offload ``fraction``: whole
    parameters, in order, while the elements moved so far are below ``fraction`` x the shard
    (``_get_sub_optimizer_param_groups``: ``offload_params_numel < offload_threshold``, the
    threshold a float as there)."""
    threshold = sum(elements) * fraction
    moved = count = 0
    for size in elements:
        if not moved < threshold:
            break
        moved += size
        count += 1
    return count


@functools.lru_cache(maxsize=1024)
def rank_shards(
    model: ModelShape,
    tp: int,
    pp: int,
    vp: int,
    stage: int,
    ranks: int,
    fraction: float = 0.0,
    bucket_size: Optional[int] = None,
) -> tuple[RankShard, ...]:
    """Every rank's :class:`RankShard` of pipeline stage ``stage`` over ``ranks`` (dp x cp),
    offloading ``fraction``: megatron's buffers (:func:`.parameters.stage_ddp_buffers`, with
    ``bucket_size``: :attr:`.parallel_layout.Layout.ddp_bucket_size`), each rank's shard, its
    parameters in the optimizer's order (:func:`.parameters.optimizer_order`) and
    :func:`offloaded_parameters` of them."""
    buffers = stage_ddp_buffers(model, tp, pp, vp, stage, ranks, bucket_size)
    per_buffer = [buffer.shards() for buffer in buffers]
    total = sum(buffer.elements for buffer in buffers)
    out = []
    for rank in range(ranks):
        order = [held for _, held in optimizer_order([shards[rank] for shards in per_buffer])]
        moved = offloaded_parameters(order, fraction) if fraction else 0
        out.append(RankShard(rank, total, sum(order), len(order), sum(order[:moved]), moved))
    return tuple(out)


def exact_ddp_state(layout: Layout) -> bool:
    """Whether the plan counts ``layout``'s weights, gradients and optimizer state per rank
    from megatron's buffer layout: the distributed optimizer under DDP with optimizer offload
    or bf16 main gradients (measured exactly on the emulated NPU)."""
    return (
        layout.distributed_optimizer
        and layout.fsdp is None
        and bool(layout.optimizer_offload_fraction or layout.grad_reduce_in_bf16)
    )


def ddp_state_bytes(
    shard: RankShard, layout: Layout, *, param_bytes: int = BF16_BYTES, after_step: bool = True
) -> dict[str, int]:
    """One rank's device bytes of ``weights``, ``gradients`` and ``optimizer_state`` under
    megatron's DDP and distributed optimizer (mixed precision: bf16 parameters, Adam), after
    setup or, ``after_step``, after a step (steady: the plan's).

    ``weights`` / ``gradients``: the padded buffers, ``param_bytes`` and 4 B (2 with
    ``--grad-reduce-in-bf16``) per element. Without offload ``optimizer_state`` is the fp32
    master shard (4 B per shard element after setup) and, after a step, Adam's m and v (8 B);
    with bf16 gradients the optimizer then holds fp32 gradients of its shard (4 B an element,
    ``_copy_model_grads_to_main_grads``: ``grad.float()``), counted in ``gradients``. With
    offload (``HybridDeviceOptimizer``, ``param_update_in_fp32``) the same for the elements
    kept on the device (its fp32 copies, m, v and, with bf16 gradients, ``grad.to(fp32)``)
    plus, after a step, the 4-byte step counter of each kept parameter (torch's fused AdamW
    keeps it on the parameter's device; without offload it is on the host)."""
    kept = shard.kept_elements
    optimizer = FP32_BYTES * kept
    if after_step:
        optimizer += ADAM_MOMENT_BYTES * kept
        if layout.optimizer_offload_fraction:
            optimizer += STEP_COUNTER_BYTES * shard.kept_parameters
    fp32_gradients = FP32_BYTES * kept if layout.grad_reduce_in_bf16 and after_step else 0
    return {
        "weights": shard.buffer_elements * param_bytes,
        "gradients": shard.buffer_elements * main_gradient_bytes(layout) + fp32_gradients,
        "optimizer_state": optimizer,
    }


def ddp_host_bytes(shard: RankShard, moment_dtype: str = "fp32") -> dict[str, int]:
    """One rank's host bytes of its offloaded optimizer: ``host_optimizer_state`` (fp32
    master and Adam's m, v in ``moment_dtype``: 12 B per offloaded element, 8 with bf16
    moments, and each offloaded parameter's 4-byte step) and ``host_gradient_copy`` (the
    pinned fp32 gradient copy, 4 B per offloaded element)."""
    per_element = HOST_MASTER_BYTES + 2 * HOST_MOMENT_BYTES[moment_dtype]
    return {
        "host_optimizer_state": per_element * shard.offloaded_elements
        + STEP_COUNTER_BYTES * shard.offloaded_parameters,
        "host_gradient_copy": HOST_GRADIENT_BYTES * shard.offloaded_elements,
    }


def exact_ddp_stage(
    model: ModelShape,
    layout: Layout,
    stage: int,
    param_bytes: int,
    nbytes: dict[str, int],
    host_bytes: dict[str, int],
) -> tuple[dict[str, int], dict[str, int], tuple[dict[str, int], ...]]:
    """A stage's device bytes with ``weights``, ``gradients`` and ``optimizer_state`` those of
    its worst rank (:func:`ddp_state_bytes`), the host bytes of its fullest rank (with the
    stage's ``host_activations``) and every rank's offloaded optimizer (:func:`ddp_host_bytes`)."""
    worst, rank_host, fullest = _exact_stage_state(
        model,
        layout.tp,
        layout.pp,
        layout.vp,
        stage,
        layout.sharding_ranks,
        float(layout.optimizer_offload_fraction),
        layout.grad_reduce_in_bf16,
        param_bytes,
        layout.host_moment_dtype,
        layout.ddp_bucket_size,
    )
    return {**nbytes, **worst}, {**host_bytes, **fullest}, rank_host


@functools.lru_cache(maxsize=1024)
def _exact_stage_state(
    model: ModelShape,
    tp: int,
    pp: int,
    vp: int,
    stage: int,
    ranks: int,
    fraction: float,
    bf16_gradients: bool,
    param_bytes: int,
    moment_dtype: str,
    bucket_size: Optional[int],
) -> tuple[dict[str, int], tuple[dict[str, int], ...], dict[str, int]]:
    """``(worst rank's device state, every rank's host optimizer, the fullest rank's)`` of
    :func:`exact_ddp_stage` (cached: the search plans the same stage under many
    activation choices; ranks with the same shard sizes computed once)."""
    layout = Layout(
        dp=ranks, optimizer_offload_fraction=fraction, grad_reduce_in_bf16=bf16_gradients
    )
    states: dict[tuple, tuple[dict[str, int], dict[str, int]]] = {}
    rank_host = []
    for shard in rank_shards(model, tp, pp, vp, stage, ranks, fraction, bucket_size):
        key = (
            shard.elements,
            shard.parameters,
            shard.offloaded_elements,
            shard.offloaded_parameters,
        )
        if key not in states:
            device = ddp_state_bytes(shard, layout, param_bytes=param_bytes)
            states[key] = (device, ddp_host_bytes(shard, moment_dtype))
        rank_host.append(states[key][1])
    worst = max((device for device, _ in states.values()), key=lambda d: sum(d.values()))
    fullest = max((host for _, host in states.values()), key=lambda h: sum(h.values()))
    return worst, tuple(rank_host), fullest
