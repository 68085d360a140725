"""Standard (unfused) vs fused attention: saved bytes by sequence length for one shape.

The standard attention (Megatron's ``DotProductAttention``) keeps the ``[b, a/t, s, s]``
softmax output for backward (fp32 when the softmax runs in fp32, plus its cast to the
activation dtype, or the dropout mask and dropped-out probabilities with attention
dropout) and an ``[s, s]`` bool causal mask; the fused kernel keeps
q, k, v, out and ``b*(a/t)*s`` softmax statistics -- no ``s^2`` term. One ``[b, heads, s,
s]`` tensor in bf16 is ``b*heads*s^2*2`` bytes: 1 GiB at b=1, 32 heads, s=4096 (not 4 GB).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

from . import activation_bytes as act
from .models import ModelShape

__all__ = ["compare_standard", "DEFAULT_SEQ_LENGTHS"]

DEFAULT_SEQ_LENGTHS = tuple(1024 * 2**k for k in range(8))  # 1K .. 128K


def compare_standard(
    model: ModelShape,
    seq_lengths: Iterable[int] = DEFAULT_SEQ_LENGTHS,
    *,
    micro_batch_size: int = 1,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = True,
    profile: str = "npu",
    dtype_bytes: int = 2,
    attention_dropout: float = 0.0,
    num_layers: Optional[int] = None,
) -> list[dict]:
    """One row per sequence length: bytes of the standard and the fused attention.

    Columns: ``scores_bytes`` (one ``[b, a/t, s/c, s/c]`` tensor of the activation dtype),
    ``standard_core_attention_bytes`` / ``fused_core_attention_bytes`` (what the core
    attention keeps, per layer), ``standard_layer_bytes`` / ``fused_layer_bytes`` (whole
    layer), ``standard_all_layers_bytes`` / ``fused_all_layers_bytes`` (``num_layers``
    layers, one micro-batch), ``ratio``.
    """
    layers = model.num_layers if num_layers is None else num_layers
    fused = act.PROFILES[profile]
    standard = fused.with_(attention="standard", attention_dropout=attention_dropout)
    fused = fused.with_(attention_dropout=attention_dropout)
    rows = []
    for seq in seq_lengths:
        common = dict(tp=tp, cp=cp, sequence_parallel=sequence_parallel, dtype_bytes=dtype_bytes)
        std_terms = act.layer_terms(model, seq, micro_batch_size, profile=standard, **common)
        fus_terms = act.layer_terms(model, seq, micro_batch_size, profile=fused, **common)
        s_c = seq // cp

        def core(terms):
            return sum(
                t.bytes for t in terms if t.module.startswith("self_attention.core_attention")
            )

        std_layer, fus_layer = act.sum_terms(std_terms), act.sum_terms(fus_terms)
        rows.append(
            {
                "seq_length": seq,
                "scores_bytes": micro_batch_size
                * (model.num_attention_heads // tp)
                * s_c
                * s_c
                * dtype_bytes,
                "standard_core_attention_bytes": math.ceil(core(std_terms)),
                "fused_core_attention_bytes": math.ceil(core(fus_terms)),
                "standard_layer_bytes": math.ceil(std_layer),
                "fused_layer_bytes": math.ceil(fus_layer),
                "standard_all_layers_bytes": math.ceil(layers * std_layer),
                "fused_all_layers_bytes": math.ceil(layers * fus_layer),
                "ratio": float((layers * std_layer) / (layers * fus_layer)),
            }
        )
    return rows
