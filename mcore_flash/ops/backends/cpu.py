"""CPU backend: torch's fused flash kernel for the CPU, the reference kernel where it can't.

``aten._scaled_dot_product_flash_attention_for_cpu`` takes ``[b, h, s, d]``, supports GQA
natively and returns the logsumexp; its backward op takes it back.

* Half precision runs in float32 (:data:`COMPUTE_DTYPES`, the one place this is decided):
  the kernel's own bf16 backward accumulates dq/dk/dv and the GQA group sum in bf16 and
  misses flash-attn's error bound, and on this project's AVX2 machines the float32 kernel on
  upcast inputs is also about 5x faster (``docs/benchmarks.md``, "CPU half precision").
  ``out`` and the gradients are cast back to the input dtype.
* Anything the kernel cannot express as its own causal flag -- a sliding window, causal with
  ``sq != sk`` (it aligns causal top-left, we promise bottom-right), ALiBi, a bool
  ``attn_mask`` -- runs in query chunks of :attr:`CpuBackend.query_chunk` rows: each chunk
  sees only the key range its band allows (:func:`band_rows`; keys outside every row's window
  are never computed) and gets a small additive bias ``[.., chunk, keys]`` for that range.
  No ``[sq, sk]`` tensor is built and nothing but ``q, k, v, out, lse`` is saved.
* Rows that see no key get ``out = 0`` and ``lse = -inf`` (the kernel reports 0 there).

The reference kernel runs instead (decided from the arguments alone, so forward and backward
always agree, and logged once per reason -- never silently ignored) for dropout > 0 and
``softcap`` (the kernel has neither) and for an empty query or key sequence (the kernel
crashes the process with SIGFPE).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from .base import AttentionBackend, AttentionParams, SoftmaxStats, Tensor, alibi_bias, band_mask, band_rows
from .reference import ReferenceBackend

_fused_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_fused_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

#: the dtype the kernel computes in, per input dtype (others compute in their own)
COMPUTE_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class CpuBackend(AttentionBackend):
    """torch's fused CPU flash-attention kernel."""

    name = "cpu"

    def __init__(self, fallback: Optional[AttentionBackend] = None, query_chunk: int = 512):
        if query_chunk < 1:
            raise ValueError(f"query_chunk must be positive, got {query_chunk}")
        self.fallback = fallback or ReferenceBackend()
        self.query_chunk = query_chunk

    def forward(self, q, k, v, params):
        if self._needs_fallback(q, k, params):
            return self.fallback.forward(q, k, v, params)
        qc, kc, vc = _kernel_inputs(q, k, v)
        if not _needs_bias(params, q.shape[1], k.shape[1]):
            out, lse = _fused_forward(qc, kc, vc, 0.0, params.causal, scale=params.softmax_scale)
            return _output(out, q.dtype), SoftmaxStats(lse), None
        b, hq, sq, _ = qc.shape
        out = qc.new_zeros(b, hq, sq, vc.shape[-1])
        lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.promote_types(qc.dtype, torch.float32), device=q.device)
        for rows, cols, bias in self._chunks(params, b, hq, sq, kc.shape[2], qc.dtype, q.device):
            out_c, lse_c = _fused_forward(
                qc[:, :, rows], kc[:, :, cols], vc[:, :, cols], 0.0, False, attn_mask=bias, scale=params.softmax_scale
            )
            empty = torch.isneginf(bias).all(dim=-1).expand_as(lse_c)
            out[:, :, rows] = out_c.masked_fill(empty.unsqueeze(-1), 0.0)
            lse[:, :, rows] = lse_c.masked_fill(empty, float("-inf"))
        return _output(out, q.dtype), SoftmaxStats(lse), None

    def backward(self, dout, q, k, v, out, stats, rng_state, params):
        if self._needs_fallback(q, k, params):
            return self.fallback.backward(dout, q, k, v, out, stats, rng_state, params)
        qc, kc, vc, doc, outc = _kernel_inputs(q, k, v, dout, out)
        # +inf on empty rows makes the kernel's exp(s - lse) exactly 0 there.
        lse = stats.lse().to(qc.dtype)
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)
        if not _needs_bias(params, q.shape[1], k.shape[1]):
            grads = _fused_backward(doc, qc, kc, vc, outc, lse, 0.0, params.causal, scale=params.softmax_scale)
            return tuple(_output(g, x.dtype) for g, x in zip(grads, (q, k, v)))
        dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
        b, hq, sq, _ = qc.shape
        for rows, cols, bias in self._chunks(params, b, hq, sq, kc.shape[2], qc.dtype, q.device):
            dq_c, dk_c, dv_c = _fused_backward(
                doc[:, :, rows], qc[:, :, rows], kc[:, :, cols], vc[:, :, cols], outc[:, :, rows],
                lse[:, :, rows], 0.0, False, attn_mask=bias, scale=params.softmax_scale,
            )  # fmt: skip
            dq[:, :, rows] = dq_c
            dk[:, :, cols] += dk_c
            dv[:, :, cols] += dv_c
        return _output(dq, q.dtype), _output(dk, k.dtype), _output(dv, v.dtype)

    def _chunks(self, params: AttentionParams, b: int, hq: int, sq: int, sk: int, dtype, device) -> Iterator[tuple[slice, slice, Tensor]]:
        """``(query rows, key columns, additive bias [b|1, hq|1, rows, cols])`` per chunk of
        query rows; chunks whose band holds no key are left out (their rows stay empty)."""
        lo, hi = params.band()
        for q0 in range(0, sq, self.query_chunk):
            q1 = min(q0 + self.query_chunk, sq)
            k0, k1 = band_rows(lo, hi, q0, q1, sq, sk)
            if k0 == k1:
                continue
            hidden = band_mask(lo, hi, (q0, q1), (k0, k1), sq, sk, device)
            if params.attn_mask is not None:
                hidden = hidden | params.attn_mask[..., q0:q1, k0:k1]
            bias = torch.zeros(hidden.shape, dtype=dtype, device=device)
            if params.alibi_slopes is not None:
                bias = bias + alibi_bias(params.alibi_slopes, (q0, q1), (k0, k1), sq, sk).to(dtype)
            bias = bias.masked_fill(hidden, float("-inf"))
            while bias.dim() < 4:
                bias = bias.unsqueeze(0)
            yield slice(q0, q1), slice(k0, k1), bias

    def _needs_fallback(self, q: Tensor, k: Tensor, params: AttentionParams) -> bool:
        reason = None
        if q.shape[1] == 0 or k.shape[1] == 0:
            reason = "an empty sequence (torch's CPU kernel dies with SIGFPE on it)"
        elif params.dropout_p > 0:
            reason = "dropout_p > 0 (torch's fused CPU kernel has no dropout)"
        elif params.softcap > 0:
            reason = "softcap (torch's fused CPU kernel has no score capping)"
        return self._falls_back(reason)


def _needs_bias(params: AttentionParams, sq: int, sk: int) -> bool:
    """Whether the call needs the chunked, biased path (see the module docstring)."""
    top_left_differs = params.causal and sq != sk
    return params.window is not None or params.alibi_slopes is not None or params.attn_mask is not None or top_left_differs


def _kernel_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``[b, s, h, d]`` tensors as the kernel's ``[b, h, s, d]`` views in the compute dtype."""
    return tuple(x.transpose(1, 2).to(COMPUTE_DTYPES.get(x.dtype, x.dtype)) for x in tensors)


def _output(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A kernel result ``[b, h, s, d]`` back as ``[b, s, h, d]`` in ``dtype``."""
    return x.transpose(1, 2).to(dtype)
