"""Step-time model: seconds per training step of a layout on a hardware profile.

:func:`predict_step_time` returns a :class:`StepTime`: per device, the step's seconds by
part (:data:`BREAKDOWN_KEYS`; with Megatron-FSDP also :data:`FSDP_BREAKDOWN_KEYS`, with
host offload :data:`OFFLOAD_BREAKDOWN_KEYS`, with sequence tiling
:data:`TILING_BREAKDOWN_KEYS`; the parts add up to the step time), its model
FLOPs in two conventions (MFU) and the details behind the communication terms (seconds).
Compute is :mod:`.flops`' FLOPs at the profile's achievable FLOP/s (peak x achievable
fraction), split over ``tp·cp`` (load-balanced ring CP gives every rank ``1/cp`` of the
causal work); every collective is a ring over its group, at the intra-node bandwidth when
the group's ranks fit in one node (Megatron orders ranks TP, CP, DP, PP), else the
inter-node one; a communication is exposed only where the compute it overlaps does not
hide it. The last pipeline stage, which also runs the logits, sets the pace; the 1F1B
bubble (:func:`.flops.pipeline_bubble`) scales the micro-batches' time. The equations term
by term, what is not modelled and the validation against published figures:
docs/step-time.md; the sequence tiles' terms: docs/planner.md ("Sequence tiling").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from . import activation_bytes as act
from .flops import (
    FUSED_ATTENTION_BACKWARD,
    GEMM_BACKWARD,
    forward_flops,
    pipeline_bubble,
    recompute_overhead,
    step_flops,
)
from .fsdp import stage_groups
from .hardware import HardwareProfile
from .models import ModelShape
from .parallel_layout import Layout
from .parameters import stage_parameters
from .streaming import (
    stream_accumulation_seconds,
    stream_copy_seconds,
    stream_shard_elements,
    stream_units,
)

__all__ = [
    "StepTime",
    "predict_step_time",
    "RECOMPUTE_COMMUNICATION",
    "BREAKDOWN_KEYS",
    "FSDP_BREAKDOWN_KEYS",
    "OFFLOAD_BREAKDOWN_KEYS",
    "TILING_BREAKDOWN_KEYS",
    "TILE_EFFICIENCY",
    "kept_layer_bytes",
]

# per recompute mode: TP all-gathers/reduce-scatters its re-run forward repeats per layer,
# and whether it re-runs the attention kernel (and so the CP ring's forward hops)
RECOMPUTE_COMMUNICATION = {
    "none": (0, False),
    "core_attention": (0, True),  # the kernel alone
    "qkv": (1, False),  # input norm + QKV projection + RoPE: the input all-gather
    "attention": (2, True),  # the attention sub-block: all-gather in, reduce-scatter out
    "full": (4, True),  # the whole layer
}
TP_COLLECTIVES_PER_LAYER = (
    8  # all-gather before QKV and fc1, reduce-scatter after proj and fc2; x2 for backward
)
BREAKDOWN_KEYS = (
    "gemm",
    "attention_kernel",
    "recompute",
    "logits",
    "tp_communication",
    "cp_ring_exposed",
    "pp_send_recv",
    "pipeline_bubble",
    "dp_grad_reduce_exposed",
    "dp_param_gather_exposed",
)
# the breakdown's extra parts under Megatron-FSDP (absent without it)
FSDP_BREAKDOWN_KEYS = ("fsdp_param_gather_exposed", "fsdp_grad_reduce_exposed")
# the breakdown's extra parts under host offload (absent without it)
OFFLOAD_BREAKDOWN_KEYS = (
    "activation_offload_exposed",
    "weight_streaming_exposed",
    "host_gradient_accumulation",
    "host_optimizer_step",
    "optimizer_offload_copies",
)
OFFLOAD_COPY_BYTES = 6  # per offloaded element and step: fp32 gradient down, bf16 parameter up
# the breakdown's extra parts under sequence tiling (absent without it): what the tiles add,
# their recomputed forward and their GEMMs' lower efficiency
TILING_BREAKDOWN_KEYS = ("loss_tiling", "mlp_tiling")
# ASSUMPTION (not measured): the speed of a tile's GEMMs relative to the untiled ones (the
# search's tiles are 4096 and h tokens, GEMMs of [4096..8192, h] x [h, V/tp or 2f/tp]);
# predict_step_time(tile_efficiency=...), halved in --sensitivity
TILE_EFFICIENCY = 1.0
# TP collectives the tiled MLP's recomputed forward repeats per layer: fc1's all-gather, fc2's
# reduce-scatter
TILED_MLP_COLLECTIVES = 2


@dataclass
class StepTime:
    """The result of :func:`predict_step_time`; times in seconds per step, per device (text
    form: :func:`mcore_flash.planning.report.format_step_time`)."""

    model: ModelShape
    seq_length: int
    layout: Layout
    hardware: HardwareProfile
    num_microbatches: int
    breakdown: dict[str, float]
    model_flops_per_step: (
        float  # forward + backward without recompute, all devices (our convention)
    )
    megatron_flops_per_step: float  # 6 x parameters x tokens + 12 L a d s D per sequence
    details: dict[str, float] = field(default_factory=dict)
    mean_document_length: Optional[float] = None

    @property
    def step_time_s(self) -> float:
        return sum(self.breakdown.values())

    @property
    def longest_phase_s(self) -> float:
        """Seconds of the longest stretch a rank runs between two of the watchdog's progress
        marks: one micro-batch's forward and backward on the slowest stage (counted together,
        an upper bound of either), the last stage's wait for the first micro-batch's forward
        through the stages before it, the gradient reduction, the parameter all-gather, or
        the offloaded optimizer's host step with its copies."""
        host = self.breakdown.get("host_optimizer_step", 0.0) + self.breakdown.get(
            "optimizer_offload_copies", 0.0
        )
        return max(
            self.details["micro_batch_s"],
            self.details["pipeline_fill_s"],
            self.details["dp_grad_reduce_s"],
            self.details["dp_param_gather_s"],
            host,
        )

    @property
    def tokens_per_step(self) -> int:
        return (
            self.num_microbatches * self.layout.micro_batch_size * self.layout.dp * self.seq_length
        )

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.step_time_s / self.layout.num_devices

    def _utilisation(self, flops: float) -> float:
        return flops / (
            self.step_time_s * self.layout.num_devices * self.hardware.peak_bf16_tflops * 1e12
        )

    @property
    def mfu(self) -> float:
        """Model FLOPs (:func:`.flops.step_flops`: causal attention, fused backward 2.5x,
        no recompute) over the devices' peak."""
        return self._utilisation(self.model_flops_per_step)

    @property
    def mfu_megatron(self) -> float:
        """MFU in the convention NVIDIA's and MindSpeed-LLM's published figures use: 6 FLOPs
        per parameter (output layer included, input embedding not) per token plus
        ``12·L·a·d·s`` per token for attention, counted dense (not causal)."""
        return self._utilisation(self.megatron_flops_per_step)

    def to_dict(self) -> dict:
        return {
            "hardware": self.hardware.name,
            "step_time_s": self.step_time_s,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "mfu": self.mfu,
            "mfu_megatron": self.mfu_megatron,
            "num_microbatches": self.num_microbatches,
            "breakdown_s": dict(self.breakdown),
            "details": dict(self.details),
        }


