"""Step-time model: seconds per training step of a layout on a hardware profile.

Per device and micro-batch of ``b`` sequences of ``s`` tokens (``s_c = s/cp`` local
tokens, ``B`` = 2 bytes per bf16 element, ``X`` = achievable FLOP/s = peak x achievable
fraction; FLOPs from :func:`.flops.forward_flops`, causal attention halved):

* compute of one layer: ``(3·G + 3.5·K + R) / (tp·cp) / X`` with ``G`` the projections' and
  MLP's forward FLOPs, ``K`` the attention kernel's (the fused backward is 2.5x its
  forward), ``R`` the recompute FLOPs of ``layout.recompute`` per layer
  (:func:`.flops.recompute_overhead` by mode name; under partial recompute the layers'
  shares of ``full`` and of the mode, :meth:`.layout.Layout.recompute_shares`). Load-balanced ring CP gives every rank
  chunks ``r`` and ``2cp-1-r`` and so ``1/cp`` of the causal work. The last pipeline stage
  also runs the logits, ``3·2·b·s·h·V / (tp·cp) / X``; it is the stage that sets the pace.
* TP (sequence parallel): every all-gather / reduce-scatter moves the ``[s_c, b, h]``
  tensor, ``(tp-1)/tp · s_c·b·h·B / bw`` seconds; 4 in the forward, 4 in the backward,
  plus those the recompute re-runs (:data:`RECOMPUTE_COMMUNICATION`). Exposed unless
  ``tp_comm_overlap`` (then only what the layer's GEMMs do not hide).
* CP ring, per layer: ``cp-1`` hops of the local K/V, ``2·s_c·b·g_t·d·B`` bytes forward
  and K/V + fp32 dK/dV, ``2·s_c·b·g_t·d·(B+4)``, backward (``g_t = max(1, g/tp)`` KV heads);
  each hop hides behind one block of the kernel (``1/cp`` of the rank's kernel time):
  exposed ``(cp-1)·max(0, hop - block)``, once more for the share of layers whose recompute
  re-runs the kernel.
* PP: a ``[s_c, b, h]/tp`` activation forward and its gradient backward at every chunk
  boundary (``2·vp`` sends per micro-batch), exposed; the 1F1B bubble
  :func:`.flops.pipeline_bubble` multiplies the ``m`` micro-batches' time.
* DP over ``dp·cp`` ranks: the distributed optimizer reduce-scatters fp32 gradients
  (4 B/param; 2 with ``--grad-reduce-in-bf16``) and all-gathers bf16 parameters (2 B/param) of the device's stage,
  ``(n-1)/n · bytes / bw``; without it one fp32 all-reduce (twice the reduce-scatter).
  ``layout.overlap_grad_reduce`` hides the reduction behind the last micro-batch's backward,
  ``overlap_param_gather`` the gather behind the first forward.

* Megatron-FSDP (``layout.fsdp``), per micro-batch over the ``n = dp·cp`` sharding ranks
  (``N_u`` = a unit's padded elements, :mod:`.fsdp`): ``optim_grads_params`` all-gathers each
  unit's bf16 parameters before its forward and again before its backward,
  ``(n-1)/n · N_u·B / bw``; ``optim_grads`` and ``optim_grads_params`` reduce-scatter each
  unit's fp32 gradients after its backward, ``(n-1)/n · 4·N_u / bw`` (``2·N_u`` with bf16 main
  gradients). Each hides behind the
  compute of the neighbouring layer (forward or backward): exposed ``max(0, comm - layer)``,
  except the forward's first all-gather and the backward's last reduce-scatter, exposed
  whole; the non-unit groups (final norm, output layer) are gathered and reduced exposed.
  The per-step DP terms then vanish (``optim_grads`` keeps the all-gather of its unsharded
  weights after the step).

* Host offload (``H`` = the profile's host<->device bytes/s per device, one direction):
  each of the ``N = activation_offload_layers`` offloaded layers of a stage copies its kept
  tensors (``A`` bytes, :func:`.activations.layer_terms` of its recompute mode) to the host
  after its forward and back before its backward, each hidden behind one layer's compute:
  exposed ``N·(max(0, A/H - forward) + max(0, A/H - backward))`` per micro-batch. The
  offloaded optimizer (fraction ``F`` of the ``P/(dp·cp)``-element shard): its host step,
  ``ranks per node · F·P/(dp·cp) / E`` (``E`` = the node's host AdamW elements/s, shared
  by its ranks), and its copies, fp32 gradients down (also with bf16 main gradients: the
  host copy is fp32, the cast assumed on the device) and bf16 parameters up,
  ``6·F·P/(dp·cp) / H``; once per step, their sum, or with ``overlap_cpu_optimizer``
  (``--overlap-cpu-optimizer-d2h-h2d``) the larger of the two.

A group uses the intra-node bandwidth when its ranks fit in one node (Megatron orders ranks
TP, CP, DP, PP: TP spans ``tp`` consecutive ranks, CP ``tp·cp``, DP ``tp·cp·dp``, PP all),
else the inter-node one. Not modelled: kernel launch and optimizer-step time, memory-bound
elementwise ops (norms, RoPE, SwiGLU) beyond what the achievable fraction absorbs, network
contention between groups, the host's memory bandwidth shared by activation copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from . import activations as act
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
from .layout import Layout
from .models import ModelShape
from .parameters import stage_parameters

__all__ = [
    "StepTime",
    "predict_step_time",
    "RECOMPUTE_COMMUNICATION",
    "BREAKDOWN_KEYS",
    "FSDP_BREAKDOWN_KEYS",
    "OFFLOAD_BREAKDOWN_KEYS",
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
    "host_optimizer_step",
    "optimizer_offload_copies",
)
OFFLOAD_COPY_BYTES = 6  # per offloaded element and step: fp32 gradient down, bf16 parameter up


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
    layout: Layout, hw: HardwareProfile, shard_elements: float
) -> dict[str, float]:
    """Seconds per step of the offloaded optimizer: its host step and its copies."""
    offloaded = layout.optimizer_offload_fraction * shard_elements
    if not offloaded:
        return {}
    ranks_per_node = min(hw.devices_per_node, layout.num_devices)
    step = ranks_per_node * offloaded / hw.host("host_optimizer_elements_per_s")
    copies = OFFLOAD_COPY_BYTES * offloaded / hw.host("host_device_bandwidth")
    if layout.overlap_cpu_optimizer:  # the copies of one group overlap the step of another
        return {"host_optimizer_step": max(step, copies), "optimizer_offload_copies": 0.0}
    return {"host_optimizer_step": step, "optimizer_offload_copies": copies}


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
) -> StepTime:
    """Predicted seconds per step of ``model`` at ``seq_length`` tokens under ``layout`` on
    ``hardware``.

    ``mean_document_length`` (tokens; None = one document per sequence) scales the attention
    kernel's FLOPs as in :mod:`.flops`. ``layout.global_batch_size`` None means ``pp``
    micro-batches per step. ``activation_profile`` (:data:`.activations.PROFILES`) sizes
    what activation offload copies.
    """
    m, hw, lay = model, hardware, layout
    if lay.recompute not in RECOMPUTE_COMMUNICATION:
        raise ValueError(
            f"recompute {lay.recompute!r}: the step-time model knows {tuple(RECOMPUTE_COMMUNICATION)}"
        )
    if m.num_layers % (lay.pp * lay.vp):
        raise ValueError(
            f"num_layers ({m.num_layers}) must be divisible by pp x vp = {lay.pp * lay.vp}"
        )
    b, s, L, B = lay.micro_batch_size, seq_length, m.num_layers, dtype_bytes
    shards, s_c = lay.tp * lay.cp, seq_length / lay.cp
    speed = hw.achievable_flops
    micro = lay.num_microbatches or lay.pp
    stage_layers = L // lay.pp

    # compute of one layer and the logits, one micro-batch, this device (seconds)
    fl = forward_flops(m, s, b, mean_document_length)
    gemm_fwd = (fl["attention_projections"] + fl["mlp"]) / shards / speed
    kernel_fwd = fl["attention_kernel"] / shards / speed
    shares = lay.recompute_shares(L)  # partial recompute: some layers full, the rest lay.recompute
    overhead = sum(
        weight * recompute_overhead(m, s, mode, True, mean_document_length)
        for weight, mode in shares
    )
    recompute = overhead * step_flops(m, s, True, mean_document_length) * b / L / shards / speed
    logits = (1 + GEMM_BACKWARD) * fl["logits"] / shards / speed
    gemm = (1 + GEMM_BACKWARD) * gemm_fwd
    kernel = (1 + FUSED_ATTENTION_BACKWARD) * kernel_fwd

    # tensor parallelism, per layer
    tp_repeats = sum(weight * RECOMPUTE_COMMUNICATION[mode][0] for weight, mode in shares)
    reruns_kernel = sum(weight for weight, mode in shares if RECOMPUTE_COMMUNICATION[mode][1])
    collective = _ring(lay.tp, s_c * b * m.hidden_size * B, _bandwidth(hw, lay.tp))
    tp_layer = (TP_COLLECTIVES_PER_LAYER + tp_repeats) * collective
    if tp_comm_overlap:
        tp_layer = max(0.0, tp_layer - gemm)

    # context-parallel ring, per layer
    cp_layer, hop_fwd, hop_bwd = 0.0, 0.0, 0.0
    if lay.cp > 1:
        g_t = max(1.0, m.num_query_groups / lay.tp)
        kv = 2 * s_c * b * g_t * m.head_dim
        bandwidth = _bandwidth(hw, shards)
        hop_fwd, hop_bwd = kv * B / bandwidth, kv * (B + 4) / bandwidth
        block_fwd, block_bwd = kernel_fwd / lay.cp, FUSED_ATTENTION_BACKWARD * kernel_fwd / lay.cp
        exposed_fwd, exposed_bwd = max(0.0, hop_fwd - block_fwd), max(0.0, hop_bwd - block_bwd)
        cp_layer = (lay.cp - 1) * (exposed_fwd * (1 + reruns_kernel) + exposed_bwd)

    # pipeline sends, per micro-batch
    pp_send = 0.0
    if lay.pp > 1:
        activation = s_c * b * m.hidden_size * B / (lay.tp if lay.sp else 1)
        pp_send = 2 * lay.vp * activation / _bandwidth(hw, lay.num_devices)

    n, dp_bandwidth = lay.dp * lay.cp, _bandwidth(hw, shards * lay.dp)
    layer_forward = gemm_fwd + kernel_fwd
    layer_backward = (gemm - gemm_fwd) + (kernel - kernel_fwd) + recompute
    sharded = lay.fsdp in ("optim_grads", "optim_grads_params")
    fsdp_micro = {}
    if sharded:  # the slowest stage's collectives
        per_stage = [
            _fsdp_per_micro_batch(m, lay, st, dp_bandwidth, layer_forward, layer_backward, B)
            for st in range(lay.pp)
        ]
        fsdp_micro = max(per_stage, key=lambda parts: sum(parts.values()))
    offload_micro = {}
    if lay.activation_offload_layers:
        copy = kept_layer_bytes(m, s, lay, activation_profile, B) / hw.host("host_device_bandwidth")
        offload_micro["activation_offload_exposed"] = lay.activation_offload_layers * (
            max(0.0, copy - layer_forward) + max(0.0, copy - layer_backward)
        )
    per_micro = {
        "gemm": stage_layers * gemm,
        "attention_kernel": stage_layers * kernel,
        "recompute": stage_layers * recompute,
        "logits": logits,
        "tp_communication": stage_layers * tp_layer,
        "cp_ring_exposed": stage_layers * cp_layer,
        "pp_send_recv": pp_send,
        **fsdp_micro,
        **offload_micro,
    }
    breakdown = {key: micro * seconds for key, seconds in per_micro.items()}
    micro_batch_s = sum(per_micro.values())
    breakdown["pipeline_bubble"] = pipeline_bubble(lay.pp, micro, lay.vp) * sum(breakdown.values())
    fsdp_parts = {
        key: breakdown.pop(key)
        for key in FSDP_BREAKDOWN_KEYS + OFFLOAD_BREAKDOWN_KEYS
        if key in breakdown
    }

    # data parallelism (and CP: gradients are reduced over dp x cp), once per step
    params = max(sum(stage_parameters(m, lay.tp, lay.pp, st).values()) for st in range(lay.pp))
    bandwidth = dp_bandwidth
    grad = 2 if lay.grad_reduce_in_bf16 else 4  # --grad-reduce-in-bf16 reduces bf16 gradients
    grad_reduce = _ring(n, params * grad, bandwidth) * (1 if lay.distributed_optimizer else 2)
    param_gather = _ring(n, params * B, bandwidth) if lay.distributed_optimizer else 0.0
    if sharded:  # reduced every micro-batch (above); optim_grads_params gathers in the forward
        grad_reduce = 0.0
        param_gather = param_gather if lay.fsdp == "optim_grads" else 0.0
    backward = (
        stage_layers * ((gemm - gemm_fwd) + (kernel - kernel_fwd) + recompute)
        + logits * GEMM_BACKWARD / 3
    )
    forward = stage_layers * (gemm_fwd + kernel_fwd) + logits / 3
    breakdown["dp_grad_reduce_exposed"] = (
        max(0.0, grad_reduce - backward) if lay.overlap_grad_reduce else grad_reduce
    )
    breakdown["dp_param_gather_exposed"] = (
        max(0.0, param_gather - forward) if overlap_param_gather else param_gather
    )
    breakdown.update(fsdp_parts)
    breakdown.update(_offload_per_step(lay, hw, params / n))

    tokens = micro * b * lay.dp  # sequences per step
    one = forward_flops(m, s, 1, mean_document_length)  # one sequence; the kernel counted dense: x2
    megatron = (1 + GEMM_BACKWARD) * (
        L * (one["attention_projections"] + one["mlp"] + 2 * one["attention_kernel"])
        + one["logits"]
    )
    details = {
        "tp_collective_s": collective,
        "cp_hop_forward_s": hop_fwd,
        "cp_hop_backward_s": hop_bwd,
        "cp_block_forward_s": kernel_fwd / lay.cp,
        "dp_grad_reduce_s": grad_reduce,
        "dp_param_gather_s": param_gather,
        "recompute_overhead": overhead,
        "micro_batch_s": micro_batch_s,
        "pipeline_fill_s": (lay.pp - 1) * forward,
    }
    return StepTime(
        model=m,
        seq_length=seq_length,
        layout=lay,
        hardware=hw,
        num_microbatches=micro,
        breakdown=breakdown,
        model_flops_per_step=tokens * step_flops(m, s, True, mean_document_length),
        megatron_flops_per_step=tokens * megatron,
        details=details,
        mean_document_length=mean_document_length,
    )
