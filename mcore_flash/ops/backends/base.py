"""The one interface every attention backend implements.

A backend is a pair of *kernels*, ``forward`` and ``backward``, in the style of
FlashAttention-2's ``_flash_attn_forward`` / ``_flash_attn_backward``: forward returns the
output together with the softmax statistics (the logsumexp ``lse``), backward takes them
back and recomputes the probabilities. Autograd wiring lives in :mod:`mcore_flash.ops.api`;
context parallelism calls the kernels directly to merge partial results.

Conventions shared by all backends (tensors in the flash-attn layout):

* ``q`` ``[b, sq, hq, d]``, ``k``/``v`` ``[b, sk, hkv, d]`` with ``hq % hkv == 0`` (GQA/MQA;
  K/V are never expanded where the backend can avoid it).
* ``out`` ``[b, sq, hq, d]`` in ``q``'s dtype; ``lse`` ``[b, hq, sq]`` float32 (natural log).
* ``causal`` is aligned bottom-right (flash-attn >= 2.1): key ``j`` is visible to query ``i``
  iff ``j <= i + sk - sq``.
* A query row with no visible key yields ``out = 0``, ``lse = -inf`` and zero gradients.
* ``attn_mask`` is bool, True = masked out, shaped ``[b|1, hq|1, sq, sk]``; it is combined
  with ``causal``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Optional

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class AttentionParams:
    """The non-tensor arguments of one attention call (plus the optional bool mask)."""

    causal: bool
    softmax_scale: float
    dropout_p: float = 0.0
    attn_mask: Optional[Tensor] = None


class AttentionBackend(abc.ABC):
    """A fused attention implementation for one kind of device."""

    #: short name used by ``backend=`` and ``--attention-backend``
    name: str = ""

    def is_available(self) -> bool:
        """Whether this backend can run in the current process."""
        return not self.unavailable_reason()

    def unavailable_reason(self) -> str:
        """Empty when available; otherwise why not and how to fix it."""
        return ""

    def check_inputs(self, q: Tensor, k: Tensor, v: Tensor, params: AttentionParams) -> None:
        """Raise ``ValueError``/``TypeError`` for inputs beyond this backend's limits."""

    @abc.abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, params: AttentionParams) -> tuple[Tensor, Tensor, Any]:
        """Return ``(out [b, sq, hq, d], lse [b, hq, sq] fp32, rng_state)``.

        ``rng_state`` is whatever ``backward`` needs to replay dropout (None without dropout).
        """

    @abc.abstractmethod
    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        rng_state: Any,
        params: AttentionParams,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``.

        ``out`` and ``lse`` may be *merged* results (context parallelism): the kernel must
        use them rather than anything remembered from its own forward.
        """

    # ---- packed (varlen) sequences -------------------------------------------------------
    # Default: run each sequence as a batch of one. Backends with a native packed layout
    # (NPU "TND") override both methods.

    def varlen_forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: list[int],
        cu_seqlens_k: list[int],
        params: AttentionParams,
    ) -> tuple[Tensor, Tensor, Any]:
        """Packed attention. q ``[tq, hq, d]``, k/v ``[tk, hkv, d]``; cu_seqlens are Python
        lists starting at 0. Returns ``(out [tq, hq, d], lse [hq, tq] fp32, rng_state)``."""
        outs, lses, states = [], [], []
        for (q0, q1), (k0, k1) in _segments(cu_seqlens_q, cu_seqlens_k):
            out, lse, state = self.forward(
                q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0), params
            )
            outs.append(out.squeeze(0))
            lses.append(lse.squeeze(0))
            states.append(state)
        return torch.cat(outs), torch.cat(lses, dim=-1), states

    def varlen_backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        rng_state: Any,
        cu_seqlens_q: list[int],
        cu_seqlens_k: list[int],
        params: AttentionParams,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of :meth:`varlen_forward`; same layouts as its inputs."""
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        segments = _segments(cu_seqlens_q, cu_seqlens_k)
        for ((q0, q1), (k0, k1)), state in zip(segments, rng_state):
            grads = self.backward(
                dout[q0:q1].unsqueeze(0),
                q[q0:q1].unsqueeze(0),
                k[k0:k1].unsqueeze(0),
                v[k0:k1].unsqueeze(0),
                out[q0:q1].unsqueeze(0),
                lse[:, q0:q1].unsqueeze(0),
                state,
                params,
            )
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g.squeeze(0) for g in grads)
        return dq, dk, dv


def _segments(cu_seqlens_q: list[int], cu_seqlens_k: list[int]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Pairs of (q range, k range) for each packed sequence."""
    q_ranges = list(zip(cu_seqlens_q[:-1], cu_seqlens_q[1:]))
    k_ranges = list(zip(cu_seqlens_k[:-1], cu_seqlens_k[1:]))
    return list(zip(q_ranges, k_ranges))