def _bandwidth(hw: HardwareProfile, ranks_spanned: int) -> float:
    """Bytes/s per device for a group whose ranks span ``ranks_spanned`` consecutive ranks."""
    return (
        hw.intra_node_bandwidth if ranks_spanned <= hw.devices_per_node else hw.inter_node_bandwidth
    )


def _ring(n: int, nbytes: float, bandwidth: float) -> float:
    """Seconds of a ring all-gather or reduce-scatter of ``nbytes`` (the full tensor) over ``n`` ranks."""
    return (n - 1) / n * nbytes / bandwidth if n > 1 else 0.0


def _fsdp_per_micro_batch(
    model: ModelShape,
    layout: Layout,
    stage: int,
    bandwidth: float,
    layer_forward: float,
    layer_backward: float,
    dtype_bytes: int,
) -> dict[str, float]:
    """Exposed seconds of Megatron-FSDP's collectives in one micro-batch on stage ``stage``:
    ``(all-gathers, reduce-scatters)`` of its units and non-unit groups, each unit's hidden
    behind one layer's compute (``layer_forward`` / ``layer_backward`` seconds) but the
    first gather and the last reduction."""
    n, strategy = layout.sharding_ranks, layout.fsdp
    buckets = stage_groups(model, layout.tp, layout.pp, stage, strategy)
    units = [b.size(n, strategy) for b in buckets if b.unit is not None]
    loose = sum(b.size(n, strategy) for b in buckets if b.unit is None)
    gather = 0.0
    if strategy == "optim_grads_params":
        gathers = [_ring(n, size * dtype_bytes, bandwidth) for size in units]
        gather = gathers[0] + sum(max(0.0, t - layer_forward) for t in gathers[1:])
        gather += sum(max(0.0, t - layer_backward) for t in gathers)  # again for the backward
        gather += 2 * _ring(n, loose * dtype_bytes, bandwidth)
    reduce = 0.0
    if strategy in ("optim_grads", "optim_grads_params"):
        grad = 2 if layout.grad_reduce_in_bf16 else 4  # the main-gradient dtype's bytes
        reduces = [_ring(n, size * grad, bandwidth) for size in units]
        reduce = reduces[0] + sum(max(0.0, t - layer_backward) for t in reduces[1:])
        reduce += _ring(n, loose * grad, bandwidth)
    return {"fsdp_param_gather_exposed": gather, "fsdp_grad_reduce_exposed": reduce}


