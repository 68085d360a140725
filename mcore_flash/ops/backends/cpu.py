"""CPU backend: torch's fused flash kernel for the CPU, the reference kernel where it can't.

``aten._scaled_dot_product_flash_attention_for_cpu`` takes ``[b, h, s, d]``, supports GQA
natively and returns the logsumexp; its backward op takes it back. :class:`CpuBackend`
keeps the conventions of :mod:`.base`:

* it computes in the dtype :func:`compute_dtype` decides (backward always in float32);
  ``out`` and the gradients are cast back to the input dtype;
* what the kernel cannot express as its own causal flag (a sliding window, causal with
  ``sq != sk``, ALiBi, a bool ``attn_mask``) runs in query chunks, each with a small additive
  bias over the keys its band reaches (:meth:`CpuBackend._chunks`): no ``[sq, sk]`` tensor is
  built and nothing but ``q, k, v, out, lse`` is saved;
* rows that see no key get ``out = 0`` and ``lse = -inf`` (the kernel reports 0 there);
* dropout > 0, ``softcap`` and empty sequences run the reference kernel, logged once per
  reason (:meth:`CpuBackend._needs_fallback`).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from .base import (
    AttentionBackend,
    AttentionParams,
    SoftmaxStats,
    Tensor,
    alibi_bias,
    band_mask,
    band_rows,
    inf_where_no_key,
)
from .reference import ReferenceBackend

_fused_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_fused_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def compute_dtype(
    dtype: torch.dtype, backward: bool, alibi: bool = False, native_bf16: Optional[bool] = None
) -> torch.dtype:
    """The dtype the kernel computes in for inputs of ``dtype``: the one place that decides it.

    Backward always runs in float32 on upcast inputs: the kernel's own bf16 backward
    accumulates dq/dk/dv and the GQA group sum in bf16 and misses flash-attn's error bound
    (``tests/ops/test_flash_attn_grid.py``). Forward runs bf16 in bf16 where the CPU has native
    bf16 units (AVX512-BF16 / AMX: faster than float32 and within the bound) unless ALiBi
    biases are added, float32 elsewhere (on AVX2 the float32 kernel was the faster one); fp16
    always runs in float32 (torch's fp16 CPU kernel is no faster than float32).
    ``docs/benchmarks.md``, "CPU half precision", has the measurements.

    ``alibi``: the call adds ALiBi biases, which reach the kernel in its compute dtype and
    grow with the distance (bf16 would round a bias of 60 to a multiple of 0.25): float32.
    ``native_bf16``: whether the CPU has bf16 units; None asks torch (AVX512-BF16 or AMX)."""
    if dtype == torch.bfloat16 and not backward and not alibi:
        if native_bf16 is None:
            native_bf16 = (
                torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
            )
        return torch.bfloat16 if native_bf16 else torch.float32
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class CpuBackend(AttentionBackend):
    """torch's fused CPU flash-attention kernel.

    Anything the kernel cannot express as its own causal flag -- a sliding window, causal
    with ``sq != sk`` (it aligns causal top-left, we promise bottom-right), ALiBi, a bool
    ``attn_mask`` -- runs in query chunks of :attr:`query_chunk` rows: each chunk sees only
    the key range its band allows (:func:`~.base.band_rows`; keys outside every row's window
    are never computed) and gets a small additive bias ``[.., chunk, keys]`` for that range
    (:meth:`_chunks`). No ``[sq, sk]`` tensor is built and nothing but ``q, k, v, out, lse`` is
    saved. Rows that see no key get ``out = 0`` and ``lse = -inf`` (the kernel reports 0
    there).
    """

    name = "cpu"

    def __init__(
        self,
        fallback: Optional[AttentionBackend] = None,
        query_chunk: int = 256,
        native_bf16: Optional[bool] = None,
    ):
        if query_chunk < 1:
            raise ValueError(f"query_chunk must be positive, got {query_chunk}")
        self.fallback = fallback or ReferenceBackend()
        self.query_chunk = query_chunk
        self.native_bf16 = native_bf16  # None: ask torch (compute_dtype)

    def forward(self, q, k, v, params):
        if self._needs_fallback(q, k, params):
            return self.fallback.forward(q, k, v, params)
        dtype = compute_dtype(q.dtype, False, params.alibi_slopes is not None, self.native_bf16)
        qc, kc, vc = _kernel_inputs(dtype, q, k, v)
        if not _needs_bias(params, q.shape[1], k.shape[1]):
            out, lse = _fused_forward(qc, kc, vc, 0.0, params.causal, scale=params.softmax_scale)
            return _output(out, q.dtype), SoftmaxStats(lse), None
        b, hq, sq, _ = qc.shape
        out = qc.new_zeros(b, hq, sq, vc.shape[-1])
        lse_dtype = torch.promote_types(qc.dtype, torch.float32)
        lse = torch.full((b, hq, sq), float("-inf"), dtype=lse_dtype, device=q.device)
        for rows, cols, bias in self._chunks(params, sq, kc.shape[2], qc.dtype, q.device):
            out_c, lse_c = _fused_forward(
                qc[:, :, rows],
                kc[:, :, cols],
                vc[:, :, cols],
                0.0,
                False,
                attn_mask=bias,
                scale=params.softmax_scale,
            )
            empty = torch.isneginf(bias).all(dim=-1).expand_as(lse_c)
            out[:, :, rows] = out_c.masked_fill(empty.unsqueeze(-1), 0.0)
            lse[:, :, rows] = lse_c.masked_fill(empty, float("-inf"))
        return _output(out, q.dtype), SoftmaxStats(lse), None

    def backward(self, dout, q, k, v, out, stats, rng_state, params):
        if self._needs_fallback(q, k, params):
            return self.fallback.backward(dout, q, k, v, out, stats, rng_state, params)
        qc, kc, vc, doc, outc = _kernel_inputs(compute_dtype(q.dtype, True), q, k, v, dout, out)
        lse = inf_where_no_key(stats.lse().to(qc.dtype))
        if not _needs_bias(params, q.shape[1], k.shape[1]):
            grads = _fused_backward(
                doc, qc, kc, vc, outc, lse, 0.0, params.causal, scale=params.softmax_scale
            )
            return tuple(_output(g, x.dtype) for g, x in zip(grads, (q, k, v)))
        dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
        sq = qc.shape[2]
        for rows, cols, bias in self._chunks(params, sq, kc.shape[2], qc.dtype, q.device):
            dq_c, dk_c, dv_c = _fused_backward(
                doc[:, :, rows],
                qc[:, :, rows],
                kc[:, :, cols],
                vc[:, :, cols],
                outc[:, :, rows],
                lse[:, :, rows],
                0.0,
                False,
                attn_mask=bias,
                scale=params.softmax_scale,
            )
            dq[:, :, rows] = dq_c
            dk[:, :, cols] += dk_c
            dv[:, :, cols] += dv_c
        return _output(dq, q.dtype), _output(dk, k.dtype), _output(dv, v.dtype)

    def _chunks(
        self, params: AttentionParams, sq: int, sk: int, dtype, device
    ) -> Iterator[tuple[slice, slice, Tensor]]:
        """``(query rows, key columns, additive bias [b|1, hq|1, rows, cols])`` per chunk of
        query rows; chunks whose band holds no key are left out (their rows stay empty).

        Without an explicit mask the bias depends only on the chunk's shape and its offset
        from the diagonal (band and ALiBi distance are translation invariant), so the chunks
        inside the sequence share one tensor."""
        lo, hi = params.band()
        shared: dict[tuple[int, int, int], Tensor] = {}
        for q0 in range(0, sq, self.query_chunk):
            q1 = min(q0 + self.query_chunk, sq)
            k0, k1 = band_rows(lo, hi, q0, q1, sq, sk)
            if k0 == k1:
                continue
            key = (k0 - q0 - (sk - sq), q1 - q0, k1 - k0)
            if params.attn_mask is None and key in shared:
                yield slice(q0, q1), slice(k0, k1), shared[key]
                continue
            hidden = band_mask(lo, hi, (q0, q1), (k0, k1), sq, sk, device)
            if params.attn_mask is not None:
                hidden = hidden | params.attn_mask[..., q0:q1, k0:k1]
            bias = torch.zeros(hidden.shape, dtype=dtype, device=device)
            if params.alibi_slopes is not None:
                bias = bias + alibi_bias(params, (q0, q1), (k0, k1), sq, sk).to(dtype)
            bias = bias.masked_fill(hidden, float("-inf"))
            while bias.dim() < 4:
                bias = bias.unsqueeze(0)
            if params.attn_mask is None:
                shared[key] = bias
            yield slice(q0, q1), slice(k0, k1), bias

    def _needs_fallback(self, q: Tensor, k: Tensor, params: AttentionParams) -> bool:
        """Whether the reference kernel runs instead: for dropout > 0 and ``softcap`` (the
        kernel has neither) and for an empty query or key sequence (the kernel crashes the
        process with SIGFPE). Decided from the arguments alone, so forward and backward always
        agree, and logged once per reason -- never silently ignored."""
        reason = None
        if q.shape[1] == 0 or k.shape[1] == 0:
            reason = "an empty sequence (torch's CPU kernel dies with SIGFPE on it)"
        elif params.dropout_p > 0:
            reason = "dropout_p > 0 (torch's fused CPU kernel has no dropout)"
        elif params.softcap > 0:
            reason = "softcap (torch's fused CPU kernel has no score capping)"
        return self._falls_back(reason)


def _needs_bias(params: AttentionParams, sq: int, sk: int) -> bool:
    """Whether the call needs the chunked, biased path (see :class:`CpuBackend`)."""
    top_left_differs = params.causal and sq != sk
    biased = params.alibi_slopes is not None or params.attn_mask is not None
    return params.window is not None or biased or top_left_differs


def _kernel_inputs(dtype: torch.dtype, *tensors: Tensor) -> tuple[Tensor, ...]:
    """``[b, s, h, d]`` tensors as the kernel's ``[b, h, s, d]`` views in ``dtype``."""
    return tuple(x.transpose(1, 2).to(dtype) for x in tensors)


def _output(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A kernel result ``[b, h, s, d]`` back as ``[b, s, h, d]`` in ``dtype``."""
    return x.transpose(1, 2).to(dtype)
