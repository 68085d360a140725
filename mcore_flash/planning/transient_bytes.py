"""Transient bytes at two peaks: the loss's (output layer + cross-entropy) and an MLP backward's.

:func:`loss_peak_terms` is what the last stage's loss holds at its peak beyond the tensors it
keeps for backward (:func:`.activation_bytes.non_layer_terms`' loss terms): megatron's
whole-sequence loss (``vocab_parallel_cross_entropy`` of the output layer's logits) or the
tiled loss (``mcore_flash.transformer.linear_cross_entropy``); the plan's ``logits_buffers``.
:func:`mlp_backward_terms` is what one MLP's backward holds at its peak beyond the MLP's kept
tensors and the layer's incoming gradient, untiled (megatron's ``MLP``) or tiled
(``mcore_flash.transformer.tiled_mlp``); the gradient part of the plan's
``recompute_workspace``. Each returns the :class:`~.activation_bytes.Term` s alive at the
moment that is the largest (the moments are enumerated in each function's contract, allocation
by allocation of the code they model), so that the kept terms plus these are the peak.

Both are exact on the emulated NPU's byte counter (tests/emulation/test_tiling_memory.py: TP1,
TP2 with and without sequence parallelism, micro-batch 1 and 2, with each moment the largest
somewhere), for bf16 without biases on the MLP's linears, the trainer's fused SwiGLU, and
megatron's weight gradients as transient bf16 tensors (no gradient-accumulation fusion: the
trainer has none; DDP adds each to its main gradient and drops it). Not counted: 0-dim
tensors (the loss function's sum and its gradient, 4 B each) and the bias gradients (a row of
the weight's). Symbols: ``S = s_c * b`` tokens of the loss, ``v = V / tp`` vocabulary rows of a
TP rank, ``h`` hidden, ``F = f / tp`` and ``W`` (``2F`` gated, else ``F``) the MLP's widths of a
rank, ``B`` the activation dtype's bytes; ``s_t`` the rows of a rank (``s_c / tp`` under
sequence parallelism, else ``s_c``).
"""

from __future__ import annotations

from fractions import Fraction
from functools import partial
from typing import Optional

from . import activation_bytes as act
from .activation_bytes import Term
from .models import ModelShape

__all__ = ["loss_peak_terms", "mlp_backward_terms", "loss_tiles", "NPU_ARANGE"]

F = Fraction
# a transient term: never summed into the kept categories
_T = partial(Term, category="transient", scope="model")
FP32 = 4
INT64 = 8
# bytes per tile token of the index and per-token vectors alive through a loss tile's backward:
# its labels (int64), masked targets (int64), megatron's arange over the tile (int64), the
# target mask (bool) and the softmax update (fp32)
_TILE_VECTORS = INT64 + INT64 + INT64 + 1 + FP32
# of those, megatron's ``torch.arange`` over the tile: the emulated NPU's counter misses it
# (the CPU kernel resizes its output inside the op), a device allocates it
NPU_ARANGE = INT64


def _sizes(model, seq_length, micro_batch_size, tp, cp, sequence_parallel, dtype_bytes):
    """``(s_c, s_t, b, B, sp)``: the CP rank's tokens, the rows a TP rank holds, the batch, the
    dtype's bytes, whether sequence parallelism applies (it needs tp > 1)."""
    sp = sequence_parallel and tp > 1
    s_c = F(seq_length, cp)
    return s_c, s_c / tp if sp else s_c, F(micro_batch_size), F(dtype_bytes), sp