def kept_layer_bytes(
    model: ModelShape, seq_length: int, layout: Layout, profile: str = "npu", dtype_bytes: int = 2
) -> float:
    """Bytes the mean layer keeps for backward, one micro-batch, this device (what activation
    offload copies): the layers' shares of their recompute modes (:meth:`.Layout.recompute_shares`)."""
    return float(
        sum(
            weight
            * act.sum_terms(
                act.layer_terms(
                    model,
                    seq_length,
                    layout.micro_batch_size,
                    tp=layout.tp,
                    cp=layout.cp,
                    sequence_parallel=layout.sp,
                    recompute=mode,
                    profile=profile,
                    dtype_bytes=dtype_bytes,
                )
            )
            for weight, mode in layout.recompute_shares(model.num_layers)
        )
    )


def _offload_per_step(
    model: ModelShape, layout: Layout, hw: HardwareProfile, shard_elements: float, micro: int
) -> dict[str, float]:
    """Seconds per step of the optimizer on the host: its host step (the node's ranks
    together at ``host_optimizer_elements_per_s``) and the offloaded optimizer's copies
    (none when streaming: the model's state lives on the host, :mod:`.streaming`; there the
    ``micro - 1`` micro-batches after the first accumulate their gradients on the host,
    :func:`.streaming.stream_accumulation_seconds`, the host's adds timed at the Adam step's
    rate: ASSUMPTION, an upper bound, AdamW reads and writes more bytes per element)."""
    ranks_per_node = min(hw.devices_per_node, layout.num_devices)
    offloaded = layout.optimizer_offload_fraction * shard_elements
    if not (layout.stream_weights or offloaded):
        return {}
    host_rate = hw.host("host_optimizer_elements_per_s")
    if layout.stream_weights:
        elements = stream_shard_elements(model, layout)
        accumulation = stream_accumulation_seconds(
            model, layout, hw.host("host_device_bandwidth"), host_rate / ranks_per_node
        )
        return {
            "host_gradient_accumulation": (micro - 1) * accumulation,
            "host_optimizer_step": ranks_per_node * elements / host_rate,
        }
    step = ranks_per_node * offloaded / host_rate
    copies = OFFLOAD_COPY_BYTES * offloaded / hw.host("host_device_bandwidth")
    if layout.overlap_cpu_optimizer:  # the copies of one group overlap the step of another
        return {"host_optimizer_step": max(step, copies), "optimizer_offload_copies": 0.0}
    return {"host_optimizer_step": step, "optimizer_offload_copies": copies}


