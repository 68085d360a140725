"""Per-device memory plan for one parallel layout: the breakdown and a fits / does-not-fit verdict.

For every pipeline stage (the worst one decides) the plan adds up, in bytes per device:

* ``weights`` (bf16, 2 B/param), ``gradients`` (fp32 main grads, 4 B/param; with bf16 main
  gradients, ``layout.grad_reduce_in_bf16``, 2 B/param plus the distributed optimizer's fp32
  gradients of the shard it keeps on the device, 4 B per shard element: see
  :func:`device_gradient_bytes`) and
  ``optimizer_state`` (fp32 master + Adam m, v: 12 B/param, divided by ``dp * cp`` with the
  distributed optimizer) of the stage's parameters on one TP rank;
* ``activations``: the per-layer terms of :mod:`.activations` (exact, validated against
  measured saved bytes) x layers per stage x micro-batches in flight (1F1B: ``pp - i`` on
  stage ``i``; interleaved with ``v`` chunks: ``2(pp-i-1) + (v-1)pp + 1`` chunks of
  ``L/(pp*v)`` layers), without the attention statistics, which are
  ``attention_statistics``;
* ``embeddings_and_loss``: saved outside the layers (token ids, final norm, output-layer
  input, the fp32 cross-entropy softmax), x micro-batches in flight on that stage;
* estimates of transient buffers (not measured, marked so in the breakdown):
  ``logits_buffers`` (last stage: the logits and their fp32 gradient),
  ``recompute_workspace`` (the activations of the layer being recomputed plus the
  largest gradients of a layer's backward), ``communication_buffers`` (sequence-parallel
  all-gather output, pipeline send/receive, context-parallel ring K/V and dK/dV;
  gradient reduce-scatter and the distributed optimizer's all-gather work in place in
  Megatron's contiguous buffers), ``runtime_reserve`` (fixed, for the runtime, collective
  library workspaces) and ``allocator_fragmentation`` (a fraction of the dynamic memory).

With Megatron-FSDP (``layout.fsdp``) ``weights``, ``gradients`` and ``optimizer_state`` are
:func:`.fsdp.fsdp_bytes`' (megatron's parameter groups and padding, sharded over
``dp * cp`` as the strategy says), and two more categories, :data:`.fsdp.FSDP_CATEGORIES`,
hold what FSDP holds unsharded at the backward's worst moment for the two together: the
gathered units and the unsharded gradient buckets (:func:`.fsdp.backward_moments`). They are
added to every layer's activations, which peak at the first layer's backward: where FSDP's
worst moment comes later, the total overstates the peak by what was freed in between.

Optimizer offload and bf16 main gradients with the distributed optimizer (megatron's DDP) are
counted exactly, per data-parallel rank (:func:`rank_shards`, :func:`ddp_state_bytes`,
:func:`ddp_host_bytes`; tests/emulation/test_offload_memory.py measures them on the emulated
NPU): megatron's buffer layout (:func:`.parameters.ddp_buffer`: padded buffers, each rank's
shard), the optimizer's parameter order, and ``HybridDeviceOptimizer`` moving whole
parameters to the host in that order while the offloaded elements are below ``F`` x the
rank's shard; ``weights``, ``gradients`` and ``optimizer_state`` are then the worst rank's.
Without offload and bf16 gradients the DDP rows count parameters (``P``, ``12 P / (dp cp)``),
not the padded buffers.

Host offload (``layout.optimizer_offload_fraction``, ``layout.activation_offload_layers``;
the ladder's 4th rung): ``optimizer_state`` keeps what the rank does not offload;
``activations`` and ``attention_statistics`` keep the layers not offloaded, and
``activation_offload_buffers`` holds what the offloaded layers add at the backward's worst
moment, from the offload's order of events (:func:`_offload_stage`: what stays on the
device of a parked layer, and an offloaded layer's own copies fetched with the next one's
prefetch where they exceed the layers not offloaded, all freed by then). The host side, per rank (:data:`HOST_CATEGORIES`, bytes):
``host_optimizer_state`` = 12 B (fp32 master, Adam m, v) per offloaded shard element and the
4-byte step counter of each offloaded parameter, ``host_gradient_copy`` = 4 B (megatron's
pinned fp32 copy of the gradient, ``pin_cpu_grads``) per offloaded element (the rank's own:
a node sums its ranks'); ``host_activations`` = the offloaded layers' host copies x
micro-batches in flight; ``host_runtime`` = the profile's ``host_runtime_bytes_per_rank`` (an
assumption).
Per node: the sum over the node's ranks (Megatron's rank order TP, CP, DP, PP) plus
``host_reserved_bytes``; a plan whose node needs more than ``host_memory`` does not fit.

The plan's compute estimates (recompute overhead, pipeline bubble) come from :mod:`.flops`;
a ``mean_document_length`` (packed documents) changes only the attention-kernel FLOPs
there, never the bytes: whatever the mask, the fused attention keeps per-token tensors only
(q, k, v, out and the softmax statistics).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional

from . import activations as act
from .communicators import P2P_HCCL_BUFFSIZE_BYTES, stage_communicators
from .flops import pipeline_bubble, recompute_overhead
from .fsdp import FSDP_CATEGORIES, fsdp_bytes, stage_groups
from .hardware import DEFAULT_HARDWARE, HARDWARE_PROFILES, HardwareProfile
from .layout import (
    HOST_MOMENT_BYTES,
    Layout,
    fsdp_flags,
    gradient_flags,
    offload_flags,
    pretrain_command,
    recompute_flags,
)
from .models import ModelShape
from .parameters import (
    layer_parameters,
    optimizer_bytes_per_parameter,
    optimizer_order,
    stage_ddp_buffers,
    stage_parameters,
    total_parameters,
)
from .units import GiB

__all__ = [
    "MemoryPlan",
    "StagePlan",
    "plan_memory",
    "launch_command",
    "CATEGORIES",
    "ESTIMATED_CATEGORIES",
    "FSDP_CATEGORIES",
    "HOST_CATEGORIES",
    "OFFLOAD_CATEGORIES",
    "HostPlan",
    "device_gradient_bytes",
    "main_gradient_bytes",
    "RankShard",
    "rank_shards",
    "offloaded_parameters",
    "ddp_state_bytes",
    "ddp_host_bytes",
    "exact_ddp_state",
]

# the share of the device memory a fitting plan leaves free by default (--min-free-memory):
# its transient buffers, fragmentation and runtime reserve are estimates, and an allocator
# near its capacity fails on the first fragmented request; 5% is 3.05 GiB of a 910B's 60.97
MIN_FREE_SHARE = 0.05

CATEGORIES = (
    "weights",
    "gradients",
    "optimizer_state",
    "activations",
    "attention_statistics",
    "embeddings_and_loss",
    "logits_buffers",
    "recompute_workspace",
    "communication_buffers",
    "runtime_reserve",
    "collective_library_buffers",
    "allocator_fragmentation",
)
ESTIMATED_CATEGORIES = (
    "logits_buffers",
    "recompute_workspace",
    "communication_buffers",
    "runtime_reserve",
    "allocator_fragmentation",
)
# the device's extra category under activation offload (absent without it)
OFFLOAD_CATEGORIES = ("activation_offload_buffers",)
# a rank's host bytes by category
HOST_CATEGORIES = (
    "host_optimizer_state",
    "host_gradient_copy",
    "host_activations",
    "host_runtime",
)
HOST_MASTER_BYTES = 4  # the fp32 master copy per offloaded element (Adam's m, v: HOST_MOMENT_BYTES)
HOST_GRADIENT_BYTES = 4  # megatron's pinned fp32 gradient copy per offloaded element
FP32_BYTES = 4  # fp32 gradients of the logits, dK/dV of the context-parallel ring
BF16_BYTES = 2
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
    return parameters * BF16_BYTES + _ceil(kept * FP32_BYTES)


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
    ``bucket_size``: :attr:`.layout.Layout.ddp_bucket_size`), each rank's shard, its
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


@dataclass
class StagePlan:
    """One pipeline stage's device: its ``parameters`` (one TP rank), its ``layers``, the
    model chunks x micro-batches ``in_flight`` at its peak and ``bytes`` by category
    (:data:`CATEGORIES`; with the exact DDP state its worst data-parallel rank's). Host:
    ``host_bytes`` (:data:`HOST_CATEGORIES` but ``host_runtime``) of its fullest rank and,
    where ranks differ, ``rank_host_bytes``: the offloaded optimizer's host bytes of each rank
    of the data x context parallel group (a node sums its own ranks')."""

    stage: int
    parameters: int
    layers: int
    in_flight: int
    bytes: dict[str, int]
    host_bytes: dict[str, int] = field(default_factory=dict)  # one rank's, HOST_CATEGORIES
    # per data x context parallel rank, where they differ (exact DDP state): each rank's host
    # optimizer bytes (host_optimizer_state, host_gradient_copy)
    rank_host_bytes: tuple[dict[str, int], ...] = ()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass
class HostPlan:
    """The host side of a plan, per node (bytes): ``per_node`` the fullest node's sum over
    its ranks plus ``reserved`` (the OS ...), ``by_category`` that node's ranks' bytes by
    :data:`HOST_CATEGORIES`, against ``host_memory`` (None: no verdict)."""

    per_node: int
    by_category: dict[str, int]
    reserved: int
    ranks_per_node: int
    host_memory: Optional[int]

    @property
    def fits(self) -> Optional[bool]:
        return None if self.host_memory is None else self.per_node <= self.host_memory

    @property
    def headroom(self) -> Optional[int]:
        return None if self.host_memory is None else self.host_memory - self.per_node

    def to_dict(self) -> dict:
        return {
            "host_bytes_per_node": self.per_node,
            "host_bytes_per_node_by_category": {**self.by_category, "host_reserved": self.reserved},
            "ranks_per_node": self.ranks_per_node,
            "host_memory_bytes": self.host_memory,
            "host_fits": self.fits,
        }


@dataclass
class MemoryPlan:
    """The result of :func:`plan_memory`; ``per_device`` is the worst stage's breakdown (bytes).

    Text forms are :func:`mcore_flash.planning.report.format_plan` (and its helpers);
    :meth:`to_dict` is the JSON form.
    """

    model: ModelShape
    seq_length: int
    layout: Layout
    profile: str
    dtype_bytes: int
    total_parameters: int
    stages: list[StagePlan]
    layer_terms: list  # activations.Term, one layer, one micro-batch, this layout
    device_memory: Optional[int]
    recompute_overhead: float
    pipeline_bubble: float
    mean_document_length: Optional[float] = (
        None  # tokens per packed document; None = one per sequence
    )
    notes: list[str] = field(default_factory=list)
    host: Optional[HostPlan] = None  # None: the hardware profile gives no host figures
    # bytes of device_memory a fitting plan leaves free (--min-free-memory)
    min_free_memory: int = 0

    @property
    def worst_stage(self) -> StagePlan:
        return max(self.stages, key=lambda stage: stage.total)

    @property
    def categories(self) -> tuple[str, ...]:
        """The byte categories of this plan: :data:`CATEGORIES`, and with FSDP
        :data:`.fsdp.FSDP_CATEGORIES` after them."""
        return (
            CATEGORIES
            + (FSDP_CATEGORIES if self.layout.fsdp else ())
            + (OFFLOAD_CATEGORIES if self.layout.activation_offload_layers else ())
        )

    @property
    def per_device(self) -> dict[str, int]:
        return dict(self.worst_stage.bytes)

    @property
    def total(self) -> int:
        return self.worst_stage.total

    @property
    def device_fits(self) -> Optional[bool]:
        """The worst stage leaves at least ``min_free_memory`` of ``device_memory`` free
        (None without a device memory)."""
        if self.device_memory is None:
            return None
        return self.total + self.min_free_memory <= self.device_memory

    @property
    def fits(self) -> Optional[bool]:
        """The device memory holds the worst stage and the host memory the fullest node
        (None without a device memory)."""
        if self.device_fits is None:
            return None
        return self.device_fits and (self.host is None or self.host.fits is not False)

    @property
    def headroom(self) -> Optional[int]:
        """Device bytes the worst stage leaves free (negative: over)."""
        return None if self.device_memory is None else self.device_memory - self.total

    @property
    def layer_bytes(self) -> int:
        """Saved bytes of one layer for one micro-batch (statistics included)."""
        return int(math.ceil(act.sum_terms(self.layer_terms)))

    @property
    def relative_step_time(self) -> float:
        return (1 + self.recompute_overhead) * (1 + self.pipeline_bubble)

    def to_dict(self) -> dict:
        layer_by_module = {k: int(math.ceil(v)) for k, v in act.by_module(self.layer_terms).items()}
        return {
            "model": self.model.name,
            "model_shape": self.model.to_dict(),
            "seq_length": self.seq_length,
            "mean_document_length": self.mean_document_length,
            "layout": self.layout.to_dict(),
            "profile": self.profile,
            "activation_dtype_bytes": self.dtype_bytes,
            "total_parameters": self.total_parameters,
            "parameters_per_device": self.worst_stage.parameters,
            "per_device_bytes": self.per_device,
            "estimated_categories": list(ESTIMATED_CATEGORIES),
            "total_bytes_per_device": self.total,
            "device_memory_bytes": self.device_memory,
            "fits": self.fits,
            "headroom_bytes": self.headroom,
            "min_free_memory_bytes": self.min_free_memory,
            "worst_stage": self.worst_stage.stage,
            "stages": [
                {
                    "stage": st.stage,
                    "parameters": st.parameters,
                    "layers": st.layers,
                    "in_flight": st.in_flight,
                    "bytes": st.bytes,
                    "total_bytes": st.total,
                    "host_bytes_per_rank": st.host_bytes,
                }
                for st in self.stages
            ],
            "activation_bytes_per_layer": self.layer_bytes,
            "activation_bytes_per_layer_by_module": layer_by_module,
            "activation_terms_per_layer": [
                {
                    "module": t.module,
                    "name": t.name,
                    "bytes": int(math.ceil(t.bytes)),
                    "category": t.category,
                }
                for t in self.layer_terms
            ],
            "recompute_overhead": self.recompute_overhead,
            "pipeline_bubble": self.pipeline_bubble,
            "relative_step_time": self.relative_step_time,
            "recompute_flags": recompute_flags(self.layout),
            "fsdp_flags": fsdp_flags(self.layout),
            "offload_flags": offload_flags(self.layout),
            "gradient_flags": gradient_flags(self.layout),
            "main_gradient_bytes_per_element": main_gradient_bytes(self.layout),
            "device_fits": self.device_fits,
            "host": None if self.host is None else self.host.to_dict(),
            "launch_command": launch_command(self),
            "notes": self.notes,
        }


def launch_command(
    plan: MemoryPlan,
    program: str = "mcore-flash pretrain",
    distributed_timeout_minutes: Optional[int] = None,
) -> str:
    """The ``mcore-flash pretrain`` command line (Megatron-LM flag names) for ``plan``'s layout,
    with ``--distributed-timeout-minutes`` when given."""
    return pretrain_command(
        plan.model,
        plan.seq_length,
        plan.layout,
        dtype_bytes=plan.dtype_bytes,
        mean_document_length=plan.mean_document_length,
        distributed_timeout_minutes=distributed_timeout_minutes,
        program=program,
    )


def _ceil(x: Fraction | float) -> int:
    return int(math.ceil(x))


@dataclass(frozen=True)
class _MicroBatch:
    """One micro-batch on one device, the sizes the buffer estimates use.

    ``local_tokens``: ``s / cp`` (the CP rank's share); ``rank_tokens``: ``s / (cp * tp)``
    under sequence parallelism (the tokens of a [s, b, h] tensor a TP rank holds), else
    ``local_tokens``; ``batch``: micro-batch size ``b``; ``element_bytes``: the activation
    dtype's bytes ``B``.
    """

    local_tokens: Fraction
    rank_tokens: Fraction
    batch: int
    element_bytes: int

    @classmethod
    def of(cls, seq_length: int, layout: Layout, dtype_bytes: int) -> "_MicroBatch":
        local = Fraction(seq_length, layout.cp)
        return cls(
            local, local / layout.tp if layout.sp else local, layout.micro_batch_size, dtype_bytes
        )


def _check_divisible(model: ModelShape, seq_length: int, layout: Layout) -> None:
    """Raise ValueError unless the layers split into ``pp * vp`` chunks, the sequence into
    ``2 * cp`` ring chunks and each CP rank's tokens over ``tp`` (sequence parallel)."""
    if model.num_layers % (layout.pp * layout.vp):
        raise ValueError(
            f"num_layers ({model.num_layers}) must be divisible by pp x vp = {layout.pp * layout.vp}"
        )
    if seq_length % (2 * layout.cp) and layout.cp > 1:
        raise ValueError(
            f"seq_length {seq_length} must be divisible by 2 x cp = {2 * layout.cp} (load-balanced ring CP)"
        )
    if layout.sp and seq_length // layout.cp % layout.tp:
        raise ValueError(
            f"the local sequence {seq_length // layout.cp} must be divisible by tp {layout.tp} (sequence parallel)"
        )


def _mean_layer_bytes(
    terms: list[act.Term], full_terms: list[act.Term], model: ModelShape, layout: Layout
) -> tuple[Fraction, Fraction]:
    """``(activations, attention statistics)`` of the mean layer of a pipeline chunk, one
    micro-batch: under partial recompute the ``recompute_num_layers`` layers recomputed whole
    keep ``full_terms`` (their input), the others ``terms`` (``layout.recompute``)."""
    whole_share = Fraction(layout.recompute_num_layers, layout.chunk_layers(model.num_layers))
    activations = whole_share * act.sum_terms(full_terms) + (1 - whole_share) * act.sum_terms(
        terms, "activations"
    )
    statistics = (1 - whole_share) * act.sum_terms(terms, "attention_stats")
    return activations, statistics


def _recompute_workspace(
    terms: list[act.Term],
    none_terms: list[act.Term],
    model: ModelShape,
    layout: Layout,
    micro: _MicroBatch,
) -> Fraction:
    """Estimated bytes alive while one layer runs its backward: what its recompute rebuilds
    (``none_terms`` less the kept ``terms``) plus the largest gradients inside a layer's
    backward, ``s_c * b * (fc1 width / tp + 2h) * B``."""
    if layout.recompute == "full" or layout.recompute_num_layers:
        rebuilt = act.sum_terms(none_terms)
    elif layout.recompute == "attention":
        rebuilt = sum((t.bytes for t in none_terms if t.scope == "attention"), Fraction(0))
    elif (
        layout.recompute == "qkv"
    ):  # the replayed prelude and q, k, v: the attention terms not kept
        kept = {(t.module, t.name) for t in terms}
        rebuilt = sum(
            (
                t.bytes
                for t in none_terms
                if t.scope == "attention" and (t.module, t.name) not in kept
            ),
            Fraction(0),
        )
    else:
        rebuilt = Fraction(0)
    fc1_width_per_rank = Fraction(model.ffn_hidden_size * (2 if model.gated else 1), layout.tp)
    gradients = (
        micro.local_tokens
        * micro.batch
        * (fc1_width_per_rank + 2 * model.hidden_size)
        * micro.element_bytes
    )
    return rebuilt + gradients


def _communication_buffers(model: ModelShape, layout: Layout, micro: _MicroBatch) -> Fraction:
    """Estimated bytes of the receive/gather buffers: the all-gathered sequence-parallel
    input, the pipeline's forward activation and backward gradient, the context-parallel
    ring's K/V (dtype) and dK/dV (fp32), double-buffered."""
    b, element = micro.batch, micro.element_bytes
    kv_heads_per_rank = (
        Fraction(model.num_query_groups, layout.tp)
        if model.num_query_groups >= layout.tp
        else Fraction(1)
    )
    buffers = Fraction(0)
    if layout.sp:
        buffers += micro.local_tokens * b * model.hidden_size * element
    if layout.pp > 1:
        buffers += 2 * micro.rank_tokens * b * model.hidden_size * element
    if layout.cp > 1:
        buffers += (
            2
            * 2
            * micro.local_tokens
            * b
            * kv_heads_per_rank
            * model.head_dim
            * (element + FP32_BYTES)
        )
    return buffers


def _outside_layers_bytes(
    model: ModelShape, seq_length: int, layout: Layout, stage: int, term_options: dict
) -> tuple[Fraction, Fraction]:
    """``(embeddings_and_loss, decoder)`` bytes of stage ``stage`` outside its layers: the
    embedding's saved tensors x the micro-batches in flight through the first chunk, the
    final norm, output layer and loss for the one micro-batch whose backward follows its
    forward, and what the decoder block's checkpoints share (x chunks in flight)."""
    chunks_in_flight = layout.in_flight(stage)
    micro_batches_in_flight = min(chunks_in_flight, layout.num_microbatches or chunks_in_flight)
    outside = act.non_layer_terms(
        model,
        seq_length,
        layout.micro_batch_size,
        first_stage=stage == 0,
        last_stage=stage == layout.pp - 1,
        **{
            **term_options,
            "recompute": "full" if layout.recompute_num_layers else layout.recompute,
        },
    )
    embedding = [t for t in outside if t.module.startswith("embedding")]
    loss = [
        t
        for t in outside
        if not t.module.startswith(("embedding", "decoder"))
        or t.module == "decoder.final_layernorm"
    ]
    decoder = [
        t
        for t in outside
        if t.module.startswith("decoder") and t.module != "decoder.final_layernorm"
    ]
    embeddings_and_loss = act.sum_terms(embedding) * micro_batches_in_flight + act.sum_terms(loss)
    return embeddings_and_loss, act.sum_terms(decoder) * chunks_in_flight


def _notes(seq_length: int, layout: Layout, profile: act.Profile) -> list[str]:
    """Warnings the numbers do not show: short CP ranks, an unfilled pipeline, unfused attention."""
    notes = []
    if layout.cp > 1 and seq_length // layout.cp < 8192:
        notes.append(
            f"{seq_length // layout.cp} tokens per CP rank: ring context parallelism hides its communication only "
            "above about 8K tokens per rank"
        )
    if (
        layout.pp > 1
        and layout.num_microbatches is not None
        and layout.num_microbatches < layout.pp
    ):
        notes.append(
            f"{layout.num_microbatches} micro-batches per step cannot fill {layout.pp} pipeline stages"
        )
    if profile.attention == "standard":
        notes.append("standard (unfused) attention: keeps the [b, heads, s, s] softmax per layer")
    if layout.fsdp in ("no_shard", "optim"):
        notes.append(
            f"--data-parallel-sharding-strategy {layout.fsdp}: the trainer refuses it on megatron-core 0.16.1 "
            "(upstream bugs); use optim_grads or optim_grads_params"
        )
    if layout.fsdp and layout.sharding_ranks == 1:
        notes.append(
            "Megatron-FSDP at dp x cp = 1 shards nothing, and the trainer refuses it on megatron-core 0.16.1"
        )
    return notes


def _fsdp_stage_bytes(
    model: ModelShape, layout: Layout, stage: int, param_bytes: int, grad_bytes: int
) -> dict[str, int]:
    """One stage's device under Megatron-FSDP: :func:`.fsdp.fsdp_bytes` of megatron's
    parameter groups of its parameters, over ``dp * cp`` ranks."""
    return fsdp_bytes(
        stage_groups(model, layout.tp, layout.pp, stage, layout.fsdp),
        layout.fsdp,
        layout.sharding_ranks,
        sum(layer_parameters(model, layout.tp).values()),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
    )


def default_min_free_memory(device_memory: Optional[int]) -> int:
    """:data:`MIN_FREE_SHARE` of ``device_memory`` in bytes (0 without one)."""
    return 0 if device_memory is None else int(MIN_FREE_SHARE * device_memory)


def plan_memory(
    model: ModelShape,
    seq_length: int,
    layout: Layout,
    *,
    device_memory: Optional[int] = None,
    profile: str = "npu",
    dtype_bytes: int = 2,
    param_bytes: int = 2,
    runtime_reserve: int = 2 * GiB,
    fragmentation: float = 0.05,
    activation_profile: Optional[act.Profile] = None,
    mean_document_length: Optional[float] = None,
    hardware: HardwareProfile = HARDWARE_PROFILES[DEFAULT_HARDWARE],
    host_memory: Optional[int] = None,
    min_free_memory: Optional[int] = None,
) -> MemoryPlan:
    """The per-device memory plan of ``model`` at ``seq_length`` (tokens) under ``layout``.

    ``profile`` names the device behaviour (:data:`activations.PROFILES`; ``npu`` for the
    Ascend recipes) unless ``activation_profile`` gives one. ``device_memory`` (bytes) makes
    the verdict, which keeps ``min_free_memory`` (bytes; default :data:`MIN_FREE_SHARE` of
    ``device_memory``) of it free; ``runtime_reserve`` (bytes) is set aside for the runtime and collectives;
    ``fragmentation`` is the fraction of the dynamic bytes the allocator loses.
    ``dtype_bytes``: activations, ``param_bytes``: weights; the main gradients are fp32, or
    bf16 with ``layout.grad_reduce_in_bf16`` (which needs ``param_bytes`` 2: ValueError).
    ``mean_document_length`` (tokens; None = one document per sequence) scales the attention
    FLOPs of the recompute overhead, not the bytes.
    ``hardware`` gives the host figures (devices per node, runtime and reserved host bytes,
    the default ``host_memory``: bytes per node) of the host plan.
    """
    activation_profile = activation_profile or act.PROFILES[profile]
    if layout.grad_reduce_in_bf16 and param_bytes != BF16_BYTES:
        raise ValueError(
            f"--grad-reduce-in-bf16 needs bf16 parameters (--bf16): param_bytes is {param_bytes}"
        )
    grad_bytes = main_gradient_bytes(layout)
    _check_divisible(model, seq_length, layout)
    micro = _MicroBatch.of(seq_length, layout, dtype_bytes)
    term_options = dict(
        tp=layout.tp,
        cp=layout.cp,
        sequence_parallel=layout.sp,
        recompute=layout.recompute,
        profile=activation_profile,
        dtype_bytes=dtype_bytes,
    )

    def layer_terms_with(recompute: str) -> list[act.Term]:
        return act.layer_terms(
            model, seq_length, layout.micro_batch_size, **{**term_options, "recompute": recompute}
        )

    terms, none_terms, full_terms = (
        layer_terms_with(mode) for mode in (layout.recompute, "none", "full")
    )
    recompute_shares = layout.recompute_shares(model.num_layers)
    layer_activations, layer_statistics = _mean_layer_bytes(terms, full_terms, model, layout)
    workspace = _recompute_workspace(terms, none_terms, model, layout, micro)
    communication = _communication_buffers(model, layout, micro)
    optimizer_per_parameter = optimizer_bytes_per_parameter(
        layout.distributed_optimizer, layout.dp, layout.cp
    )

    stages = []
    layers_per_stage = model.num_layers // layout.pp
    _check_offloaded_layers(layout, layers_per_stage)
    for stage in range(layout.pp):
        parameters = sum(stage_parameters(model, layout.tp, layout.pp, stage).values())
        chunks_in_flight = layout.in_flight(stage)
        layers_in_flight = Fraction(layers_per_stage, layout.vp) * chunks_in_flight
        embeddings_and_loss, decoder = _outside_layers_bytes(
            model, seq_length, layout, stage, term_options
        )
        logits = Fraction(0)
        if stage == layout.pp - 1:  # the logits and their fp32 gradient
            vocab_per_rank = Fraction(model.vocab_size, layout.tp)
            logits = micro.local_tokens * micro.batch * vocab_per_rank * (dtype_bytes + FP32_BYTES)
        sharded = (
            _fsdp_stage_bytes(model, layout, stage, param_bytes, grad_bytes) if layout.fsdp else {}
        )
        transient = sum(sharded.get(name, 0) for name in FSDP_CATEGORIES)
        if layout.activation_offload_layers:
            kept_activations, kept_statistics, offload_buffers, host_activations = _offload_stage(
                terms, full_terms, layout, layers_per_stage, stage, chunks_in_flight
            )
        else:  # every layer's kept tensors stay, for each micro-batch in flight
            kept_activations = layers_in_flight * layer_activations
            kept_statistics = layers_in_flight * layer_statistics
            offload_buffers = host_activations = Fraction(0)
        dynamic = (
            transient
            + offload_buffers
            + kept_activations
            + kept_statistics
            + embeddings_and_loss
            + decoder
            + logits
            + workspace
            + communication
        )
        nbytes = {
            "weights": parameters * param_bytes,
            "gradients": device_gradient_bytes(parameters, layout),
            "optimizer_state": _ceil(parameters * optimizer_per_parameter),
            "activations": _ceil(kept_activations + decoder),
            "attention_statistics": _ceil(kept_statistics),
            "embeddings_and_loss": _ceil(embeddings_and_loss),
            "logits_buffers": _ceil(logits),
            "recompute_workspace": _ceil(workspace),
            "communication_buffers": _ceil(communication),
            "runtime_reserve": runtime_reserve,
            "collective_library_buffers": collective_library_bytes(model, layout, hardware, stage),
            "allocator_fragmentation": _ceil(fragmentation * dynamic),
            **sharded,
        }
        if layout.activation_offload_layers:
            nbytes["activation_offload_buffers"] = _ceil(offload_buffers)
        host_bytes = {  # the optimizer's host bytes: offload implies the exact DDP state
            "host_optimizer_state": 0,
            "host_gradient_copy": 0,
            "host_activations": _ceil(host_activations),
        }
        rank_host: tuple[dict[str, int], ...] = ()
        if exact_ddp_state(layout):  # the distributed optimizer with offload or bf16 gradients
            nbytes, host_bytes, rank_host = _exact_ddp_stage(
                model, layout, stage, param_bytes, nbytes, host_bytes
            )
        stages.append(
            StagePlan(
                stage,
                parameters,
                layers_per_stage,
                chunks_in_flight,
                nbytes,
                host_bytes,
                rank_host,
            )
        )

    fused = activation_profile.attention != "standard"
    return MemoryPlan(
        model=model,
        seq_length=seq_length,
        layout=layout,
        profile=activation_profile.name,
        dtype_bytes=dtype_bytes,
        total_parameters=total_parameters(model),
        stages=stages,
        layer_terms=terms,
        device_memory=device_memory,
        recompute_overhead=sum(
            weight * recompute_overhead(model, seq_length, mode, fused, mean_document_length)
            for weight, mode in recompute_shares
        ),
        pipeline_bubble=pipeline_bubble(layout.pp, layout.num_microbatches, layout.vp),
        mean_document_length=mean_document_length,
        notes=_notes(seq_length, layout, activation_profile),
        host=_host_plan(layout, stages, hardware, host_memory),
        min_free_memory=(
            default_min_free_memory(device_memory) if min_free_memory is None else min_free_memory
        ),
    )


def collective_library_bytes(
    model: ModelShape, layout: Layout, hardware: HardwareProfile, stage: int
) -> int:
    """Device bytes the collective library's communicators hold outside the allocator on a
    rank of pipeline stage ``stage``: on HCCL (:mod:`.communicators`) 2 x ``HCCL_BUFFSIZE``
    (``hardware.communicator_buffer_bytes``) per collective communicator and 2 x
    ``P2P_HCCL_BUFFSIZE`` (its default) per point-to-point one; elsewhere
    ``hardware.communicator_buffer_bytes`` per communicator, the same count."""
    opened = stage_communicators(layout, model, stage)
    if hardware.collective_library == "hccl":
        return opened.buffer_bytes(hardware.communicator_buffer_bytes // 2, P2P_HCCL_BUFFSIZE_BYTES)
    return (opened.num_collective + opened.num_p2p) * hardware.communicator_buffer_bytes


def _exact_ddp_stage(
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
    :func:`_exact_ddp_stage` (cached: the search plans the same stage under many
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


def _offload_stage(
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
    fetches ``V_i`` back (:func:`.activations.offloaded_layer`; under partial recompute the
    first ``recompute_num_layers`` layers are recomputed whole). Per micro-batch in flight the
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
    per_layer = [(full_terms, recomputed) if i < whole else (terms, rest) for i in range(layers)]
    activations = sum((act.sum_terms(t, "activations") for t, _ in per_layer[n:]), Fraction(0))
    statistics = sum((act.sum_terms(t, "attention_stats") for t, _ in per_layer[n:]), Fraction(0))
    left = [layer.on_device for _, layer in per_layer[:n]]
    fetched = [layer.fetched for _, layer in per_layer[:n]]
    tail = activations + statistics + sum(left, Fraction(0))
    phases = [
        sum(left[: j + 1], Fraction(0)) + fetched[j] + (fetched[j - 1] if j else 0)
        for j in range(n)
    ]
    held = act.sum_terms(full_terms) if stage > 0 and not left[0] else Fraction(0)
    buffers = in_flight * (sum(left, Fraction(0)) + held) + max(Fraction(0), max(phases) - tail)
    return (
        in_flight * activations,
        in_flight * statistics,
        buffers,
        in_flight * sum(fetched, Fraction(0)),
    )


def _check_offloaded_layers(layout: Layout, layers_per_stage: int) -> None:
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


def _host_plan(
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
