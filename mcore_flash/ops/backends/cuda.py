"""CUDA backend: torch's FlashAttention-2 kernel (``aten._scaled_dot_product_flash_attention``).

Covers fp16/bf16, no mask, and causal only with ``sq == sk`` (torch aligns causal
top-left); everything else -- and sliding windows, ``softcap``, ALiBi and
``deterministic=True`` (torch's flash backward accumulates dq with atomics), which torch's
kernel does not take -- runs the reference kernel on the GPU (logged once per reason).
torch's flash kernel has no native GQA: K/V heads are repeated for the kernel and the
gradients summed back over each group.

This path has NOT run on a GPU in this project's CI (no GPU there); see docs/benchmarks.md
for any GPU measurements.
"""

from __future__ import annotations


import torch

from .base import AttentionBackend, AttentionParams, SoftmaxStats, Tensor
from .reference import ReferenceBackend

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


class CudaBackend(AttentionBackend):
    """torch SDPA's flash kernel on NVIDIA GPUs."""

    name = "cuda"

    def __init__(self):
        self.fallback = ReferenceBackend()

    def unavailable_reason(self) -> str:
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        return ""

    def forward(self, q, k, v, params):
        if self._needs_fallback(q, k, params):
            return self.fallback.forward(q, k, v, params)
        groups = q.shape[2] // k.shape[2]
        out, lse, cum_q, cum_k, max_q, max_k, philox_seed, philox_offset, _ = (
            torch.ops.aten._scaled_dot_product_flash_attention(
                q.transpose(1, 2),
                _repeat_heads(k, groups).transpose(1, 2),
                _repeat_heads(v, groups).transpose(1, 2),
                params.dropout_p,
                params.causal,
                scale=params.softmax_scale,
            )
        )
        return out.transpose(1, 2), SoftmaxStats(lse), (cum_q, cum_k, max_q, max_k, philox_seed, philox_offset)

    def backward(self, dout, q, k, v, out, stats, rng_state, params):
        if self._needs_fallback(q, k, params):
            return self.fallback.backward(dout, q, k, v, out, stats, rng_state, params)
        groups = q.shape[2] // k.shape[2]
        cum_q, cum_k, max_q, max_k, philox_seed, philox_offset = rng_state
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.transpose(1, 2),
            q.transpose(1, 2),
            _repeat_heads(k, groups).transpose(1, 2),
            _repeat_heads(v, groups).transpose(1, 2),
            out.transpose(1, 2),
            stats.lse(),
            cum_q,
            cum_k,
            max_q,
            max_k,
            params.dropout_p,
            params.causal,
            philox_seed,
            philox_offset,
            scale=params.softmax_scale,
        )
        return dq.transpose(1, 2), _sum_heads(dk.transpose(1, 2), groups), _sum_heads(dv.transpose(1, 2), groups)

    def _needs_fallback(self, q: Tensor, k: Tensor, params: AttentionParams) -> bool:
        reason = None
        if q.dtype not in _FLASH_DTYPES:
            reason = f"{q.dtype} (torch's flash kernel takes float16/bfloat16)"
        elif params.attn_mask is not None:
            reason = "an explicit attn_mask (torch's flash kernel takes none)"
        elif params.causal and q.shape[1] != k.shape[1]:
            reason = "causal with sq != sk (torch aligns causal top-left)"
        elif params.window is not None:
            reason = "a sliding window (torch's flash kernel takes none)"
        elif params.softcap > 0 or params.alibi_slopes is not None:
            reason = "softcap / alibi_slopes (torch's flash kernel takes neither)"
        elif params.deterministic:
            reason = "deterministic=True (torch's flash backward is not deterministic)"
        return self._falls_back(reason)


def _repeat_heads(x: Tensor, groups: int) -> Tensor:
    """``[b, s, hkv, d]`` -> ``[b, s, hkv * groups, d]`` (head h uses kv head h // groups)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _sum_heads(grad: Tensor, groups: int) -> Tensor:
    """Inverse of :func:`_repeat_heads` for gradients: sum each group's copies."""
    if groups == 1:
        return grad
    b, s, h, d = grad.shape
    return grad.view(b, s, h // groups, groups, d).sum(dim=3)
