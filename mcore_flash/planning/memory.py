"""Per-device memory plan for one parallel layout: the breakdown and a fits / does-not-fit
verdict (:func:`plan_memory`).

For every pipeline stage the plan adds up bytes per device by category
(:data:`.plans.CATEGORIES`; with Megatron-FSDP also :data:`.fsdp.FSDP_CATEGORIES`, with
activation offload :data:`.plans.OFFLOAD_CATEGORIES`); the worst stage decides. The
estimates (:data:`.plans.ESTIMATED_CATEGORIES`) are marked so; the activations are
:mod:`.activation_bytes`' exact per-layer terms x layers per stage x micro-batches in
flight; weights, gradients and optimizer state come from :mod:`.parameters`, :mod:`.fsdp`
(Megatron-FSDP) or :mod:`.ddp_state` (optimizer offload and bf16 main gradients, per
data-parallel rank), the communicators' buffers from :mod:`.communicators`, host bytes from
:mod:`.host_offload`. A plan fits when it leaves ``min_free_memory`` of the device free
(default :data:`MIN_FREE_SHARE` of it) and the host (where its memory is known) holds its
fullest node. The plan's types are :mod:`.plans`; its compute estimates (recompute
overhead, pipeline bubble) come from :mod:`.flops`, where a ``mean_document_length``
changes the attention FLOPs and never the bytes. What each category holds:
docs/planner.md ("Per device").
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from . import activation_bytes as act
from . import transient_bytes as tb
from .communicators import P2P_HCCL_BUFFSIZE_BYTES, stage_communicators
from .ddp_state import device_gradient_bytes, exact_ddp_stage, exact_ddp_state, main_gradient_bytes
from .flops import pipeline_bubble, recompute_overhead, tiling_overhead
from .fsdp import FSDP_CATEGORIES, fsdp_bytes, stage_groups
from .hardware import DEFAULT_HARDWARE, HARDWARE_PROFILES, HardwareProfile
from .host_offload import check_offloaded_layers, host_plan, offload_stage_bytes
from .models import ModelShape
from .parallel_layout import Layout
from .parameters import (
    layer_parameters,
    optimizer_bytes_per_parameter,
    stage_parameters,
    total_parameters,
)
from .plans import MemoryPlan, StagePlan
from .streaming import stream_device_bytes, stream_host_bytes
from .units import BF16_BYTES, FP32_BYTES, GiB

__all__ = [
    "plan_memory",
    "collective_library_bytes",
    "default_min_free_memory",
    "MIN_FREE_SHARE",
    "MIN_FREE_SHARE_HOST",
]

# the share of the device memory a fitting plan leaves free by default (--min-free-memory):
# its transient buffers, fragmentation and runtime reserve are estimates, and an allocator
# near its capacity fails on the first fragmented request; 5% is 3.05 GiB of a 910B's 60.97
MIN_FREE_SHARE = 0.05
# ... and of a layout that keeps state on the host (the offload and streaming rungs): their
# host-device copies run on side streams whose buffers the caching allocator frees only when
# the copy's event completes (FSDP2's all-gather and reduce-scatter buffers too), the pinned
# staging is the runtime's, and none of it is measured on a real device: 10% (6.10 GiB of a
# 910B), the margin DeepSpeed's and Megatron's users keep for an offloaded run
MIN_FREE_SHARE_HOST = 0.10


def _ceil(x: Fraction | float) -> int:
    return int(math.ceil(x))


@dataclass(frozen=True)
class _MicroBatch:
    """One micro-batch on one device, the sizes the buffer estimates use.

    ``local_tokens``: ``s / cp`` (the CP rank's share); ``rank_tokens``: ``s / (cp * tp)``
    under sequence parallelism (the tokens of a [s, b, h] tensor a TP rank holds), else
    ``local_tokens``; ``batch``: micro-batch size ``b``; ``element_bytes``: the activation
    dtype's bytes ``B``; ``loss_tile_tokens``: the tokens of one tile of the tiled loss,
    ``min(N, s / cp)`` (None: megatron's loss); ``mlp_tile_tokens``: of one tile of the tiled
    MLP (None: untiled, :func:`.activation_bytes.mlp_tile_tokens`).
    """

    local_tokens: Fraction
    rank_tokens: Fraction
    batch: int
    element_bytes: int
    loss_tile_tokens: Optional[Fraction] = None
    mlp_tile_tokens: Optional[Fraction] = None

    @classmethod
    def of(cls, seq_length: int, layout: Layout, dtype_bytes: int) -> "_MicroBatch":
        local = Fraction(seq_length, layout.cp)
        loss_chunk = layout.loss_chunk_size
        return cls(
            local,
            local / layout.tp if layout.sp else local,
            layout.micro_batch_size,
            dtype_bytes,
            None if loss_chunk is None else min(Fraction(loss_chunk), local),
            act.mlp_tile_tokens(seq_length, layout.cp, layout.mlp_chunk_size),
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
    mlp_backward: list[act.Term],
    model: ModelShape,
    layout: Layout,
    micro: _MicroBatch,
) -> Fraction:
    """Bytes alive while one layer runs its backward beyond its kept tensors: what its
    recompute rebuilds (``none_terms`` less the kept ``terms``), the layer's incoming gradient
    ``s_t * b * h * B`` (held through its backward: the residual stream's) and the MLP's
    backward at its peak (``mlp_backward``, :func:`.transient_bytes.mlp_backward_terms`: exact
    on the emulated NPU, tiled or not; the tiled MLP rebuilds its intermediates one tile at a
    time there, whatever the recompute mode, so ``none_terms`` and ``terms`` hold none of
    them). The attention's backward is taken to need no more than the MLP's (an assumption:
    with SwiGLU's ``f >= 2.7h`` its gradients are narrower; not measured)."""
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
    incoming = micro.rank_tokens * micro.batch * model.hidden_size * micro.element_bytes
    return rebuilt + incoming + act.sum_terms(mlp_backward)


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
        loss_chunk_size=layout.loss_chunk_size,
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
    """Warnings the numbers do not show: short CP ranks, an unfilled pipeline, unfused
    attention, an MLP tile no shorter than the sequence (untiled)."""
    notes = []
    if layout.mlp_chunk_size is not None and layout.mlp_chunk_size >= seq_length // layout.cp:
        notes.append(
            f"--mlp-chunk-size {layout.mlp_chunk_size} >= the {seq_length // layout.cp} tokens per CP rank: the "
            "MLP runs untiled (one tile), with megatron's memory and compute"
        )
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


def default_min_free_memory(device_memory: Optional[int], layout: Optional[Layout] = None) -> int:
    """:data:`MIN_FREE_SHARE` of ``device_memory`` in bytes (0 without one);
    :data:`MIN_FREE_SHARE_HOST` of it for a ``layout`` that keeps state on the host
    (:attr:`.parallel_layout.Layout.offloads`: the offload and streaming rungs)."""
    share = MIN_FREE_SHARE_HOST if layout is not None and layout.offloads else MIN_FREE_SHARE
    return 0 if device_memory is None else int(share * device_memory)


@dataclass(frozen=True)
class _PlanInputs:
    """What every pipeline stage of one plan is computed from: :func:`plan_memory`'s
    arguments, one layer's terms under the layout's recompute (``terms``) and under full
    recompute (``full_terms``), the mean layer's ``layer_activations`` and
    ``layer_statistics`` (one micro-batch) and the buffer estimates that are the same on
    every stage (``workspace``, ``communication``)."""

    model: ModelShape
    seq_length: int
    layout: Layout
    micro: _MicroBatch
    term_options: dict
    terms: list[act.Term]
    full_terms: list[act.Term]
    layer_activations: Fraction
    layer_statistics: Fraction
    workspace: Fraction
    communication: Fraction
    optimizer_per_parameter: float
    param_bytes: int
    grad_bytes: int
    runtime_reserve: int
    fragmentation: float
    hardware: HardwareProfile
    layers_per_stage: int


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

    ``profile`` names the device behaviour (:data:`.activation_bytes.PROFILES`; ``npu`` for the
    Ascend recipes) unless ``activation_profile`` gives one. ``device_memory`` (bytes) makes
    the verdict, which keeps ``min_free_memory`` (bytes; default :func:`default_min_free_memory`:
    5% of ``device_memory``, 10% with state on the host) of it free; ``runtime_reserve`` (bytes) is set aside for the runtime and collectives;
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
    terms, none_terms, full_terms, mlp_backward = map(
        list, _layer_term_sets(model, seq_length, layout, term_options)
    )
    recompute_shares = layout.recompute_shares(model.num_layers)
    layer_activations, layer_statistics = _mean_layer_bytes(terms, full_terms, model, layout)
    inputs = _PlanInputs(
        model=model,
        seq_length=seq_length,
        layout=layout,
        micro=micro,
        term_options=term_options,
        terms=terms,
        full_terms=full_terms,
        layer_activations=layer_activations,
        layer_statistics=layer_statistics,
        workspace=_recompute_workspace(terms, none_terms, mlp_backward, model, layout, micro),
        communication=_communication_buffers(model, layout, micro),
        optimizer_per_parameter=optimizer_bytes_per_parameter(
            layout.distributed_optimizer, layout.dp, layout.cp
        ),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        runtime_reserve=runtime_reserve,
        fragmentation=fragmentation,
        hardware=hardware,
        layers_per_stage=model.num_layers // layout.pp,
    )
    check_offloaded_layers(layout, inputs.layers_per_stage)
    stages = [_stage_plan(inputs, stage) for stage in range(layout.pp)]

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
        recompute_overhead=_compute_overhead(
            model, seq_length, micro, recompute_shares, fused, mean_document_length
        ),
        pipeline_bubble=pipeline_bubble(layout.pp, layout.num_microbatches, layout.vp),
        mean_document_length=mean_document_length,
        notes=_notes(seq_length, layout, activation_profile),
        host=host_plan(layout, stages, hardware, host_memory),
        devices_per_node=hardware.devices_per_node,
        min_free_memory=(
            default_min_free_memory(device_memory, layout)
            if min_free_memory is None
            else min_free_memory
        ),
    )


def _layer_term_sets(
    model: ModelShape, seq_length: int, layout: Layout, term_options: dict
) -> tuple[tuple[act.Term, ...], ...]:
    """One layer's terms under ``layout.recompute``, ``none`` and ``full`` (the MLP tiled as
    ``layout`` says), and the MLP's backward at its peak
    (:func:`.transient_bytes.mlp_backward_terms`); computed once per distinct input (a
    search plans many layouts that share them)."""
    return _term_sets(
        model,
        seq_length,
        layout.micro_batch_size,
        layout.mlp_chunk_size,
        tuple(sorted(term_options.items())),
    )


@functools.lru_cache(maxsize=1024)
def _term_sets(
    model: ModelShape,
    seq_length: int,
    micro_batch_size: int,
    mlp_chunk_size: Optional[int],
    options: tuple,
) -> tuple[tuple[act.Term, ...], ...]:
    term_options = dict(options)
    terms, none_terms, full_terms = (
        tuple(
            act.layer_terms(
                model,
                seq_length,
                micro_batch_size,
                mlp_chunk_size=mlp_chunk_size,
                **{**term_options, "recompute": mode},
            )
        )
        for mode in (term_options["recompute"], "none", "full")
    )
    mlp_backward = tb.mlp_backward_terms(
        model,
        seq_length,
        micro_batch_size,
        mlp_chunk_size=mlp_chunk_size,
        **{k: v for k, v in term_options.items() if k != "recompute"},
    )
    return terms, none_terms, full_terms, tuple(mlp_backward)


def _compute_overhead(
    model: ModelShape,
    seq_length: int,
    micro: _MicroBatch,
    recompute_shares: list[tuple[float, str]],
    fused: bool,
    mean_document_length: Optional[float],
) -> float:
    """Extra FLOPs over the step's without recompute: the layers' recompute modes by their
    ``recompute_shares`` (:meth:`.Layout.recompute_shares`), and the sequence tiles'
    recomputed forward passes."""
    return sum(
        weight * recompute_overhead(model, seq_length, mode, fused, mean_document_length)
        for weight, mode in recompute_shares
    ) + tiling_overhead(
        model,
        seq_length,
        micro.loss_tile_tokens is not None,
        micro.mlp_tile_tokens is not None,
        fused,
        mean_document_length,
    )


def _stage_activations(
    inputs: _PlanInputs, stage: int, chunks_in_flight: int
) -> tuple[Fraction, Fraction, Fraction, Fraction]:
    """``(activations, attention statistics, activation_offload_buffers, host_activations)``
    of stage ``stage``'s layers, ``chunks_in_flight`` model chunks x micro-batches in flight:
    with activation offload :func:`.host_offload.offload_stage_bytes`, else every layer's
    kept tensors for each micro-batch in flight."""
    layout = inputs.layout
    if layout.activation_offload_layers:
        return offload_stage_bytes(
            inputs.terms,
            inputs.full_terms,
            layout,
            inputs.layers_per_stage,
            stage,
            chunks_in_flight,
        )
    layers_in_flight = Fraction(inputs.layers_per_stage, layout.vp) * chunks_in_flight
    return (
        layers_in_flight * inputs.layer_activations,
        layers_in_flight * inputs.layer_statistics,
        Fraction(0),
        Fraction(0),
    )


def _logits_bytes(inputs: _PlanInputs, stage: int) -> Fraction:
    """The last stage's loss at its peak beyond its kept tensors (0 on the other stages):
    :func:`.transient_bytes.loss_peak_terms`, megatron's loss (the bf16 logits beside the kept
    fp32 softmax, or the output layer's backward) or the tiled loss's (one tile's logits, the
    hidden states' gradient, the fp32 weight gradient), exact on the emulated NPU."""
    layout = inputs.layout
    if stage != layout.pp - 1:
        return Fraction(0)
    options = {k: v for k, v in inputs.term_options.items() if k not in ("recompute", "profile")}
    return act.sum_terms(
        tb.loss_peak_terms(
            inputs.model,
            inputs.seq_length,
            layout.micro_batch_size,
            loss_chunk_size=layout.loss_chunk_size,
            **options,
        )
    )


def _stage_plan(inputs: _PlanInputs, stage: int) -> StagePlan:
    """Pipeline stage ``stage``'s device bytes by category and its host bytes (with the exact
    DDP state, :func:`.ddp_state.exact_ddp_stage`, its worst and its fullest rank's)."""
    model, layout = inputs.model, inputs.layout
    parameters = sum(stage_parameters(model, layout.tp, layout.pp, stage).values())
    chunks_in_flight = layout.in_flight(stage)
    embeddings_and_loss, decoder = _outside_layers_bytes(
        model, inputs.seq_length, layout, stage, inputs.term_options
    )
    logits = _logits_bytes(inputs, stage)
    sharded = (
        _fsdp_stage_bytes(model, layout, stage, inputs.param_bytes, inputs.grad_bytes)
        if layout.fsdp
        else {}
    )
    transient = sum(sharded.get(name, 0) for name in FSDP_CATEGORIES)
    streamed = (
        stream_device_bytes(model, layout, inputs.param_bytes) if layout.stream_weights else {}
    )
    transient += sum(streamed.values())  # the units in flight are allocated step by step
    kept_activations, kept_statistics, offload_buffers, host_activations = _stage_activations(
        inputs, stage, chunks_in_flight
    )
    dynamic = (
        transient
        + offload_buffers
        + kept_activations
        + kept_statistics
        + embeddings_and_loss
        + decoder
        + logits
        + inputs.workspace
        + inputs.communication
    )
    nbytes = {
        "weights": parameters * inputs.param_bytes,
        "gradients": device_gradient_bytes(parameters, layout),
        "optimizer_state": _ceil(parameters * inputs.optimizer_per_parameter),
        "activations": _ceil(kept_activations + decoder),
        "attention_statistics": _ceil(kept_statistics),
        "embeddings_and_loss": _ceil(embeddings_and_loss),
        "logits_buffers": _ceil(logits),
        "recompute_workspace": _ceil(inputs.workspace),
        "communication_buffers": _ceil(inputs.communication),
        "runtime_reserve": inputs.runtime_reserve,
        "collective_library_buffers": collective_library_bytes(
            model, layout, inputs.hardware, stage
        ),
        "allocator_fragmentation": _ceil(inputs.fragmentation * dynamic),
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
    if layout.stream_weights:  # FSDP2 + CPUOffloadPolicy: the state on the host (.streaming)
        nbytes.update(streamed)
        host_bytes.update(stream_host_bytes(model, layout))
    elif exact_ddp_state(layout):  # the distributed optimizer with offload or bf16 gradients
        nbytes, host_bytes, rank_host = exact_ddp_stage(
            model, layout, stage, inputs.param_bytes, nbytes, host_bytes
        )
    return StagePlan(
        stage,
        parameters,
        inputs.layers_per_stage,
        chunks_in_flight,
        nbytes,
        host_bytes,
        rank_host,
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
