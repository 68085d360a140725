"""Compute-overhead estimates used to rank layouts: recompute FLOPs and the pipeline bubble.

Forward FLOPs per micro-batch (2 per multiply-add), causal attention:

    projections + MLP (per layer):  2*b*s*(h*(a+2g)*d + a*d*h + h*f*(3 if SwiGLU else 2))
    attention kernel  (per layer):  2*b*s^2*a*d        QK^T and PV, half of them masked
    logits:                         2*b*s*h*V

Backward costs twice the forward for a GEMM (input and weight gradients). For a fused
(flash) attention kernel it costs 2.5x: its backward recomputes QK^T from the saved
logsumexp and then runs four more matmuls (dV, dP, dQ, dK) against the forward's two; an
unfused kernel keeps the probabilities and needs only the four (2x). Recompute adds one
forward of what it recomputes: ``full`` the whole layer, ``attention`` each layer's
attention sub-block (QKV projection, attention kernel, output projection), ``core_attention``
(Megatron's stock selective recompute) the attention kernel alone. The 1F1B bubble is
``(pp-1)/(v*m)`` of the ideal step time (``v`` virtual stages per rank, ``m`` micro-batches
per step).
"""

from __future__ import annotations

from typing import Optional

from .models import get_model

__all__ = ["forward_flops", "step_flops", "recompute_overhead", "pipeline_bubble"]

FUSED_ATTENTION_BACKWARD = 2.5  # backward / forward FLOPs of a flash-attention kernel
GEMM_BACKWARD = 2.0  # backward / forward FLOPs of a matmul (and of unfused attention)


def forward_flops(model, seq_length: int, micro_batch_size: int = 1) -> dict[str, float]:
    """Forward FLOPs of one micro-batch: per layer ``attention_projections`` (QKV and output
    projection), ``attention_kernel`` (QK^T, PV) and ``mlp``; once ``logits``."""
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
    return {
        "attention_projections": 2 * b * s * (h * (a + 2 * g) * d + a * d * h),
        "attention_kernel": 2 * b * s * s * a * d,
        "mlp": 2 * b * s * h * f * (3 if m.gated else 2),
        "logits": 2 * b * s * h * m.vocab_size,
    }


def step_flops(model, seq_length: int, fused_attention: bool = True) -> float:
    """Forward + backward FLOPs of one sequence without recompute."""
    m = get_model(model)
    fl = forward_flops(m, seq_length)
    kernel_backward = FUSED_ATTENTION_BACKWARD if fused_attention else GEMM_BACKWARD
    gemms = m.num_layers * (fl["attention_projections"] + fl["mlp"]) + fl["logits"]
    return (1 + GEMM_BACKWARD) * gemms + (1 + kernel_backward) * m.num_layers * fl["attention_kernel"]


def recompute_overhead(model, seq_length: int, recompute: str, fused_attention: bool = True) -> float:
    """Extra FLOPs of ``recompute`` (none, attention, full, core_attention) as a fraction of
    the step's FLOPs without recompute."""
    m = get_model(model)
    fl = forward_flops(m, seq_length)
    kernel, projections = fl["attention_kernel"], fl["attention_projections"]
    per_layer = {
        "none": 0.0,
        "core_attention": kernel,
        "attention": projections + kernel,
        "full": projections + kernel + fl["mlp"],
    }
    if recompute not in per_layer:
        raise ValueError(f"recompute {recompute!r}: choose one of {tuple(per_layer)}")
    return m.num_layers * per_layer[recompute] / step_flops(m, seq_length, fused_attention)


def pipeline_bubble(pp: int, num_microbatches: Optional[int], vp: int = 1) -> float:
    """1F1B (interleaved) bubble as a fraction of the ideal step time."""
    if pp == 1:
        return 0.0
    m = num_microbatches if num_microbatches else pp
    return (pp - 1) / (vp * m)
