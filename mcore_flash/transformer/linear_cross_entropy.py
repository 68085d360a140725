"""The output layer and megatron's vocab-parallel cross-entropy, one tile of tokens at a time.

``linear_cross_entropy(hidden, weight, labels, tile_tokens, tp_group, sequence_parallel)`` equals
``vocab_parallel_cross_entropy(ColumnParallelLinear(hidden), labels)`` (megatron-core's
``GPTModel`` output layer and loss) while at most one tile's ``[tile, b, V/TP]`` logits and their
fp32 working copy exist, in forward and in backward. Forward keeps only the local hidden states
(as megatron's output layer does), and per token the all-reduced maximum and sum of exponentials
(``[s, b]`` fp32 each); backward recomputes each tile's logits (one extra GEMM per tile) and
accumulates the output weight's gradient in fp32 (``[V/TP, h]``, returned in the weight's dtype).
The per-tile arithmetic is megatron's own (``VocabParallelCrossEntropy``'s helpers), with the
maximum, the target logit and the sum all-reduced over TP per tile as megatron does for the whole
sequence. Under sequence parallelism each tile gathers ``tile/TP`` rows of every rank (never the
whole sequence) and its hidden-state gradient is reduce-scattered back.

Why recompute rather than Liger's gradient-in-forward: the gradient megatron's loss sends back
is a per-token weight (loss mask, packed documents, the token count of the step) that forward
does not know; the weight's gradient needs it, so it can only be formed in backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    tile_tokens: int,
    tp_group: Optional[dist.ProcessGroup],
    sequence_parallel: bool,
) -> torch.Tensor:
    """Per-token loss ``[s, b]`` fp32 of ``labels`` (``[s, b]``, vocabulary ids) under the logits
    ``hidden @ weight.T``. ``hidden``: ``[s/TP, b, h]`` with ``sequence_parallel``, else
    ``[s, b, h]``; ``weight``: this rank's ``[V/TP, h]`` vocabulary rows; ``tile_tokens``: sequence
    positions per tile (a multiple of TP under sequence parallelism)."""
    return _LinearCrossEntropy.apply(
        hidden, weight, labels, tile_tokens, tp_group, sequence_parallel
    )


class _Tiles:
    """Which sequence positions tile ``k`` covers, for local hidden rows ``[s_local, b, h]``."""

    def __init__(self, local_rows: int, tile_tokens: int, tp_size: int, sequence_parallel: bool):
        self.local_rows = local_rows
        self.ranks = tp_size if sequence_parallel else 1
        self.rows = tile_tokens // self.ranks  # local rows per tile
        self.starts = range(0, local_rows, self.rows)

    def local(self, start: int) -> slice:
        return slice(start, min(start + self.rows, self.local_rows))

    def positions(self, start: int, device) -> torch.Tensor:
        """Sequence positions of the gathered tile, rank-major (the gather's order)."""
        rows = torch.arange(start, min(start + self.rows, self.local_rows), device=device)
        owners = torch.arange(self.ranks, device=device).unsqueeze(1) * self.local_rows
        return (owners + rows).reshape(-1)


def _gather(local: torch.Tensor, tiles: _Tiles, group) -> torch.Tensor:
    if tiles.ranks == 1:
        return local
    out = local.new_empty((local.shape[0] * tiles.ranks, *local.shape[1:]))
    dist.all_gather_into_tensor(out, local.contiguous(), group=group)
    return out


def _vocab_range(weight: torch.Tensor, group) -> tuple[int, int]:
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    rows = weight.shape[0]
    return rank * rows, (rank + 1) * rows


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, tile_tokens, tp_group, sequence_parallel):
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        tiles = _Tiles(hidden.shape[0], tile_tokens, tp_size, sequence_parallel)
        start_index, end_index = _vocab_range(weight, tp_group)
        s_full = hidden.shape[0] * tiles.ranks
        loss = torch.empty((s_full, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
        logits_max, sum_exp = torch.empty_like(loss), torch.empty_like(loss)
        for start in tiles.starts:
            where = tiles.positions(start, hidden.device)
            tile = _gather(hidden[tiles.local(start)], tiles, tp_group)
            logits, tile_max = VocabParallelCrossEntropy.calculate_logits_max(
                torch.nn.functional.linear(tile, weight)
            )
            _all_reduce(tile_max, dist.ReduceOp.MAX, tp_group)
            predicted, tile_sum = VocabParallelCrossEntropy.calculate_predicted_logits(
                logits, labels[where], tile_max, start_index, end_index
            )[2:4]  # (the exponentials, in the logits' storage, are not kept)
            del logits, tile
            _all_reduce(predicted, dist.ReduceOp.SUM, tp_group)
            _all_reduce(tile_sum, dist.ReduceOp.SUM, tp_group)
            loss[where] = torch.log(tile_sum) - predicted
            logits_max[where], sum_exp[where] = tile_max, tile_sum
        ctx.save_for_backward(hidden, weight, labels, logits_max, sum_exp)
        ctx.tiles, ctx.tp_group, ctx.vocab_range = tiles, tp_group, (start_index, end_index)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, logits_max, sum_exp = ctx.saved_tensors
        tiles, group = ctx.tiles, ctx.tp_group
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in tiles.starts:
            where = tiles.positions(start, hidden.device)
            tile = _gather(hidden[tiles.local(start)], tiles, group)
            softmax = torch.nn.functional.linear(tile, weight).float()
            softmax -= logits_max[where].unsqueeze(-1)
            torch.exp(softmax, out=softmax)
            softmax.div_(sum_exp[where].unsqueeze(-1))
            target = labels[where]
            target_mask = (target < ctx.vocab_range[0]) | (target >= ctx.vocab_range[1])
            masked_target_1d = (target - ctx.vocab_range[0]).masked_fill(target_mask, 0).view(-1)
            grad_2d, arange_1d, update, grad_logits = (
                VocabParallelCrossEntropy.prepare_gradient_calculation_operands(
                    softmax, target_mask
                )
            )
            grad_logits = VocabParallelCrossEntropy.calculate_gradients(
                grad_2d, arange_1d, masked_target_1d, update, grad_logits, grad_loss[where]
            ).to(hidden.dtype)
            del softmax, grad_2d
            grad_tile = grad_logits.matmul(weight)
            grad_weight += grad_logits.flatten(0, 1).t().matmul(tile.flatten(0, 1))
            del grad_logits, tile
            grad_hidden[tiles.local(start)] = _scatter_grad(grad_tile, tiles, group)
        if tiles.ranks == 1:  # TP without SP: the replicated input's gradient sums the vocab shards
            _all_reduce(grad_hidden, dist.ReduceOp.SUM, group)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def _scatter_grad(grad_tile: torch.Tensor, tiles: _Tiles, group) -> torch.Tensor:
    """This rank's rows of a gathered tile's gradient, summed over the vocabulary shards."""
    if tiles.ranks == 1:
        return grad_tile
    out = grad_tile.new_empty((grad_tile.shape[0] // tiles.ranks, *grad_tile.shape[1:]))
    dist.reduce_scatter_tensor(out, grad_tile.contiguous(), group=group)
    return out
