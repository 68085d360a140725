"""Partial attention results and how they merge: fp32 accumulators, per-token statistics.

A kernel call over some of the keys returns ``(out_i, stats_i)``; partial results merge as
(row max, row sum) pairs, MindSpeed's rule (fp32 accumulators)::

    m = max(m_acc, m_i);  w_acc = s_acc exp(m_acc - m);  w_i = s_i exp(m_i - m)
    s = w_acc + w_i;      out = (out_acc w_acc + out_i w_i) / s

A logsumexp is the pair ``(lse, 1)``, and a merged pair of logsumexp statistics is kept as
``lse = m + log s``; the npu kernel's own ``softmax_max``/``softmax_sum`` stay (max, sum)
pairs, which is what its grad op takes. Statistics are
:class:`~mcore_flash.ops.backends.base.SoftmaxStats`: ``[b, h, s]`` (npu: ``[b, h, s, 8]``),
query rows in dim 2.
"""

from __future__ import annotations

import torch

from ..backends.base import SoftmaxStats
from .layout import Rows

Tensor = torch.Tensor


def per_token(weight: Tensor, layout: str) -> Tensor:
    """``[b, h, s]`` -> broadcastable against ``[b, s, h, d]`` (bshd) or ``[s, b, h, d]`` (sbhd)."""
    weight = weight.permute(0, 2, 1) if layout == "bshd" else weight.permute(2, 0, 1)
    return weight.unsqueeze(-1)


def merge_block(
    out_acc: Tensor, acc: SoftmaxStats, out: Tensor, new: SoftmaxStats, layout: str
) -> tuple[Tensor, SoftmaxStats]:
    """Fold one block's ``(out, stats)`` into the fp32 accumulator rows ``out_acc``; returns
    the merged rows and their statistics (see the module docstring)."""
    m_acc, m_new = acc.row_max, new.row_max
    s_acc = 1.0 if acc.row_sum is None else acc.row_sum
    s_new = 1.0 if new.row_sum is None else new.row_sum
    m = torch.maximum(m_acc, m_new)
    safe = torch.where(torch.isneginf(m), 0.0, m)  # rows nothing was visible to yet
    w_acc, w_new = s_acc * torch.exp(m_acc - safe), s_new * torch.exp(m_new - safe)
    total = w_acc + w_new

    def per_row(x):  # one value per row ([b, h, s], or its first copy of [b, h, s, 8])
        return per_token(x[..., 0] if x.dim() == 4 else x, layout)

    denominator = per_row(torch.where(total > 0, total, 1.0))
    merged = (out_acc * per_row(w_acc) + out.to(out_acc.dtype) * per_row(w_new)) / denominator
    if acc.row_sum is None:
        return merged, SoftmaxStats(torch.where(total > 0, m + torch.log(total), float("-inf")))
    return merged, SoftmaxStats(m, total)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial outputs and gradients of ``dtype`` tensors accumulate in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_accumulators(
    q: Tensor, v: Tensor, like: SoftmaxStats, seq: int
) -> tuple[Tensor, SoftmaxStats]:
    """fp32 zeros shaped like the output and statistics of rows that have seen no key yet
    (``-inf`` maxima, zero sums), shaped like ``like`` with every local row."""
    shape = list(q.shape)
    shape[-1] = v.shape[-1]
    out = torch.zeros(shape, dtype=accumulator_dtype(q.dtype), device=q.device)
    rows = q.shape[seq]
    shape = (*like.row_max.shape[:2], rows, *like.row_max.shape[3:])
    row_max = torch.full(shape, float("-inf"), dtype=like.row_max.dtype, device=q.device)
    row_sum = (
        None
        if like.row_sum is None
        else torch.zeros(row_max.shape, dtype=like.row_sum.dtype, device=q.device)
    )
    return out, SoftmaxStats(row_max, row_sum)


def set_stat_rows(stats: SoftmaxStats, rows: Rows, value: SoftmaxStats) -> None:
    """``stats[rows] = value`` (query rows, dim 2), in place."""
    for target, source in zip(stats.tensors(), value.tensors()):
        target[:, :, rows] = source
