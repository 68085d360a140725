"""Host offload: a stage's device and host bytes of activation offload, and a node's host bytes.

Host offload (``layout.optimizer_offload_fraction``, ``layout.activation_offload_layers``;
the ladder's 5th rung, after sequence tiling): ``optimizer_state`` keeps what the rank does
not offload (:mod:`.ddp_state`); ``activations`` and ``attention_statistics`` keep the layers not
offloaded, and ``activation_offload_buffers`` holds what the offloaded layers add at the
backward's worst moment, from the offload's order of events (:func:`offload_stage_bytes`:
what stays on the device of a parked layer, and an offloaded layer's own copies fetched with
the next one's prefetch where they exceed the layers not offloaded, all freed by then). The
host side, per rank (:data:`.plans.HOST_CATEGORIES`, bytes): ``host_optimizer_state`` and
``host_gradient_copy`` (the offloaded optimizer: :func:`.ddp_state.ddp_host_bytes`);
``host_activations`` = the offloaded layers' host copies x micro-batches in flight;
``host_runtime`` = the profile's ``host_runtime_bytes_per_rank`` (an assumption).
Per node (:func:`host_plan`): the sum over the node's ranks (Megatron's rank order TP, CP,
DP, PP) plus ``host_reserved_bytes``; a plan whose node needs more than ``host_memory``
does not fit.
"""

from __future__ import annotations

from fractions import Fraction
from itertools import accumulate
from typing import Optional

from . import activation_bytes as act
from .hardware import HardwareProfile
from .parallel_layout import Layout
from .plans import HOST_CATEGORIES, HostPlan, StagePlan

__all__ = [
    "offload_stage_bytes",
    "check_offloaded_layers",
    "node_stages",
    "node_ranks",
    "host_plan",
]


def offload_stage_bytes(
    terms: list[act.Term],
    full_terms: list[act.Term],
    layout: Layout,
    layers: int,
    stage: int,
    in_flight: int,
) -> tuple[Fraction, Fraction, Fraction, Fraction]:
    """``(activations, attention statistics, activation_offload_buffers, host_activations)``
    of stage ``stage`` (``layers`` layers, ``in_flight`` micro-batches, 1F1B: the
    trainer refuses the offload with the interleaved schedule) under
    ``--activation-offload-layers N``, from the order of events of
    :mod:`mcore_flash.transformer.activation_offload` (docs/planner.md, "Activation
    offload"). Layer ``i`` keeps ``S_i``, leaves ``R_i`` on the device when parked and
    fetches ``V_i`` back (:func:`.activation_bytes.offloaded_layer`; under partial recompute the
    first ``recompute_num_layers`` layers are recomputed whole; with the tiled MLP the tiles'
    checkpoints hold the MLP input, parked and fetched like the rest: equal to the emulated
    NPU's, tests/emulation/test_tiling_memory.py). Per micro-batch in flight the
    device holds the layers not offloaded, ``sum(S_i, i >= N)`` (``activations`` and
    ``attention_statistics``), and the ``R_i`` of the offloaded ones, plus on stages after the
    first the input of layer 0, which megatron's schedule holds for its own backward
    (parking it frees nothing; under ``qkv`` it is ``R_0`` already). The micro-batch in its
    backward holds at most ``max(tail, max_j phase_j)`` of the kept tensors: ``tail`` =
    ``sum(S_i, i >= N) + sum(R_i, i < N)`` while the layers not offloaded run their backward
    (their tensors are all freed before offloaded layer ``N - 1``'s first unpack fetches it),
    ``phase_j`` = ``sum(R_i, i <= j) + V_j + V_{j-1}`` at offloaded layer ``j``'s first unpack
    (its own copies fetched, layer ``j - 1``'s prefetched; layer ``j + 1``'s freed by its
    backward). ``activation_offload_buffers`` = the ``R_i`` and held inputs of every
    micro-batch in flight + ``max(0, max_j phase_j - tail)``. The forward is left out: there
    layers ``k - 1`` and ``k`` (and the model's hold of layer 0's input) are on the device
    at once, up to one layer input more than the backward's kept tensors, but without the
    recompute's rebuilt activations and the gradients ``recompute_workspace`` adds.
    ``host_activations`` = ``sum(V_i, i < N)`` per micro-batch in flight."""
    n, whole = layout.activation_offload_layers, layout.recompute_num_layers
    recomputed, rest = (
        act.offloaded_layer(full_terms, "full"),
        act.offloaded_layer(terms, layout.recompute),
    )
    offloaded = [recomputed if i < whole else rest for i in range(n)]
    whole_kept = max(0, min(whole, layers) - n)  # layers kept on the device, recomputed whole
    kept = ((full_terms, whole_kept), (terms, layers - n - whole_kept))
    activations = sum((count * act.sum_terms(t, "activations") for t, count in kept), Fraction(0))
    statistics = sum(
        (count * act.sum_terms(t, "attention_stats") for t, count in kept), Fraction(0)
    )
    left = [layer.on_device for layer in offloaded]
    fetched = [layer.fetched for layer in offloaded]
    tail = activations + statistics + sum(left, Fraction(0))
    phases = [
        left_so_far + fetched[j] + (fetched[j - 1] if j else 0)
        for j, left_so_far in enumerate(accumulate(left))
    ]
    held = act.sum_terms(full_terms) if stage > 0 and not left[0] else Fraction(0)
    buffers = in_flight * (sum(left, Fraction(0)) + held) + max(Fraction(0), max(phases) - tail)
    return (
        in_flight * activations,
        in_flight * statistics,
        buffers,
        in_flight * sum(fetched, Fraction(0)),
    )