def loss_tiles(seq_length: int, cp: int, loss_chunk_size: int) -> int:
    """Tiles of the tiled loss over the CP rank's ``seq_length / cp`` positions."""
    return -(-(seq_length // cp) // loss_chunk_size)


def loss_peak_terms(
    model: ModelShape,
    seq_length: int,
    micro_batch_size: int = 1,
    *,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = True,
    dtype_bytes: int = 2,
    loss_chunk_size: Optional[int] = None,
) -> list[Term]:
    """The loss's bytes at its peak beyond its kept tensors, one micro-batch, the last stage.

    Megatron's loss (``loss_chunk_size`` None), the largest of two moments. The forward's
    last allocation (the per-token loss): the bf16 logits ``S·v·B`` beside the kept fp32
    softmax, and per token fp32 the maximum, the target logit, the sum of exponentials, its
    log and the loss (``20·S``), at ``b > 1`` GPTModel's transposed int64 copy of the labels
    (``8·S``; at ``b = 1`` a view). The output layer's backward (its weight's gradient): the
    bf16 gradient of the logits ``S·v·B``, the hidden states' gradient ``s_c·b·h·B`` (under
    sequence parallelism also its reduce-scattered rows ``s_t·b·h·B``) and the weight's bf16
    gradient ``v·h·B``, the kept tensors freed by then (``-(4·S·v + 9·S)``). (The backward's
    cast of the fp32 gradient to bf16, ``S·v·B`` beside the kept tensors, never exceeds the
    forward's.)

    The tiled loss (tiles of ``N`` positions, ``n = N·b`` tokens): its peak is in the backward,
    tile ``k >= 1``: the per-token loss's fp32 gradient ``4·S``, the hidden states' gradient
    ``s_t·b·h·B`` and the output weight's fp32 gradient ``4·v·h`` (both alive through the
    backward), under sequence parallelism the gathered tile ``n·h·B``, the tile's vectors
    ``8·N + 29·n`` (its positions, and :data:`_TILE_VECTORS` per token), the previous tile's
    hidden-state gradient ``n·h·B`` (not yet replaced; none with one tile), and the largest
    of: the tile's logits in bf16 and fp32 ``n·v·(B + 4)`` (as the fp32 copy is made, and as
    the fp32 gradient is cast to bf16); the bf16 gradient ``n·v·B`` with the tile's new
    hidden-state gradient ``n·h·B`` (its GEMM); the bf16 gradient with the weight-gradient
    product ``v·h·B`` (before it is added to the fp32 accumulator). Exact with full tiles
    (``s_c`` a multiple of ``N``) or one tile; with a shorter last tile an upper bound.
    """
    s_c, s_t, b, B, sp = _sizes(
        model, seq_length, micro_batch_size, tp, cp, sequence_parallel, dtype_bytes
    )
    h, v = F(model.hidden_size), F(model.vocab_size, tp)
    S = s_c * b
    if loss_chunk_size is None:
        forward = [
            _T("output_layer", "logits (bf16)", S * v * B),
            _T("", "per-token fp32 max, target logit, sum, log-sum, loss", 5 * FP32 * S),
        ]
        if micro_batch_size > 1:
            forward.append(_T("", "labels [s, b] (int64, GPTModel's transposed copy)", INT64 * S))
        backward = [
            _T("output_layer", "gradient of the logits (bf16)", S * v * B),
            _T("output_layer", "gradient of its input [s_c, b, h]", S * h * B),
            _T(
                "output_layer",
                "the input gradient's reduce-scattered rows",
                s_t * b * h * B if sp else 0,
            ),
            _T("output_layer", "weight gradient (bf16)", v * h * B),
            _T("", "the kept softmax, target mask and targets, freed", -(FP32 * v + 9) * S),
        ]
        return _largest(forward, backward)
    N = min(F(loss_chunk_size), s_c)
    n = N * b
    tiles = loss_tiles(seq_length, cp, loss_chunk_size)
    common = [
        _T("", "gradient of the per-token loss (fp32)", FP32 * S),
        _T("", "gradient of the hidden states [s_t, b, h]", s_t * b * h * B),
        _T("", "output weight's gradient, accumulated in fp32", FP32 * v * h),
        _T("", "the tile's hidden states, gathered over TP", n * h * B if sp else 0),
        _T("", "the tile's positions and per-token vectors", INT64 * N + _TILE_VECTORS * n),
        _T("", "the previous tile's hidden-state gradient", n * h * B if tiles > 1 else 0),
    ]
    return common + _largest(
        [_T("", "the tile's logits, bf16 and fp32", n * v * (B + FP32))],
        [
            _T("", "the tile's logit gradient (bf16)", n * v * B),
            _T("", "the tile's hidden-state gradient", n * h * B),
        ],
        [
            _T("", "the tile's logit gradient (bf16)", n * v * B),
            _T("", "the weight-gradient product (bf16)", v * h * B),
        ],
    )


def _largest(*moments: list[Term]) -> list[Term]:
    """The moment whose terms add up to the most (the first of equals), its zero terms left out."""
    best = max(moments, key=act.sum_terms)
    return [t for t in best if t.bytes]


def _mlp_moments(R, r, b, h, F_, W, B, sp, intermediates) -> list[list[Term]]:
    """One MLP backward's moments over ``R`` tokens of the fc1 GEMM (``r`` rows of this rank's
    input), beyond its kept tensors: fc2's weight gradient, the activation's input gradient,
    fc1's weight gradient (``intermediates``: the fc1 output and fc2 input it keeps)."""
    return [
        [  # fc2's backward, at its weight gradient
            _T(
                "mlp.linear_fc2",
                "output gradient gathered over TP [R, b, h]",
                R * b * h * B if sp else 0,
            ),
            _T("mlp.linear_fc2", "input gradient", R * b * F_ * B),
            _T("mlp.linear_fc2", "weight gradient (bf16)", h * F_ * B),
        ],
        [  # the activation's backward (fc2's input freed with fc2's node)
            _T(
                "mlp.linear_fc1", "output gradient (the activation's input gradient)", R * b * W * B
            ),
        ],
        [  # fc1's backward, at its weight gradient (the activation's tensors freed)
            _T("mlp.linear_fc1", "output gradient", R * b * W * B),
            _T("mlp.linear_fc1", "input gradient [R, b, h]", R * b * h * B),
            _T("mlp.linear_fc1", "input gradient reduce-scattered", r * b * h * B if sp else 0),
            _T("mlp.linear_fc1", "weight gradient (bf16)", W * h * B),
            _T("mlp", "the kept intermediates, freed", -intermediates),
        ],
    ]


def mlp_backward_terms(
    model: ModelShape,
    seq_length: int,
    micro_batch_size: int = 1,
    *,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = True,
    profile="npu",
    dtype_bytes: int = 2,
    mlp_chunk_size: Optional[int] = None,
) -> list[Term]:
    """One MLP's bytes at its backward's peak beyond the MLP's kept tensors (its terms of
    :func:`.activation_bytes.layer_terms`) and the layer's incoming gradient, one micro-batch.

    Untiled (``R = s_c`` tokens), the largest of three moments: fc2's backward at its weight
    gradient (under sequence parallelism the gathered output gradient ``R·b·h·B``, fc2's input
    gradient ``R·b·F·B``, its bf16 weight gradient ``h·F·B``); the activation's backward (fc1's
    output gradient ``R·b·W·B`` beside fc2's input gradient, fc2's input ``R·b·F·B`` freed:
    ``R·b·W·B`` in all); fc1's backward at its weight gradient (fc1's output gradient, its input
    gradient ``R·b·h·B``, under sequence parallelism its reduce-scattered rows ``s_t·b·h·B``, the
    bf16 weight gradient ``W·h·B``, the kept intermediates freed). The activation is the NPU
    op's contract: its backward allocates its input's gradient only (the emulated
    ``npu_swiglu`` computes in fp32 scratch besides, which the test keeps on the host).

    Tiled (:func:`.activation_bytes.mlp_tile_tokens` ``N``, ``n_r`` rows a tile takes of this
    rank): the tiles' backwards run last tile first, each recomputing its intermediates
    (:func:`.activation_bytes.mlp_tile_terms`) and output ``n_r·b·h·B`` and keeping its input
    gradient ``n_r·b·h·B`` until the split's backward concatenates them (``s_t·b·h·B`` more).
    The peak: the input gradients of the other tiles and the first tile's recomputed output,
    ``s_t·b·h·B``, plus the larger of the first tile's recomputed intermediates and its
    largest moment above (``N`` tokens) and the concatenated gradient ``s_t·b·h·B``. Exact for
    the first tile a full one (it is: only the last may be short).
    """
    p = act._profile(profile)
    dims = act._dims(model, p, seq_length, micro_batch_size, tp, cp, sequence_parallel, dtype_bytes)
    s_c, s_t, b, B = dims[:4]
    sp = sequence_parallel and tp > 1
    h, F_ = F(model.hidden_size), F(model.ffn_hidden_size, tp)
    W = 2 * F_ if model.gated else F_
    tile = act.mlp_tile_tokens(seq_length, cp, mlp_chunk_size)
    if tile is None:
        intermediates = act.sum_terms(act._mlp_intermediate_terms(model, p, dims, tp, s_c))
        return _largest(*_mlp_moments(s_c, s_t, b, h, F_, W, B, sp, intermediates))
    rows = tile / tp if sp else tile
    intermediates = act._mlp_intermediate_terms(model, p, dims, tp, tile)
    first = [
        _T("mlp", f"{t.module}: {t.name}, one tile recomputed", t.bytes) for t in intermediates
    ] + _largest(*_mlp_moments(tile, rows, b, h, F_, W, B, sp, act.sum_terms(intermediates)))
    held = _T(
        "mlp", "the other tiles' input gradients, the tile's recomputed output", s_t * b * h * B
    )
    concatenated = [_T("mlp", "the input gradient, concatenated", s_t * b * h * B)]
    return [held] + _largest(first, concatenated)
