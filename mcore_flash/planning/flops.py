"""FLOPs of a layout's compute, used to rank layouts: per-layer forward FLOPs, a step's, the
recompute overhead and the pipeline bubble.

Units: 2 FLOPs per multiply-add; causal attention counts the unmasked half of QK^T and PV.
:func:`forward_flops` gives one micro-batch's forward FLOPs per layer (projections,
attention kernel, MLP) and once the logits; :func:`step_flops` one sequence's forward and
backward without recompute (a GEMM's backward :data:`GEMM_BACKWARD` x its forward, a fused
attention kernel's :data:`FUSED_ATTENTION_BACKWARD` x); :func:`recompute_overhead` the
extra FLOPs of a recompute mode as a fraction of :func:`step_flops`, :func:`tiling_overhead`
those of the sequence tiles' recomputed forward passes; :func:`pipeline_bubble`
the 1F1B bubble as a fraction of the ideal step time. A ``mean_document_length`` ``D``
(tokens: packed documents with document masking, in ``[1, s]``,
:func:`check_mean_document_length`; None: one document per sequence, ``D = s``) changes
only the attention kernel's FLOPs, by ``D/s``. The formulas: each function's docstring;
packed documents: docs/planner.md; how the step time uses them: docs/step-time.md.
"""

from __future__ import annotations

from typing import Optional

from .models import ModelShape

__all__ = [
    "attention_block_length",
    "check_mean_document_length",
    "forward_flops",
    "step_flops",
    "recompute_overhead",
    "tiling_overhead",
    "pipeline_bubble",
]

FUSED_ATTENTION_BACKWARD = 2.5  # backward / forward FLOPs of a flash-attention kernel
GEMM_BACKWARD = 2.0  # backward / forward FLOPs of a matmul (and of unfused attention)


def check_mean_document_length(seq_length: int, mean_document_length: Optional[float]) -> None:
    """Raise ValueError unless ``mean_document_length`` (tokens) is None or lies in
    ``[1, seq_length]`` (``seq_length`` in tokens); the message names the CLI flag and the fix."""
    if mean_document_length is None:
        return
    if mean_document_length < 1:
        raise ValueError(
            f"--mean-document-length {mean_document_length}: a document has at least 1 token; give the mean "
            "number of tokens per packed document (e.g. 8192 or 8K), or omit the flag (one document per sequence)"
        )
    if mean_document_length > seq_length:
        raise ValueError(
            f"--mean-document-length {mean_document_length} is longer than --seq-length {seq_length}: packing cuts "
            f"documents at sequence boundaries, so no sequence holds a longer one; give at most {seq_length} "
            "(the same as omitting the flag: one document per sequence)"
        )


def attention_block_length(seq_length: int, mean_document_length: Optional[float] = None) -> float:
    """Tokens each causal attention block spans: ``mean_document_length`` (tokens, packed
    documents with document masking) or, when None, the whole ``seq_length`` (tokens)."""
    check_mean_document_length(seq_length, mean_document_length)
    return float(seq_length if mean_document_length is None else mean_document_length)


def forward_flops(
    model: ModelShape,
    seq_length: int,
    micro_batch_size: int = 1,
    mean_document_length: Optional[float] = None,
) -> dict[str, float]:
    """Forward FLOPs of one micro-batch of ``micro_batch_size`` sequences of ``seq_length``
    tokens: per layer ``attention_projections`` (QKV and output projection),
    ``attention_kernel`` (QK^T, PV; over documents of ``mean_document_length`` tokens when
    given) and ``mlp``; once ``logits``. With ``b`` sequences of ``s`` tokens, ``D`` the
    mean document length (``s`` without one):

        attention_projections:  2*b*s*(h*(a+2g)*d + a*d*h)
        attention_kernel:       2*b*s*D*a*d        QK^T and PV, half of them masked
        mlp:                    2*b*s*h*f*(3 if SwiGLU else 2)
        logits:                 2*b*s*h*V

    A sample of ``s`` tokens packs ``s/D`` documents of ``D`` tokens each and attention runs
    per document (document masking), so the kernel's ``s^2`` becomes ``(s/D)*D^2 = s*D``,
    i.e. ``D/s`` of the dense causal FLOPs. Equal-length documents are a lower bound: any
    length distribution with the same mean has a larger ``sum(len^2)``. The other terms are
    linear in ``s`` and do not depend on ``D``."""
    block = attention_block_length(seq_length, mean_document_length)
    s, b, h, a, g, d, f = (
        float(seq_length),
        float(micro_batch_size),
        model.hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        model.head_dim,
        model.ffn_hidden_size,
    )
    return {
        "attention_projections": 2 * b * s * (h * (a + 2 * g) * d + a * d * h),
        "attention_kernel": 2 * b * s * block * a * d,
        "mlp": 2 * b * s * h * f * (3 if model.gated else 2),
        "logits": 2 * b * s * h * model.vocab_size,
    }


