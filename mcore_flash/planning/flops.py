"""Compute-overhead estimates used to rank layouts: recompute FLOPs and the pipeline bubble.

Forward FLOPs per micro-batch (2 per multiply-add), causal attention:

    layer:   2*b*s*(h*(a+2g)*d + a*d*h + h*f*(3 if SwiGLU else 2))   projections and MLP
             + 2*b*s^2*a*d                                          QK^T and PV, half masked
    logits:  2*b*s*h*V

A training step costs 3x the forward (backward = 2x forward). Recompute adds a forward of
what it recomputes: ``full`` every layer, ``attention`` each layer's attention sub-block
(QKV projection, attention, output projection). The 1F1B bubble is ``(pp-1)/(v*m)`` of the
ideal step time (``v`` virtual stages per rank, ``m`` micro-batches per step). The
estimated step time relative to an ideal layout is ``(1 + recompute) * (1 + bubble)``.
"""

from __future__ import annotations

from typing import Optional

from .models import get_model

__all__ = ["forward_flops", "recompute_overhead", "pipeline_bubble", "relative_step_time"]


def forward_flops(model, seq_length: int, micro_batch_size: int = 1) -> dict[str, float]:
    """Forward FLOPs of one micro-batch: ``attention_block``, ``mlp_block`` (per layer), ``logits``."""
    m = get_model(model)
    s, b, h, a, g, d, f = (
        float(seq_length),
        float(micro_batch_size),
        m.hidden_size,
        m.num_attention_heads,
        m.num_query_groups,
        m.head_dim,
        m.ffn_hidden_size,
    )
    attention = 2 * b * s * (h * (a + 2 * g) * d + a * d * h) + 2 * b * s * s * a * d
    mlp = 2 * b * s * h * f * (3 if m.gated else 2)
    return {"attention_block": attention, "mlp_block": mlp, "logits": 2 * b * s * h * m.vocab_size}


def recompute_overhead(model, seq_length: int, recompute: str) -> float:
    """Extra FLOPs of recompute as a fraction of the step's FLOPs without recompute."""
    m = get_model(model)
    fl = forward_flops(m, seq_length)
    layer = fl["attention_block"] + fl["mlp_block"]
    step = 3 * (m.num_layers * layer + fl["logits"])
    extra = {"none": 0.0, "core_attention": 0.0, "attention": fl["attention_block"], "full": layer}[recompute]
    return m.num_layers * extra / step


def pipeline_bubble(pp: int, num_microbatches: Optional[int], vp: int = 1) -> float:
    """1F1B (interleaved) bubble as a fraction of the ideal step time."""
    if pp == 1:
        return 0.0
    m = num_microbatches if num_microbatches else pp
    return (pp - 1) / (vp * m)


def relative_step_time(model, seq_length: int, recompute: str, pp: int, num_microbatches, vp: int = 1) -> float:
    return (1 + recompute_overhead(model, seq_length, recompute)) * (1 + pipeline_bubble(pp, num_microbatches, vp))