@dataclass(frozen=True)
class _LayerCompute:
    """Seconds of one layer's compute (and of the last stage's logits), one micro-batch, this
    device: ``(3·G + 3.5·K + R) / (tp·cp) / X`` split into its parts, and what sequence
    tiling adds (0 untiled)."""

    gemm_forward: float  # the projections' and the MLP's forward, G / (tp·cp) / X
    kernel_forward: float  # the attention kernel's forward, K / (tp·cp) / X
    recompute: float  # the recompute's share of the step FLOPs, per layer
    logits: float  # forward and backward of the output layer (the last stage)
    overhead: float  # recompute FLOPs over the step's (:func:`.flops.recompute_overhead`)
    loss_tiling: float = 0.0  # the tiled loss: its recomputed logits, its tiles' efficiency
    mlp_tiling: float = 0.0  # per layer: the tiled MLP's recomputed forward, its tiles' efficiency

    @property
    def gemm(self) -> float:
        return (1 + GEMM_BACKWARD) * self.gemm_forward

    @property
    def kernel(self) -> float:
        return (1 + FUSED_ATTENTION_BACKWARD) * self.kernel_forward

    @property
    def forward(self) -> float:
        """One layer's forward."""
        return self.gemm_forward + self.kernel_forward

    @property
    def backward(self) -> float:
        """One layer's backward, its recompute (the tiled MLP's included)."""
        return (
            (self.gemm - self.gemm_forward)
            + (self.kernel - self.kernel_forward)
            + self.recompute
            + self.mlp_tiling
        )


@dataclass(frozen=True)
class _Step:
    """What every term of one prediction reads: ``model`` at ``seq_length`` tokens under
    ``layout`` on ``hw``, activations of ``dtype_bytes`` bytes an element, tiles' GEMMs at
    ``tile_efficiency`` of the untiled speed."""

    model: ModelShape
    seq_length: int
    layout: Layout
    hw: HardwareProfile
    dtype_bytes: int
    tile_efficiency: float = TILE_EFFICIENCY

    def check(self) -> None:
        """ValueError for a recompute mode or a layer split the model does not know, or a
        tile efficiency outside (0, 1]."""
        model, layout = self.model, self.layout
        if layout.recompute not in RECOMPUTE_COMMUNICATION:
            raise ValueError(
                f"recompute {layout.recompute!r}: the step-time model knows {tuple(RECOMPUTE_COMMUNICATION)}"
            )
        if model.num_layers % (layout.pp * layout.vp):
            raise ValueError(
                f"num_layers ({model.num_layers}) must be divisible by pp x vp = {layout.pp * layout.vp}"
            )
        if not 0 < self.tile_efficiency <= 1:
            raise ValueError(
                f"tile_efficiency {self.tile_efficiency}: the tiles' GEMM speed as a fraction of the "
                "untiled one, in (0, 1]"
            )

    @property
    def recompute_shares(self) -> list[tuple[float, str]]:
        """The layers' shares of their recompute modes (:meth:`.Layout.recompute_shares`)."""
        return self.layout.recompute_shares(self.model.num_layers)

    @property
    def mlp_tiled(self) -> bool:
        """Whether the MLPs run in tiles (:func:`.activation_bytes.mlp_tile_tokens`)."""
        lay = self.layout
        return act.mlp_tile_tokens(self.seq_length, lay.cp, lay.mlp_chunk_size) is not None


def _layer_compute(step: _Step, mean_document_length: Optional[float]) -> _LayerCompute:
    """One layer's compute and the logits, one micro-batch, this device; under partial
    recompute the layers' shares of ``full`` and of the mode. Sequence tiling runs the
    tiled GEMMs at ``step.tile_efficiency``: the tiled loss's four output-layer GEMM passes
    (forward, the tile's recomputed forward, backward's two) instead of three, the tiled
    MLP's forward, recomputed forward and backward (and full recompute's forward)."""
    model, seq_length, layout = step.model, step.seq_length, step.layout
    shards, speed = layout.tp * layout.cp, step.hw.achievable_flops
    fl = forward_flops(model, seq_length, layout.micro_batch_size, mean_document_length)
    overhead = sum(
        weight * recompute_overhead(model, seq_length, mode, True, mean_document_length)
        for weight, mode in step.recompute_shares
    )
    flops = step_flops(model, seq_length, True, mean_document_length)
    untiled = 1 + GEMM_BACKWARD  # a GEMM's forward and backward, in forward passes
    slower = 1 / step.tile_efficiency
    logits_forward = fl["logits"] / shards / speed
    mlp_runs = untiled + sum(weight for weight, mode in step.recompute_shares if mode == "full")
    return _LayerCompute(
        gemm_forward=(fl["attention_projections"] + fl["mlp"]) / shards / speed,
        kernel_forward=fl["attention_kernel"] / shards / speed,
        recompute=overhead * flops * layout.micro_batch_size / model.num_layers / shards / speed,
        logits=untiled * logits_forward,
        overhead=overhead,
        loss_tiling=(
            logits_forward * ((untiled + 1) * slower - untiled)
            if layout.loss_chunk_size is not None
            else 0.0
        ),
        mlp_tiling=(
            fl["mlp"] / shards / speed * ((mlp_runs + 1) * slower - mlp_runs)
            if step.mlp_tiled
            else 0.0
        ),
    )