def check_offloaded_layers(layout: Layout, layers_per_stage: int) -> None:
    """ValueError naming the flag when ``--activation-offload-layers`` exceeds a stage's layers."""
    if layout.activation_offload_layers > layers_per_stage:
        raise ValueError(
            f"--activation-offload-layers {layout.activation_offload_layers}: a pipeline stage has "
            f"{layers_per_stage} layers"
        )


def node_stages(layout: Layout, devices_per_node: int) -> list[list[int]]:
    """Per node, the pipeline stage of each of its ranks (Megatron's rank order TP, CP, DP,
    PP: rank ``r`` is on stage ``r // (tp * cp * dp)``)."""
    return [[stage for stage, _ in node] for node in node_ranks(layout, devices_per_node)]


def node_ranks(layout: Layout, devices_per_node: int) -> list[list[tuple[int, int]]]:
    """Per node, ``(pipeline stage, rank in the data x context parallel group)`` of each of
    its ranks: rank ``r`` is on stage ``r // (tp * cp * dp)`` and is rank
    ``(r // tp) % (cp * dp)`` of its group (megatron's order TP, CP, DP, PP; the group's
    ranks in global order)."""
    per_stage = layout.num_devices // layout.pp
    ranks = range(layout.num_devices)
    return [
        [
            (r // per_stage, (r // layout.tp) % layout.sharding_ranks)
            for r in ranks[start : start + devices_per_node]
        ]
        for start in range(0, layout.num_devices, devices_per_node)
    ]


def host_plan(
    layout: Layout, stages: list[StagePlan], hardware: HardwareProfile, host_memory: Optional[int]
) -> Optional[HostPlan]:
    """The fullest node's host bytes; None when the profile has no host figures and nothing
    is offloaded (offload without them is a ValueError naming the missing figure)."""
    names = ("host_runtime_bytes_per_rank", "host_reserved_bytes")
    if not layout.offloads and any(getattr(hardware, n) is None for n in names):
        return None
    runtime, reserved = (int(hardware.host(n)) for n in names)
    if host_memory is None:
        host_memory = (
            hardware.host_memory_bytes if layout.offloads or hardware.host_memory_bytes else None
        )
    if layout.offloads and host_memory is None:
        hardware.host("host_memory_bytes")  # raises, naming the figure
    best = None
    for node in node_ranks(layout, hardware.devices_per_node):
        by_category = {name: 0 for name in HOST_CATEGORIES}
        for stage, shard_rank in node:
            plan = stages[stage]
            rank_bytes = (
                {**plan.host_bytes, **plan.rank_host_bytes[shard_rank]}
                if plan.rank_host_bytes
                else plan.host_bytes
            )
            for name, value in {**rank_bytes, "host_runtime": runtime}.items():
                by_category[name] += value
        total = sum(by_category.values()) + reserved
        if best is None or total > best.per_node:
            best = HostPlan(total, by_category, reserved, len(node), host_memory)
    return best
