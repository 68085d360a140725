"""Per-device memory plan for one parallel layout: the breakdown and a fits / does-not-fit verdict.

For every pipeline stage (the worst one decides) the plan adds up, in bytes per device:

* ``weights`` (bf16, 2 B/param), ``gradients`` (fp32 main grads, 4 B/param) and
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

The plan's compute estimates (recompute overhead, pipeline bubble) come from :mod:`.flops`;
a ``mean_document_length`` (packed documents) changes only the attention-kernel FLOPs
there, never the bytes: whatever the mask, the fused attention keeps per-token tensors only
(q, k, v, out and the softmax statistics).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Optional

from . import activations as act
from .flops import pipeline_bubble, recompute_overhead
from .models import ModelShape, get_model
from .parameters import optimizer_bytes_per_parameter, stage_parameters, total_parameters
from .units import format_bytes, parse_bytes

__all__ = ["Layout", "MemoryPlan", "StagePlan", "plan_memory", "recompute_flags", "CATEGORIES", "ESTIMATED_CATEGORIES"]

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
    "allocator_fragmentation",
)
ESTIMATED_CATEGORIES = (
    "logits_buffers",
    "recompute_workspace",
    "communication_buffers",
    "runtime_reserve",
    "allocator_fragmentation",
)

# what the user-facing recompute names mean in Megatron-LM flags
RECOMPUTE_FLAGS = {
    "none": [],
    "qkv": ["--recompute-granularity", "selective", "--recompute-modules", "qkv"],
    "attention": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "core_attention": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
}


def recompute_flags(layout: Layout) -> list[str]:
    """The ``mcore-flash pretrain`` flags (Megatron-LM's names) of ``layout``'s recompute."""
    if not layout.recompute_num_layers:
        return list(RECOMPUTE_FLAGS[layout.recompute])
    flags = ["--recompute-granularity", "full", "--recompute-method", "block"]
    flags += ["--recompute-num-layers", str(layout.recompute_num_layers)]
    modules = RECOMPUTE_FLAGS[layout.recompute][3:]  # after "--recompute-modules"
    return flags + (["--recompute-modules", *modules] if modules else [])


@dataclass(frozen=True)
class Layout:
    """A parallel layout: TP x PP x CP x DP devices, and how each trains.

    ``vp`` is the number of interleaved (virtual) pipeline chunks per rank (1 = plain 1F1B).
    ``recompute_num_layers`` > 0 is partial recompute: the first that many layers of each
    pipeline chunk are recomputed whole (Megatron's ``block`` method), the others use
    ``recompute``. ``global_batch_size`` (sequences) fixes the number of micro-batches per step
    ``m = global_batch_size / (micro_batch_size * dp)``; None = enough to fill the pipeline.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    vp: int = 1
    sequence_parallel: bool = True
    recompute: str = "none"
    recompute_num_layers: int = 0
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "dp", "vp", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.recompute not in act.RECOMPUTE_MODES:
            raise ValueError(f"recompute {self.recompute!r}: choose one of {act.RECOMPUTE_MODES}")
        if self.recompute_num_layers < 0 or (self.recompute_num_layers and self.recompute == "full"):
            raise ValueError(
                f"recompute_num_layers {self.recompute_num_layers}: the layers recomputed whole per pipeline chunk "
                "(>= 0), with a selective recompute mode for the others (not 'full', which recomputes every layer)"
            )
        if self.vp > 1 and self.pp == 1:
            raise ValueError("an interleaved schedule (vp > 1) needs pp > 1")
        if self.global_batch_size is not None and self.global_batch_size % (self.micro_batch_size * self.dp):
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not divisible by micro_batch_size x dp "
                f"= {self.micro_batch_size * self.dp}"
            )

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def recompute_shares(self, num_layers: int) -> list[tuple[float, str]]:
        """``(fraction of the layers, recompute mode)``: with partial recompute the first
        ``recompute_num_layers`` of each of the ``num_layers / (pp * vp)``-layer chunks are
        ``full``, the rest ``recompute``."""
        chunk_layers = num_layers // (self.pp * self.vp)
        if self.recompute_num_layers > chunk_layers:
            raise ValueError(
                f"recompute_num_layers {self.recompute_num_layers} exceeds the {chunk_layers} layers per pipeline "
                f"chunk ({num_layers} layers / (pp {self.pp} x vp {self.vp}))"
            )
        whole = self.recompute_num_layers / chunk_layers
        return [(whole, "full"), (1 - whole, self.recompute)] if whole else [(1.0, self.recompute)]

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def num_microbatches(self) -> Optional[int]:
        if self.global_batch_size is None:
            return None
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def in_flight(self, stage: int) -> int:
        """Model chunks x micro-batches whose activations stage ``stage`` holds at its peak."""
        if self.vp == 1:
            n = self.pp - stage
            return min(n, self.num_microbatches) if self.num_microbatches else n
        n = 2 * (self.pp - stage - 1) + (self.vp - 1) * self.pp + 1
        return min(n, self.num_microbatches * self.vp) if self.num_microbatches else n

    def to_dict(self) -> dict:
        out = asdict(self)
        out["num_devices"] = self.num_devices
        out["num_microbatches"] = self.num_microbatches
        return out


@dataclass
class StagePlan:
    stage: int
    parameters: int
    layers: int
    in_flight: int
    bytes: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass
class MemoryPlan:
    """The result of :func:`plan_memory`; ``per_device`` is the worst stage's breakdown."""

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
    mean_document_length: Optional[float] = None  # tokens per packed document; None = one per sequence
    notes: list[str] = field(default_factory=list)

    @property
    def worst_stage(self) -> StagePlan:
        return max(self.stages, key=lambda stage: stage.total)

    @property
    def per_device(self) -> dict[str, int]:
        return dict(self.worst_stage.bytes)

    @property
    def total(self) -> int:
        return self.worst_stage.total

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_memory is None else self.total <= self.device_memory

    @property
    def headroom(self) -> Optional[int]:
        return None if self.device_memory is None else self.device_memory - self.total

    @property
    def layer_bytes(self) -> int:
        """Saved bytes of one layer for one micro-batch (statistics included)."""
        return int(math.ceil(act.sum_terms(self.layer_terms)))

    @property
    def relative_step_time(self) -> float:
        return (1 + self.recompute_overhead) * (1 + self.pipeline_bubble)

    def verdict(self) -> str:
        if self.device_memory is None:
            return f"needs {format_bytes(self.total)} per device (no --device-memory given)"
        word = "FITS" if self.fits else "DOES NOT FIT"
        sign = "free" if self.fits else "over"
        return (
            f"{word}: {format_bytes(self.total)} of {format_bytes(self.device_memory)} per device "
            f"({format_bytes(abs(self.headroom))} {sign})"
        )

    def recompute_text(self) -> str:
        lay = self.layout
        if not lay.recompute_num_layers:
            return lay.recompute
        chunk = self.model.num_layers // (lay.pp * lay.vp)
        return f"full for {lay.recompute_num_layers} of {chunk} layers per chunk, {lay.recompute} for the others"

    def launch_command(self) -> str:
        from .search import launch_command

        return launch_command(self)

    def documents_line(self) -> str:
        """The packed documents (mean tokens each) and their attention-kernel FLOPs relative
        to one document per sequence (``mean_document_length / seq_length``)."""
        return (
            f"documents: packed, mean {self.mean_document_length:,} tokens (document masking): attention-kernel "
            f"FLOPs x {self.mean_document_length / self.seq_length:.4g} of one document per sequence"
        )

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
            "worst_stage": self.worst_stage.stage,
            "stages": [
                {
                    "stage": st.stage,
                    "parameters": st.parameters,
                    "layers": st.layers,
                    "in_flight": st.in_flight,
                    "bytes": st.bytes,
                    "total_bytes": st.total,
                }
                for st in self.stages
            ],
            "activation_bytes_per_layer": self.layer_bytes,
            "activation_bytes_per_layer_by_module": layer_by_module,
            "activation_terms_per_layer": [
                {"module": t.module, "name": t.name, "bytes": int(math.ceil(t.bytes)), "category": t.category}
                for t in self.layer_terms
            ],
            "recompute_overhead": self.recompute_overhead,
            "pipeline_bubble": self.pipeline_bubble,
            "relative_step_time": self.relative_step_time,
            "recompute_flags": recompute_flags(self.layout),
            "launch_command": self.launch_command(),
            "notes": self.notes,
        }

    def format_text(self) -> str:
        lay, m = self.layout, self.model
        lines = [
            f"{m.name}: {self.total_parameters:,} parameters; seq {self.seq_length:,}, micro-batch "
            f"{lay.micro_batch_size}, activations {self.dtype_bytes} B ({self.profile} profile)",
            f"layout: TP{lay.tp}{' SP' if lay.sp else ''} x PP{lay.pp}"
            f"{f' (v={lay.vp})' if lay.vp > 1 else ''} x CP{lay.cp} x DP{lay.dp} = {lay.num_devices} devices; "
            f"recompute {self.recompute_text()}; {'distributed' if lay.distributed_optimizer else 'replicated'} optimizer; "
            f"micro-batches/step {lay.num_microbatches or 'n/a'}",
            "",
            f"per-layer activations (one micro-batch, this device{', layers not recomputed whole' if lay.recompute_num_layers else ''}): "
            f"{format_bytes(self.layer_bytes)}",
        ]
        if self.mean_document_length is not None:
            lines.insert(1, self.documents_line())
        for module, nbytes in act.by_module(self.layer_terms).items():
            lines.append(f"  {module:<36} {format_bytes(nbytes):>12}")
        worst = self.worst_stage
        lines += [
            "",
            f"per device (stage {worst.stage} of {lay.pp}: {worst.layers} layers, {worst.in_flight} in flight, "
            f"{worst.parameters:,} parameters):",
        ]
        for name in CATEGORIES:
            mark = "  (estimate)" if name in ESTIMATED_CATEGORIES else ""
            lines.append(f"  {name:<26} {format_bytes(worst.bytes[name]):>12}{mark}")
        lines.append(f"  {'total':<26} {format_bytes(worst.total):>12}")
        if lay.pp > 1:
            lines.append("stages: " + ", ".join(f"{st.stage}: {format_bytes(st.total)}" for st in self.stages))
        lines += [
            "",
            f"compute overhead: recompute +{self.recompute_overhead:.1%}, pipeline bubble +{self.pipeline_bubble:.1%}",
            self.verdict(),
        ]
        lines += [f"note: {note}" for note in self.notes]
        lines += ["", "launch: " + self.launch_command()]
        return "\n".join(lines)