def _tp_per_layer(
    step: _Step, compute: _LayerCompute, tp_comm_overlap: bool
) -> tuple[float, float]:
    """``(exposed seconds per layer, seconds of one collective)`` of the sequence-parallel
    all-gathers / reduce-scatters, those the recompute and the tiled MLP's recomputed
    forward re-run included."""
    model, layout = step.model, step.layout
    tp_repeats = sum(
        weight * RECOMPUTE_COMMUNICATION[mode][0] for weight, mode in step.recompute_shares
    ) + (TILED_MLP_COLLECTIVES if step.mlp_tiled else 0)
    tokens = step.seq_length / layout.cp * layout.micro_batch_size
    collective = _ring(
        layout.tp, tokens * model.hidden_size * step.dtype_bytes, _bandwidth(step.hw, layout.tp)
    )
    tp_layer = (TP_COLLECTIVES_PER_LAYER + tp_repeats) * collective
    if tp_comm_overlap:
        tp_layer = max(0.0, tp_layer - compute.gemm)
    return tp_layer, collective


def _cp_ring_per_layer(step: _Step, compute: _LayerCompute) -> tuple[float, float, float]:
    """``(exposed seconds per layer, forward hop, backward hop)`` of the context-parallel
    ring: each K/V hop hides behind one block of the kernel, the forward's again for the
    share of layers whose recompute re-runs the kernel."""
    model, layout, B = step.model, step.layout, step.dtype_bytes
    if layout.cp == 1:
        return 0.0, 0.0, 0.0
    reruns_kernel = sum(
        weight for weight, mode in step.recompute_shares if RECOMPUTE_COMMUNICATION[mode][1]
    )
    g_t = max(1.0, model.num_query_groups / layout.tp)
    kv = 2 * (step.seq_length / layout.cp) * layout.micro_batch_size * g_t * model.head_dim
    bandwidth = _bandwidth(step.hw, layout.tp * layout.cp)
    hop_fwd, hop_bwd = kv * B / bandwidth, kv * (B + 4) / bandwidth
    block_fwd = compute.kernel_forward / layout.cp
    block_bwd = FUSED_ATTENTION_BACKWARD * compute.kernel_forward / layout.cp
    exposed_fwd, exposed_bwd = max(0.0, hop_fwd - block_fwd), max(0.0, hop_bwd - block_bwd)
    return (layout.cp - 1) * (exposed_fwd * (1 + reruns_kernel) + exposed_bwd), hop_fwd, hop_bwd


def _pp_send_per_micro_batch(step: _Step) -> float:
    """Seconds of the activation and gradient sent at every chunk boundary, exposed."""
    layout = step.layout
    if layout.pp == 1:
        return 0.0
    tokens = step.seq_length / layout.cp * layout.micro_batch_size
    activation = (
        tokens * step.model.hidden_size * step.dtype_bytes / (layout.tp if layout.sp else 1)
    )
    return 2 * layout.vp * activation / _bandwidth(step.hw, layout.num_devices)


def _fsdp_slowest_stage(step: _Step, bandwidth: float, compute: _LayerCompute) -> dict[str, float]:
    """Megatron-FSDP's exposed seconds per micro-batch on the stage where they are largest
    (none without a sharded strategy)."""
    layout = step.layout
    if layout.fsdp not in ("optim_grads", "optim_grads_params"):
        return {}
    per_stage = [
        _fsdp_per_micro_batch(
            step.model,
            layout,
            stage,
            bandwidth,
            compute.forward,
            compute.backward,
            step.dtype_bytes,
        )
        for stage in range(layout.pp)
    ]
    return max(per_stage, key=lambda parts: sum(parts.values()))


def _activation_offload_per_micro_batch(
    step: _Step, compute: _LayerCompute, profile: str
) -> dict[str, float]:
    """Exposed seconds of the offloaded layers' copies, each hidden behind one layer's
    forward (down) and backward (up)."""
    layout = step.layout
    if not layout.activation_offload_layers:
        return {}
    kept = kept_layer_bytes(step.model, step.seq_length, layout, profile, step.dtype_bytes)
    copy = kept / step.hw.host("host_device_bandwidth")
    exposed = max(0.0, copy - compute.forward) + max(0.0, copy - compute.backward)
    return {"activation_offload_exposed": layout.activation_offload_layers * exposed}