def step_flops(
    model: ModelShape,
    seq_length: int,
    fused_attention: bool = True,
    mean_document_length: Optional[float] = None,
) -> float:
    """Forward + backward FLOPs of one sequence of ``seq_length`` tokens without recompute
    (documents of ``mean_document_length`` tokens when given).

    Backward costs twice the forward for a GEMM (input and weight gradients). For a fused
    (flash) attention kernel it costs 2.5x: its backward recomputes QK^T from the saved
    logsumexp and then runs four more matmuls (dV, dP, dQ, dK) against the forward's two; an
    unfused kernel (``fused_attention=False``) keeps the probabilities and needs only the
    four (2x)."""
    fl = forward_flops(model, seq_length, mean_document_length=mean_document_length)
    kernel_backward = FUSED_ATTENTION_BACKWARD if fused_attention else GEMM_BACKWARD
    gemms = model.num_layers * (fl["attention_projections"] + fl["mlp"]) + fl["logits"]
    return (1 + GEMM_BACKWARD) * gemms + (1 + kernel_backward) * model.num_layers * fl[
        "attention_kernel"
    ]


def recompute_overhead(
    model: ModelShape,
    seq_length: int,
    recompute: str,
    fused_attention: bool = True,
    mean_document_length: Optional[float] = None,
) -> float:
    """Extra FLOPs of ``recompute`` (none, qkv, attention, full, core_attention) as a fraction of
    the step's FLOPs without recompute, for sequences of ``seq_length`` tokens (packing
    documents of ``mean_document_length`` tokens when given).

    Recompute adds one forward of what it recomputes: ``full`` the whole layer, ``attention``
    each layer's attention sub-block (QKV projection, attention kernel, output projection),
    ``core_attention`` (Megatron's stock selective recompute) the attention kernel alone,
    ``qkv`` the QKV projection alone (``2*b*s*h*(a+2g)*d``; its input norm and RoPE are
    elementwise and, like every elementwise op here, not counted)."""
    fl = forward_flops(model, seq_length, mean_document_length=mean_document_length)
    kernel, projections = fl["attention_kernel"], fl["attention_projections"]
    qkv_columns, output_columns = (
        model.num_attention_heads + 2 * model.num_query_groups,
        model.num_attention_heads,
    )
    per_layer = {
        "none": 0.0,
        "qkv": projections * qkv_columns / (qkv_columns + output_columns),
        "core_attention": kernel,
        "attention": projections + kernel,
        "full": projections + kernel + fl["mlp"],
    }
    if recompute not in per_layer:
        raise ValueError(f"recompute {recompute!r}: choose one of {tuple(per_layer)}")
    return (
        model.num_layers
        * per_layer[recompute]
        / step_flops(model, seq_length, fused_attention, mean_document_length)
    )


def tiling_overhead(
    model: ModelShape,
    seq_length: int,
    loss_tiled: bool,
    mlp_tiled: bool,
    fused_attention: bool = True,
    mean_document_length: Optional[float] = None,
) -> float:
    """Extra FLOPs of sequence tiling as a fraction of :func:`step_flops` (sequences of
    ``seq_length`` tokens), on top of any layer recompute: the tiled loss (``loss_tiled``)
    recomputes each tile's logits in its backward, one more output-layer forward
    (``2*b*s*h*V``); the tiled MLP (``mlp_tiled``) each tile's fc1 and fc2, one more MLP
    forward per layer (``L * 2*b*s*h*f*(3 if SwiGLU else 2)``)."""
    fl = forward_flops(model, seq_length, mean_document_length=mean_document_length)
    extra = (fl["logits"] if loss_tiled else 0.0) + (
        model.num_layers * fl["mlp"] if mlp_tiled else 0.0
    )
    return extra / step_flops(model, seq_length, fused_attention, mean_document_length)


def pipeline_bubble(pp: int, num_microbatches: Optional[int], vp: int = 1) -> float:
    """1F1B (interleaved) bubble as a fraction of the ideal step time: ``(pp-1)/(v*m)``
    (``v`` virtual stages per rank, ``m`` micro-batches per step; ``pp`` when None)."""
    if pp == 1:
        return 0.0
    m = num_microbatches if num_microbatches else pp
    return (pp - 1) / (vp * m)