def _ceil(x: Fraction | float) -> int:
    return int(math.ceil(x))


def plan_memory(
    model,
    seq_length: int,
    layout: Layout,
    *,
    device_memory=None,
    profile: str = "npu",
    dtype_bytes: int = 2,
    param_bytes: int = 2,
    grad_bytes: int = 4,
    runtime_reserve="2GiB",
    fragmentation: float = 0.05,
    activation_profile: Optional[act.Profile] = None,
    mean_document_length: Optional[float] = None,
) -> MemoryPlan:
    """The per-device memory plan of ``model`` at ``seq_length`` (tokens) under ``layout``.

    ``profile`` names the device behaviour (:data:`activations.PROFILES`; ``npu`` for the
    Ascend recipes) unless ``activation_profile`` gives one. ``device_memory`` (bytes or
    ``"64GB"``) makes the verdict. ``mean_document_length`` (tokens; None = one document
    per sequence) scales the attention FLOPs of the recompute overhead, not the bytes.
    """
    m = get_model(model)
    prof = activation_profile or act.PROFILES[profile]
    lay = layout
    if m.num_layers % (lay.pp * lay.vp):
        raise ValueError(f"num_layers ({m.num_layers}) must be divisible by pp x vp = {lay.pp * lay.vp}")
    if seq_length % (2 * lay.cp) and lay.cp > 1:
        raise ValueError(f"seq_length {seq_length} must be divisible by 2 x cp = {2 * lay.cp} (load-balanced ring CP)")
    if lay.sp and seq_length // lay.cp % lay.tp:
        raise ValueError(f"the local sequence {seq_length // lay.cp} must be divisible by tp {lay.tp} (sequence parallel)")
    dims = dict(
        tp=lay.tp,
        cp=lay.cp,
        sequence_parallel=lay.sp,
        recompute=lay.recompute,
        profile=prof,
        dtype_bytes=dtype_bytes,
    )
    terms = act.layer_terms(m, seq_length, lay.micro_batch_size, **dims)
    none_terms = act.layer_terms(m, seq_length, lay.micro_batch_size, **{**dims, "recompute": "none"})
    full_terms = act.layer_terms(m, seq_length, lay.micro_batch_size, **{**dims, "recompute": "full"})
    shares = lay.recompute_shares(m.num_layers)
    whole = lay.recompute_num_layers  # partial recompute: layers per chunk recomputed whole
    # mean bytes per layer of a chunk: `whole` layers keep their input, the others `terms`
    share = Fraction(whole, m.num_layers // (lay.pp * lay.vp))
    layer_acts = share * act.sum_terms(full_terms) + (1 - share) * act.sum_terms(terms, "activations")
    layer_stats = (1 - share) * act.sum_terms(terms, "attention_stats")

    s_c = Fraction(seq_length, lay.cp)
    s_t = s_c / lay.tp if lay.sp else s_c
    b, B, h = lay.micro_batch_size, dtype_bytes, m.hidden_size
    f_t = Fraction(m.ffn_hidden_size * (2 if m.gated else 1), lay.tp)
    g_t = Fraction(m.num_query_groups, lay.tp) if m.num_query_groups >= lay.tp else Fraction(1)
    if lay.recompute == "full" or whole:
        workspace = act.sum_terms(none_terms)
    elif lay.recompute == "attention":
        workspace = sum((t.bytes for t in none_terms if t.scope == "attention"), Fraction(0))
    elif lay.recompute == "qkv":  # the replayed prelude and q, k, v: the attention terms not kept
        kept = {(t.module, t.name) for t in terms}
        workspace = sum((t.bytes for t in none_terms if t.scope == "attention" and (t.module, t.name) not in kept), Fraction(0))
    else:
        workspace = Fraction(0)
    workspace += s_c * b * (f_t + 2 * h) * B  # gradients in flight inside a layer's backward
    comm = Fraction(0)
    if lay.sp:
        comm += s_c * b * h * B  # all-gathered sequence-parallel input
    if lay.pp > 1:
        comm += 2 * s_t * b * h * B  # receive buffers: activation forward, gradient backward
    if lay.cp > 1:
        comm += 2 * 2 * s_c * b * g_t * m.head_dim * (B + 4)  # ring: K/V and fp32 dK/dV, double-buffered
    reserve = parse_bytes(runtime_reserve)
    opt_per_param = optimizer_bytes_per_parameter(lay.distributed_optimizer, lay.dp, lay.cp)

    fused = prof.attention != "standard"
    stages = []
    layers_per_stage = m.num_layers // lay.pp
    for stage in range(lay.pp):
        first, last = stage == 0, stage == lay.pp - 1
        params = sum(stage_parameters(m, lay.tp, lay.pp, stage).values())
        n_chunks = lay.in_flight(stage)
        layers_in_flight = Fraction(layers_per_stage, lay.vp) * n_chunks
        # micro-batches in flight through this stage's first/last chunk (embedding / loss)
        n_micro = min(n_chunks, lay.num_microbatches or n_chunks)
        outside = act.non_layer_terms(
            m,
            seq_length,
            lay.micro_batch_size,
            first_stage=first,
            last_stage=last,
            **{**dims, "recompute": "full" if whole else lay.recompute},
        )
        first_terms = [t for t in outside if t.module.startswith("embedding")]
        last_terms = [t for t in outside if not t.module.startswith(("embedding", "decoder"))]
        block_terms = [t for t in outside if t.module.startswith("decoder") and t.module != "decoder.final_layernorm"]
        last_terms += [t for t in outside if t.module == "decoder.final_layernorm"]
        n_last = 1  # the output layer's chunk runs each micro-batch's backward right after its forward
        embeddings_loss = act.sum_terms(first_terms) * n_micro + act.sum_terms(last_terms) * n_last
        block = act.sum_terms(block_terms) * n_chunks
        logits = s_c * b * Fraction(m.vocab_size, lay.tp) * (B + 4) if last else Fraction(0)
        dynamic = layers_in_flight * (layer_acts + layer_stats) + embeddings_loss + block + logits + workspace + comm
        nbytes = {
            "weights": params * param_bytes,
            "gradients": params * grad_bytes,
            "optimizer_state": _ceil(params * opt_per_param),
            "activations": _ceil(layers_in_flight * layer_acts + block),
            "attention_statistics": _ceil(layers_in_flight * layer_stats),
            "embeddings_and_loss": _ceil(embeddings_loss),
            "logits_buffers": _ceil(logits),
            "recompute_workspace": _ceil(workspace),
            "communication_buffers": _ceil(comm),
            "runtime_reserve": reserve,
            "allocator_fragmentation": _ceil(fragmentation * dynamic),
        }
        stages.append(StagePlan(stage, params, layers_per_stage, n_chunks, nbytes))

    notes = []
    if lay.cp > 1 and seq_length // lay.cp < 8192:
        notes.append(
            f"{seq_length // lay.cp} tokens per CP rank: ring context parallelism hides its communication only "
            "above about 8K tokens per rank"
        )
    if lay.pp > 1 and lay.num_microbatches is not None and lay.num_microbatches < lay.pp:
        notes.append(f"{lay.num_microbatches} micro-batches per step cannot fill {lay.pp} pipeline stages")
    if prof.attention == "standard":
        notes.append("standard (unfused) attention: keeps the [b, heads, s, s] softmax per layer")
    return MemoryPlan(
        model=m,
        seq_length=seq_length,
        layout=lay,
        profile=prof.name,
        dtype_bytes=dtype_bytes,
        total_parameters=total_parameters(m),
        stages=stages,
        layer_terms=terms,
        device_memory=None if device_memory is None else parse_bytes(device_memory),
        recompute_overhead=sum(
            weight * recompute_overhead(m, seq_length, mode, fused, mean_document_length) for weight, mode in shares
        ),
        pipeline_bubble=pipeline_bubble(lay.pp, lay.num_microbatches, lay.vp),
        mean_document_length=mean_document_length,
        notes=notes,
    )