def _streaming_per_micro_batch(
    step: _Step, compute: _LayerCompute, bandwidth: float
) -> dict[str, float]:
    """Exposed seconds of weight streaming in one micro-batch (none without it): the
    host-device copies beyond the compute they hide behind (:func:`.streaming.stream_copy_seconds`)
    and FSDP2's collectives over the ``dp * cp`` ranks, each layer's bf16 all-gather (forward
    and backward) and fp32 reduce-scatter beyond one layer's compute."""
    layout = step.layout
    if not layout.stream_weights:
        return {}
    _, exposed = stream_copy_seconds(
        step.model,
        layout,
        step.hw.host("host_device_bandwidth"),
        compute.forward,
        compute.backward,
    )
    units, _ = stream_units(step.model, layout.tp, layout.sharding_ranks)
    n = layout.sharding_ranks
    collectives = 0.0
    for unit in units:
        gather = _ring(n, unit.elements * step.dtype_bytes, bandwidth)
        reduce = _ring(n, unit.elements * 4, bandwidth)
        collectives += max(0.0, gather - compute.forward) + max(
            0.0, gather + reduce - compute.backward
        )
    return {"weight_streaming_exposed": exposed + collectives}


def _tiling_per_micro_batch(
    step: _Step, compute: _LayerCompute, stage_layers: int
) -> dict[str, float]:
    """Seconds sequence tiling adds to one micro-batch on the last stage
    (:data:`TILING_BREAKDOWN_KEYS`, each only where that part is tiled)."""
    parts = {}
    if step.layout.loss_chunk_size is not None:
        parts["loss_tiling"] = compute.loss_tiling
    if step.mlp_tiled:
        parts["mlp_tiling"] = stage_layers * compute.mlp_tiling
    return parts


def _dp_per_step(step: _Step, bandwidth: float) -> tuple[float, float, int]:
    """``(gradient reduction, parameter all-gather, parameters)``: seconds of the step's data-
    parallel collectives over the ``dp·cp`` ranks, not yet overlapped, and the largest
    stage's parameters on a device."""
    lay, n = step.layout, step.layout.dp * step.layout.cp
    params = max(
        sum(stage_parameters(step.model, lay.tp, lay.pp, st).values()) for st in range(lay.pp)
    )
    if lay.stream_weights:  # FSDP2 gathers and reduces every micro-batch (per micro-batch)
        return 0.0, 0.0, params
    grad = 2 if lay.grad_reduce_in_bf16 else 4  # --grad-reduce-in-bf16 reduces bf16 gradients
    grad_reduce = _ring(n, params * grad, bandwidth) * (1 if lay.distributed_optimizer else 2)
    gather = _ring(n, params * step.dtype_bytes, bandwidth) if lay.distributed_optimizer else 0.0
    if lay.fsdp in ("optim_grads", "optim_grads_params"):
        # reduced every micro-batch; optim_grads_params gathers in the forward
        grad_reduce = 0.0
        gather = gather if lay.fsdp == "optim_grads" else 0.0
    return grad_reduce, gather, params


def _megatron_flops_per_sequence(
    model: ModelShape, seq_length: int, mean_document_length: Optional[float]
) -> float:
    """FLOPs of one sequence in NVIDIA's and MindSpeed-LLM's convention (the kernel counted
    dense: twice the causal one)."""
    one = forward_flops(model, seq_length, 1, mean_document_length)
    return (1 + GEMM_BACKWARD) * (
        model.num_layers * (one["attention_projections"] + one["mlp"] + 2 * one["attention_kernel"])
        + one["logits"]
    )


