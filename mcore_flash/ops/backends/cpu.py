"""CPU backend: torch's fused flash kernel for the CPU, the reference kernel where it can't.

``aten._scaled_dot_product_flash_attention_for_cpu`` takes ``[b, h, s, d]``, supports GQA
natively and returns the logsumexp; its backward op takes it back. Its limits decide the
fallback to :class:`ReferenceBackend` (decided from the arguments alone, so forward and
backward always agree, and logged once per reason -- never silently ignored):

* dropout > 0 (the kernel refuses it),
* causal with ``sq != sk`` (the kernel aligns causal top-left, we promise bottom-right),
* an empty query or key sequence (the kernel crashes the process with SIGFPE).

A bool ``attn_mask`` is turned into the additive float mask the kernel takes; rows it
masks entirely get ``lse = -inf`` (the kernel reports 0 for them).
"""

from __future__ import annotations

from typing import Optional

import torch

from .base import AttentionBackend, AttentionParams, SoftmaxStats, Tensor
from .reference import ReferenceBackend

_fused_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_fused_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class CpuBackend(AttentionBackend):
    """torch's fused CPU flash-attention kernel."""

    name = "cpu"

    def __init__(self, fallback: Optional[AttentionBackend] = None):
        self.fallback = fallback or ReferenceBackend()

    def forward(self, q, k, v, params):
        if self._needs_fallback(q, k, params):
            return self.fallback.forward(q, k, v, params)
        out, lse = _fused_forward(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            0.0,
            params.causal,
            attn_mask=_additive_mask(params.attn_mask, q.dtype),
            scale=params.softmax_scale,
        )
        if params.attn_mask is not None:
            lse = lse.masked_fill(_empty_rows(params).expand_as(lse), float("-inf"))
        return out.transpose(1, 2), SoftmaxStats(lse), None

    def backward(self, dout, q, k, v, out, stats, rng_state, params):
        if self._needs_fallback(q, k, params):
            return self.fallback.backward(dout, q, k, v, out, stats, rng_state, params)
        lse = stats.lse()
        dq, dk, dv = _fused_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            out.transpose(1, 2),
            # +inf on empty rows makes the kernel's exp(s - lse) exactly 0 there.
            torch.where(torch.isneginf(lse), float("inf"), lse),
            0.0,
            params.causal,
            attn_mask=_additive_mask(params.attn_mask, q.dtype),
            scale=params.softmax_scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def _needs_fallback(self, q: Tensor, k: Tensor, params: AttentionParams) -> bool:
        reason = None
        if q.shape[1] == 0 or k.shape[1] == 0:
            reason = "an empty sequence (torch's CPU kernel dies with SIGFPE on it)"
        elif params.dropout_p > 0:
            reason = "dropout_p > 0 (torch's fused CPU kernel has no dropout)"
        elif params.causal and q.shape[1] != k.shape[1]:
            reason = "causal with sq != sk (torch's CPU kernel aligns causal top-left)"
        return self._falls_back(reason)


def _empty_rows(params: AttentionParams) -> Tensor:
    """``[b|1, h|1, sq]``: rows the mask (combined with causal, sq == sk here) hides entirely."""
    mask = params.attn_mask
    if params.causal:
        sq, sk = mask.shape[-2:]
        mask = mask | torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    return mask.all(dim=-1)


def _additive_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """Bool mask (True = masked out) -> float mask with -inf where masked."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
