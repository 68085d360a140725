"""Parameter counts: the whole model, one layer, one (TP rank, PP stage) device.

The formulas are pure Python and count exactly what megatron-core's ``GPTModel`` builds with
the flash spec (tests/planning/test_planning.py builds it on the meta device to check:
``meta_parameter_count`` of tests/_support/models.py). Under
tensor parallelism column/row-parallel weights and column-parallel biases are split;
norm weights/biases and row-parallel biases are replicated on every TP rank.

Bytes per parameter (Megatron's mixed precision with bf16 params, fp32 main grads and
Adam): weights 2, gradients 4, optimizer 12 (fp32 master copy, exp_avg, exp_avg_sq); the
distributed optimizer shards the 12 over the data-parallel group including context
parallelism (``dp * cp`` ranks): ``6 + 12/d`` bytes per parameter instead of 18.

:func:`ddp_buffer` mirrors megatron's DDP buffer layout under the distributed optimizer
(``_ParamAndGradBuffer`` in 0.16.1, ``DistributedOptimizer._compute_per_buffer_param_layout``
in 0.19.2: the same rules), :meth:`DdpBuffer.shards` the distributed optimizer's shard of
each data-parallel rank (``_build_model_gbuf_range``) and :func:`optimizer_order` the order
its inner optimizer sees them (``_get_param_groups``, ``_build_optimizer_group_ranges``):
what the offloaded optimizer's bytes are computed from (:mod:`.ddp_state`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

from .models import ModelShape

__all__ = [
    "layer_parameters",
    "total_parameters",
    "stage_parameters",
    "ParameterShape",
    "stage_parameter_shapes",
    "optimizer_bytes_per_parameter",
    "BufferSlot",
    "DdpBuffer",
    "ddp_buffer",
    "stage_ddp_buffers",
    "optimizer_order",
]


def _div(n: int, t: int, what: str) -> int:
    if n % t:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {t}")
    return n // t


def layer_parameters(model: ModelShape, tp: int = 1) -> dict[str, int]:
    """Parameters of one transformer layer on one TP rank, by submodule."""
    h, d, a, g, f = (
        model.hidden_size,
        model.head_dim,
        model.num_attention_heads,
        model.num_query_groups,
        model.ffn_hidden_size,
    )
    norm = h * (2 if model.normalization == "LayerNorm" else 1)
    qkv_out = _div((a + 2 * g) * d, tp, "query/key/value projection width")
    fc1_out = _div((2 if model.gated else 1) * f, tp, "linear_fc1 width")
    bias = model.add_bias_linear
    qkv_bias = bias or model.add_qkv_bias  # megatron: bias=add_bias_linear or add_qkv_bias
    parts = {
        "input_layernorm": norm,
        "self_attention.linear_qkv": h * qkv_out + (qkv_out if qkv_bias else 0),
        "self_attention.linear_proj": _div(a * d, tp, "attention width") * h + (h if bias else 0),
        "pre_mlp_layernorm": norm,
        "mlp.linear_fc1": h * fc1_out + (fc1_out if bias else 0),
        "mlp.linear_fc2": _div(f, tp, "ffn_hidden_size") * h + (h if bias else 0),
    }
    if model.qk_layernorm:
        qk_norm = d * (2 if model.normalization == "LayerNorm" else 1)
        parts["self_attention.q_layernorm"] = qk_norm
        parts["self_attention.k_layernorm"] = qk_norm
    return parts


def _embedding_parameters(model: ModelShape, tp: int) -> int:
    count = _div(model.vocab_size, tp, "vocab_size") * model.hidden_size
    if model.position_embedding_type == "learned_absolute":
        count += model.max_position_embeddings * model.hidden_size
    return count


def stage_parameters(model: ModelShape, tp: int = 1, pp: int = 1, stage: int = 0) -> dict[str, int]:
    """Parameters held by one device of pipeline stage ``stage`` (0-based), by part.

    Keys: ``layers`` (all of the stage's layers), ``embedding`` (first stage),
    ``final_layernorm`` and ``output_layer`` (last stage; with tied embeddings and
    ``pp > 1`` the last stage holds a copy of the word embeddings, as Megatron does).
    """
    if model.num_layers % pp:
        raise ValueError(
            f"num_layers ({model.num_layers}) must be divisible by the pipeline-parallel size {pp}"
        )
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside 0..{pp - 1}")
    parts = {"layers": sum(layer_parameters(model, tp).values()) * (model.num_layers // pp)}
    if stage == 0:
        parts["embedding"] = _embedding_parameters(model, tp)
    if stage == pp - 1:
        parts["final_layernorm"] = model.hidden_size * (
            2 if model.normalization == "LayerNorm" else 1
        )
        if model.untie_embeddings_and_output_weights or pp > 1:
            parts["output_layer"] = _div(model.vocab_size, tp, "vocab_size") * model.hidden_size
    return parts


class ParameterShape(NamedTuple):
    """One parameter of a stage's ``GPTModel``: its ``name`` (as ``named_parameters`` gives it),
    ``shape`` (elements per dimension, this TP rank's), the name of the FSDP unit module it
    belongs to (``"embedding"``, ``"decoder.layers.<i>"``, or None: Megatron-FSDP's unit
    modules, as the trainer configures them, are the embedding and each transformer layer) and whether megatron marks it ``shared_embedding`` (a tied
    embedding split across pipeline stages)."""

    name: str
    shape: tuple[int, ...]
    unit: Optional[str]
    shared_embedding: bool = False


def _norm_shapes(prefix: str, width: int, model: ModelShape, unit: Optional[str]):
    names = ("weight", "bias") if model.normalization == "LayerNorm" else ("weight",)
    return [ParameterShape(f"{prefix}.{n}", (width,), unit) for n in names]


def _linear_shapes(prefix: str, out: int, inp: int, model: ModelShape, unit: str, bias=None):
    shapes = [ParameterShape(f"{prefix}.weight", (out, inp), unit)]
    if model.add_bias_linear if bias is None else bias:
        shapes.append(ParameterShape(f"{prefix}.bias", (out,), unit))
    return shapes


def _layer_shapes(model: ModelShape, tp: int, index: int) -> list[ParameterShape]:
    """One layer's parameters in the flash spec's registration order (its
    ``named_parameters`` order): input norm, proj, QKV, q/k norms, pre-MLP norm, fc1, fc2."""
    h, d, a, g, f = (
        model.hidden_size,
        model.head_dim,
        model.num_attention_heads,
        model.num_query_groups,
        model.ffn_hidden_size,
    )
    pre = f"decoder.layers.{index}"
    shapes = _norm_shapes(f"{pre}.input_layernorm", h, model, pre)
    shapes += _linear_shapes(
        f"{pre}.self_attention.linear_proj", h, _div(a * d, tp, "attention width"), model, pre
    )
    shapes += _linear_shapes(
        f"{pre}.self_attention.linear_qkv",
        _div((a + 2 * g) * d, tp, "query/key/value projection width"),
        h,
        model,
        pre,
        bias=model.add_bias_linear or model.add_qkv_bias,
    )
    if model.qk_layernorm:
        shapes += _norm_shapes(f"{pre}.self_attention.q_layernorm", d, model, pre)
        shapes += _norm_shapes(f"{pre}.self_attention.k_layernorm", d, model, pre)
    shapes += _norm_shapes(f"{pre}.pre_mlp_layernorm", h, model, pre)
    fc1 = _div((2 if model.gated else 1) * f, tp, "linear_fc1 width")
    shapes += _linear_shapes(f"{pre}.mlp.linear_fc1", fc1, h, model, pre)
    shapes += _linear_shapes(f"{pre}.mlp.linear_fc2", h, _div(f, tp, "ffn_hidden_size"), model, pre)
    return shapes


def stage_parameter_shapes(
    model: ModelShape, tp: int = 1, pp: int = 1, stage: int = 0
) -> list[ParameterShape]:
    """The parameters of one device of pipeline stage ``stage`` in ``named_parameters``
    order, with their TP-local shapes: what Megatron-FSDP groups and pads
    (:mod:`.fsdp`). Their element count is :func:`stage_parameters`'."""
    parts = stage_parameters(model, tp, pp, stage)  # validates pp and stage
    tied_split = not model.untie_embeddings_and_output_weights and pp > 1
    vocab_rows = _div(model.vocab_size, tp, "vocab_size")
    shapes = []
    if "embedding" in parts:
        shapes.append(
            ParameterShape(
                "embedding.word_embeddings.weight",
                (vocab_rows, model.hidden_size),
                "embedding",
                tied_split,
            )
        )
        if model.position_embedding_type == "learned_absolute":
            shapes.append(
                ParameterShape(
                    "embedding.position_embeddings.weight",
                    (model.max_position_embeddings, model.hidden_size),
                    "embedding",
                )
            )
    for index in range(model.num_layers // pp):
        shapes += _layer_shapes(model, tp, index)
    if "final_layernorm" in parts:
        shapes += _norm_shapes("decoder.final_layernorm", model.hidden_size, model, None)
    if "output_layer" in parts:
        shapes.append(
            ParameterShape("output_layer.weight", (vocab_rows, model.hidden_size), None, tied_split)
        )
    return shapes


def total_parameters(model: ModelShape) -> int:
    """Parameters of the whole (unsharded) model; tied embeddings count once."""
    return sum(stage_parameters(model, 1, 1, 0).values())


def optimizer_bytes_per_parameter(distributed: bool, dp: int, cp: int = 1) -> float:
    """Bytes of fp32 master weights + Adam states per parameter (12, or 12/(dp*cp) sharded)."""
    return 12.0 / (dp * cp) if distributed else 12.0


# megatron's DDP buffer under the distributed optimizer: each parameter starts at a multiple of
# 64 elements, each bucket ends at a multiple of lcm(dp x cp, 128) (pad_buckets_for_high_nccl_busbw
# off, as the trainer leaves it)
PARAM_START_ALIGNMENT = 64
BUCKET_END_ALIGNMENT = 128


def _pad(index: int, divisor: int) -> int:
    return -(-index // divisor) * divisor


class BufferSlot(NamedTuple):
    """One parameter in megatron's DDP buffer: its ``name``, ``start`` element, ``elements``,
    the ``bucket`` it is in, and whether it is in the optimizer's no-weight-decay group
    (megatron's default: 1-D parameters and ``*.bias``)."""

    name: str
    start: int
    elements: int
    bucket: int
    no_weight_decay: bool


@dataclass(frozen=True)
class DdpBuffer:
    """One model chunk's DDP parameter/gradient buffer: its ``slots`` in buffer order (the
    reverse of ``named_parameters``), its ``buckets`` as padded ``(start, end)`` elements and
    the ``ranks`` (data x context parallel) its buckets are split over."""

    slots: tuple[BufferSlot, ...]
    buckets: tuple[tuple[int, int], ...]
    ranks: int

    @property
    def elements(self) -> int:
        """The buffer's elements, padding included (what megatron allocates)."""
        return self.buckets[-1][1] if self.buckets else 0

    def shards(self) -> list[list[tuple[BufferSlot, int]]]:
        """Per rank, ``(slot, elements of it in the rank's shard)`` in buffer order: rank ``r``
        owns elements ``[start + r * size/D, start + (r+1) * size/D)`` of every bucket
        (megatron's ``_build_model_gbuf_range``); a parameter outside it is not the rank's."""
        out: list[list[tuple[BufferSlot, int]]] = [[] for _ in range(self.ranks)]
        for slot in self.slots:
            low, high = self.buckets[slot.bucket]
            per = (high - low) // self.ranks
            begin, end = slot.start - low, slot.start - low + slot.elements
            for rank in range(begin // per, (end - 1) // per + 1):
                held = min(end, (rank + 1) * per) - max(begin, rank * per)
                if held > 0:
                    out[rank].append((slot, held))
        return out


def ddp_buffer(
    params: Sequence[ParameterShape],
    ranks: int,
    distributed_optimizer: bool = True,
    bucket_size: Optional[int] = None,
) -> DdpBuffer:
    """megatron's DDP buffer of one model chunk's ``params`` (``named_parameters`` order), as
    ``_ParamAndGradBuffer.__init__`` lays it out (megatron-core 0.16.1
    ``param_and_grad_buffer.py:671-739``; 0.19.2 ``distrib_optimizer.py:569``, the distributed
    optimizer's ``_compute_per_buffer_param_layout``): parameters in reverse order, a bucket
    closed once it holds ``bucket_size`` elements or more (None: one bucket, as without
    ``--overlap-grad-reduce``), a ``shared_embedding`` parameter in a bucket of its own under
    the distributed optimizer. With the distributed optimizer
    (megatron's ``_pad_start_of_param_if_needed`` / ``_pad_end_of_bucket_if_needed``, 0.19's
    ``pad_param_start`` / ``pad_bucket_end``): each parameter starts at a multiple of 64
    elements and each bucket ends at a multiple of ``lcm(ranks, 128)``; without it nothing is
    padded."""
    pad_start = PARAM_START_ALIGNMENT if distributed_optimizer else 1
    pad_end = math.lcm(ranks, BUCKET_END_ALIGNMENT) if distributed_optimizer else 1
    slots: list[BufferSlot] = []
    buckets: list[tuple[int, int]] = []
    bucket_start = index = 0
    members = 0
    for param in reversed(params):  # "roughly backprop order"
        index = _pad(index, pad_start)
        if param.shared_embedding and distributed_optimizer and members:
            buckets.append((bucket_start, _pad(index, pad_end)))
            bucket_start = index = buckets[-1][1]
            members = 0
        elements = math.prod(param.shape)
        no_decay = len(param.shape) == 1 or param.name.endswith(".bias")
        slots.append(BufferSlot(param.name, index, elements, len(buckets), no_decay))
        members += 1
        index += elements
        full = bucket_size is not None and index - bucket_start >= bucket_size
        if full or (param.shared_embedding and distributed_optimizer):
            buckets.append((bucket_start, _pad(index, pad_end)))
            bucket_start = index = buckets[-1][1]
            members = 0
    if members:
        buckets.append((bucket_start, _pad(index, pad_end)))
    return DdpBuffer(tuple(slots), tuple(buckets), ranks)


@functools.lru_cache(maxsize=512)
def stage_ddp_buffers(
    model: ModelShape,
    tp: int,
    pp: int,
    vp: int,
    stage: int,
    ranks: int,
    bucket_size: Optional[int] = None,
) -> tuple[DdpBuffer, ...]:
    """The DDP buffers of pipeline stage ``stage``'s device, one per model chunk: with ``vp``
    interleaved chunks, chunk ``v`` is virtual stage ``v * pp + stage`` of ``pp * vp``
    (cached: the search asks for the same stage many times). Only the first stage's first
    chunk is bucketed by ``bucket_size`` (megatron's ``DistributedDataParallel``: no bucketing
    where ``pp_rank > 0`` or ``disable_bucketing``, which the trainer sets for later chunks)."""
    return tuple(
        ddp_buffer(
            stage_parameter_shapes(model, tp, pp * vp, chunk * pp + stage),
            ranks,
            bucket_size=bucket_size if stage == 0 and chunk == 0 else None,
        )
        for chunk in range(vp)
    )


def optimizer_order(
    chunk_shards: Sequence[list[tuple[BufferSlot, int]]],
) -> list[tuple[BufferSlot, int]]:
    """One rank's shard parameters in the order megatron's inner optimizer holds them: its
    parameter groups sorted with the default (weight-decay) group first, then the
    no-weight-decay group (``_get_param_groups``: ``sorted(..., key=(override is not None,
    ...))``), each in buffer order over the model chunks (``_build_optimizer_group_ranges``
    walks the buffers' buckets). ``chunk_shards``: per model chunk, the rank's
    :meth:`DdpBuffer.shards` entry."""
    held = [entry for shard in chunk_shards for entry in shard]
    return [e for e in held if not e[0].no_weight_decay] + [e for e in held if e[0].no_weight_decay]