def predict_step_time(
    model: ModelShape,
    seq_length: int,
    layout: Layout,
    hardware: HardwareProfile,
    *,
    mean_document_length: Optional[float] = None,
    dtype_bytes: int = 2,
    tp_comm_overlap: bool = False,
    overlap_param_gather: bool = False,
    activation_profile: str = "npu",
    tile_efficiency: float = TILE_EFFICIENCY,
) -> StepTime:
    """Predicted seconds per step of ``model`` at ``seq_length`` tokens under ``layout`` on
    ``hardware``.

    ``mean_document_length`` (tokens; None = one document per sequence) scales the attention
    kernel's FLOPs as in :mod:`.flops`. ``layout.global_batch_size`` None means ``pp``
    micro-batches per step. ``activation_profile`` (:data:`.activation_bytes.PROFILES`) sizes
    what activation offload copies. ``tile_efficiency`` (:data:`TILE_EFFICIENCY`, an
    assumption): the speed of the sequence tiles' GEMMs relative to the untiled ones.
    """
    step = _Step(model, seq_length, layout, hardware, dtype_bytes, tile_efficiency)
    step.check()
    lay = layout
    micro = lay.num_microbatches or lay.pp
    stage_layers = model.num_layers // lay.pp
    compute = _layer_compute(step, mean_document_length)
    tp_layer, collective = _tp_per_layer(step, compute, tp_comm_overlap)
    cp_layer, hop_fwd, hop_bwd = _cp_ring_per_layer(step, compute)
    dp_bandwidth = _bandwidth(hardware, lay.tp * lay.cp * lay.dp)
    per_micro = {
        "gemm": stage_layers * compute.gemm,
        "attention_kernel": stage_layers * compute.kernel,
        "recompute": stage_layers * compute.recompute,
        "logits": compute.logits,
        **_tiling_per_micro_batch(step, compute, stage_layers),
        "tp_communication": stage_layers * tp_layer,
        "cp_ring_exposed": stage_layers * cp_layer,
        "pp_send_recv": _pp_send_per_micro_batch(step),
        **_fsdp_slowest_stage(step, dp_bandwidth, compute),
        **_activation_offload_per_micro_batch(step, compute, activation_profile),
        **_streaming_per_micro_batch(step, compute, dp_bandwidth),
    }
    breakdown = {key: micro * seconds for key, seconds in per_micro.items()}
    breakdown["pipeline_bubble"] = pipeline_bubble(lay.pp, micro, lay.vp) * sum(breakdown.values())
    per_step_parts = {
        key: breakdown.pop(key)
        for key in FSDP_BREAKDOWN_KEYS + OFFLOAD_BREAKDOWN_KEYS
        if key in breakdown
    }

    # data parallelism (and CP: gradients are reduced over dp x cp), once per step
    grad_reduce, param_gather, params = _dp_per_step(step, dp_bandwidth)
    backward = (
        stage_layers * compute.backward + compute.logits * GEMM_BACKWARD / 3 + compute.loss_tiling
    )
    forward = stage_layers * compute.forward + compute.logits / 3
    breakdown["dp_grad_reduce_exposed"] = (
        max(0.0, grad_reduce - backward) if lay.overlap_grad_reduce else grad_reduce
    )
    breakdown["dp_param_gather_exposed"] = (
        max(0.0, param_gather - forward) if overlap_param_gather else param_gather
    )
    breakdown.update(per_step_parts)
    breakdown.update(_offload_per_step(model, lay, hardware, params / (lay.dp * lay.cp), micro))

    sequences = micro * lay.micro_batch_size * lay.dp  # per step
    megatron = _megatron_flops_per_sequence(model, seq_length, mean_document_length)
    details = {
        "tp_collective_s": collective,
        "cp_hop_forward_s": hop_fwd,
        "cp_hop_backward_s": hop_bwd,
        "cp_block_forward_s": compute.kernel_forward / lay.cp,
        "dp_grad_reduce_s": grad_reduce,
        "dp_param_gather_s": param_gather,
        "recompute_overhead": compute.overhead,
        # a later micro-batch's, with its gradients' accumulation on the host when streaming
        "micro_batch_s": sum(per_micro.values())
        + breakdown.get("host_gradient_accumulation", 0.0) / max(1, micro - 1),
        "pipeline_fill_s": (lay.pp - 1) * forward,
    }
    if lay.loss_chunk_size is not None or step.mlp_tiled:  # the assumption the parts rest on
        details["tile_efficiency"] = tile_efficiency
    return StepTime(
        model=model,
        seq_length=seq_length,
        layout=lay,
        hardware=hardware,
        num_microbatches=micro,
        breakdown=breakdown,
        model_flops_per_step=sequences * step_flops(model, seq_length, True, mean_document_length),
        megatron_flops_per_step=sequences * megatron,
        details=details,
        mean_document_length=mean_document_length,
    )
