"""The one interface every attention backend implements.

A backend (:class:`AttentionBackend`) is a pair of *kernels*, ``forward`` and ``backward``, in
the style of FlashAttention-2's ``_flash_attn_forward`` / ``_flash_attn_backward``: forward
returns the output together with the softmax statistics (:class:`SoftmaxStats`), backward
takes them back and recomputes the probabilities. Autograd wiring lives in
:mod:`mcore_flash.ops.api`; context parallelism calls the kernels directly to merge partial
results (:func:`forward_kernel` / :func:`backward_kernel` put the tensors in a layout the
backend takes).

Conventions shared by all backends (each argument's own: :class:`AttentionParams`):

* layouts ``"bshd"`` (``q`` ``[b, sq, hq, d]``, ``k``/``v`` ``[b, sk, hkv, d]``) and
  ``"sbhd"`` (Megatron's ``[s, b, h, d]``); ``hq % hkv == 0`` (GQA/MQA);
* ``out`` is in the layout and dtype of ``q``; the statistics are float32
  ``[b, hq, sq(, w)]`` in every layout;
* ``causal`` is aligned bottom-right (flash-attn >= 2.1): key ``j`` is visible to query ``i``
  iff ``j <= i + sk - sq``; a window is a band ``(lo, hi)`` of ``j - i - (sk - sq)``;
* a query row with no visible key yields ``out = 0``, ``lse = -inf`` and zero gradients.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

logger = logging.getLogger("mcore_flash")

Tensor = torch.Tensor


LAYOUTS = ("bshd", "sbhd")


@dataclass(frozen=True)
class AttentionParams:
    """The non-tensor arguments of one attention call (plus the optional bool mask).

    Conventions shared by all backends:

    * Dense layouts (``layout``): ``"bshd"`` (flash-attn's; ``q`` ``[b, sq, hq, d]``,
      ``k``/``v`` ``[b, sk, hkv, d]``) and ``"sbhd"`` (Megatron's ``[s, b, h, d]``). A backend
      lists the ones its kernels take in ``layouts``; the others reach it as transposed views.
      ``hq % hkv == 0`` (GQA/MQA; K/V are never expanded where the backend can avoid it).
    * ``out`` is in the layout and dtype of ``q``; the statistics are float32
      ``[b, hq, sq(, w)]`` in every layout.
    * ``causal`` is aligned bottom-right (flash-attn >= 2.1): key ``j`` is visible to query
      ``i`` iff ``j <= i + sk - sq``.
    * A query row with no visible key yields ``out = 0``, ``lse = -inf`` and zero gradients.
    * ``attn_mask`` is bool, True = masked out, shaped ``[b|1, hq|1, sq, sk]``; it is combined
      with ``causal``.
    * ``window = (lo, hi)`` (a band, None = unbounded on that side): key ``j`` is visible to
      query ``i`` iff ``lo <= j - i - (sk - sq) <= hi``, the bottom-right aligned band of
      flash-attn's ``window_size=(left, right)`` as ``(-left, right)``. Causal is the band
      ``(None, 0)``; :func:`band` keeps one spelling for each, so a backend sees either
      ``causal`` or a ``window``, never both. Offsets may be of either sign (context
      parallelism shifts them for blocks away from the diagonal).
    * ``softcap > 0`` replaces each scaled score ``s`` by ``softcap * tanh(s / softcap)``;
      ``alibi_slopes`` (float32 ``[hq]`` or ``[b, hq]``) then adds
      ``-slope * |i + sk - sq - j + alibi_shift|`` (flash-attn's definition, for causal
      attention too, when ``alibi_shift`` is 0; context parallelism sets it to a block's
      distance below the global diagonal, as it shifts a window's band).
    """

    causal: bool
    softmax_scale: float
    dropout_p: float = 0.0
    attn_mask: Optional[Tensor] = None
    layout: str = "bshd"
    window: Optional[tuple[Optional[int], Optional[int]]] = None
    softcap: float = 0.0
    alibi_slopes: Optional[Tensor] = None
    alibi_shift: int = 0
    deterministic: bool = False

    def band(self) -> tuple[Optional[int], Optional[int]]:
        """The visible offsets ``(lo, hi)`` of ``j - i - (sk - sq)``, causal included."""
        if self.window is not None:
            return self.window
        return (None, 0) if self.causal else (None, None)

    def with_band(self, lo: Optional[int], hi: Optional[int]) -> "AttentionParams":
        """These params with the band ``(lo, hi)`` in its canonical spelling (:func:`band`)."""
        causal, window = band(lo, hi)
        return replace(self, causal=causal, window=window)


def band(
    lo: Optional[int], hi: Optional[int]
) -> tuple[bool, Optional[tuple[Optional[int], Optional[int]]]]:
    """``(causal, window)`` for the band ``lo <= j - i - (sk - sq) <= hi``: ``(None, 0)`` is
    causal, ``(None, None)`` full attention, anything else a window with causal False."""
    if lo is None and hi is None:
        return False, None
    if lo is None and hi == 0:
        return True, None
    return False, (lo, hi)


def band_rows(
    lo: Optional[int], hi: Optional[int], q0: int, q1: int, sq: int, sk: int
) -> tuple[int, int]:
    """The key range ``[k0, k1)`` (clipped to ``[0, sk)``, possibly empty) that query rows
    ``[q0, q1)`` see under the band ``(lo, hi)``."""
    shift = sk - sq
    k0 = 0 if lo is None else max(0, q0 + shift + lo)
    k1 = sk if hi is None else min(sk, q1 - 1 + shift + hi + 1)
    return k0, max(k0, k1)


Range = tuple[int, int]  # [start, end) of query rows or key columns


def band_offsets(q_range: Range, k_range: Range, sq: int, sk: int, device) -> Tensor:
    """Int ``[q1 - q0, k1 - k0]``: ``j - i - (sk - sq)`` of each (query, key) pair of the block."""
    (q0, q1), (k0, k1) = q_range, k_range
    return (
        torch.arange(k0, k1, device=device)
        - torch.arange(q0, q1, device=device).unsqueeze(-1)
        - (sk - sq)
    )


def inf_where_no_key(lse: Tensor) -> Tensor:
    """The logsumexp with ``+inf`` on rows that see no key (``-inf``): what a backward kernel
    recomputes ``exp(s - lse)`` from (exactly 0 there), and flash-attn's own convention."""
    return torch.where(torch.isneginf(lse), float("inf"), lse)


def band_crosses(
    lo: Optional[int], hi: Optional[int], q_range: Range, k_range: Range, sq: int, sk: int
) -> bool:
    """Whether the block ``q_range x k_range`` holds a key outside the band (needs masking)."""
    (q0, q1), (k0, k1) = q_range, k_range
    shift = sk - sq
    below = lo is not None and k0 - (q1 - 1) - shift < lo
    above = hi is not None and (k1 - 1) - q0 - shift > hi
    return below or above


def band_mask(
    lo: Optional[int], hi: Optional[int], q_range: Range, k_range: Range, sq: int, sk: int, device
) -> Tensor:
    """Bool ``[q1 - q0, k1 - k0]``: True where the key is OUTSIDE the band (masked out)."""
    offset = band_offsets(q_range, k_range, sq, sk, device)
    outside = torch.zeros(offset.shape, dtype=torch.bool, device=device)
    if lo is not None:
        outside |= offset < lo
    if hi is not None:
        outside |= offset > hi
    return outside


def alibi_bias(params: AttentionParams, q_range: Range, k_range: Range, sq: int, sk: int) -> Tensor:
    """Float32 ``[b|1, hq, q1 - q0, k1 - k0]``: ``-slope * |i + sk - sq - j + alibi_shift|``
    for ``params.alibi_slopes``."""
    slopes = params.alibi_slopes
    distance = (band_offsets(q_range, k_range, sq, sk, slopes.device) - params.alibi_shift).abs()
    slopes = slopes.float() if slopes.dim() == 2 else slopes.float().unsqueeze(0)
    return -slopes[..., None, None] * distance.float()


@dataclass(frozen=True)
class SoftmaxStats:
    """Per-query-row softmax statistics: what a backward kernel recomputes probabilities from.

    ``p = exp(score - row_max) / row_sum``. Backends that keep only the logsumexp (cpu, cuda,
    reference) hold it as ``row_max`` with ``row_sum = None`` (a sum of 1), shaped
    ``[b, h, sq]``; npu keeps the kernel's own ``softmax_max`` and ``softmax_sum``,
    ``[b, h, sq, 8]`` (8 identical copies). Query rows are dim 2 either way; all float32.
    Rows that see no key have ``lse = -inf``.
    """

    row_max: Tensor
    row_sum: Optional[Tensor] = None

    def lse(self) -> Tensor:
        """The logsumexp ``[b, h, sq]`` float32 (natural log)."""
        if self.row_sum is None:
            return self.row_max
        row_max, row_sum = self.row_max[..., 0], self.row_sum[..., 0]
        return torch.where(row_sum > 0, row_max + torch.log(row_sum), float("-inf"))

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors to save for backward (:meth:`from_tensors` inverts it)."""
        return (self.row_max,) if self.row_sum is None else (self.row_max, self.row_sum)

    @classmethod
    def from_tensors(cls, tensors) -> "SoftmaxStats":
        return cls(*tensors)

    def rows(self, index: slice) -> "SoftmaxStats":
        """The statistics of query rows ``index`` (contiguous, as kernels take them)."""
        return SoftmaxStats(*(x[:, :, index].contiguous() for x in self.tensors()))

    @classmethod
    def cat(cls, parts: list["SoftmaxStats"]) -> "SoftmaxStats":
        """Concatenate along the query rows."""
        return cls(*(torch.cat(xs, dim=2) for xs in zip(*(part.tensors() for part in parts))))


class AttentionBackend(abc.ABC):
    """A fused attention implementation for one kind of device."""

    #: short name used by ``backend=`` and ``--attention-backend``
    name: str = ""
    #: dense layouts the kernels take as they are
    layouts: tuple[str, ...] = ("bshd",)

    def is_available(self) -> bool:
        """Whether this backend can run in the current process."""
        return not self.unavailable_reason()

    def unavailable_reason(self) -> str:
        """Empty when available; otherwise why not and how to fix it."""
        return ""

    def check_inputs(self, q: Tensor, k: Tensor, v: Tensor, params: AttentionParams) -> None:
        """Raise ``ValueError``/``TypeError`` for inputs beyond this backend's limits."""

    def check_params(self, params: AttentionParams) -> None:
        """Raise ``ValueError`` for a keyword this backend cannot honour, naming both."""

    def _falls_back(self, reason: Optional[str]) -> bool:
        """Whether a call runs the reference kernel instead (``reason`` given, from the
        arguments alone so forward and backward agree); each reason is logged once."""
        if reason is None:
            return False
        logged = self.__dict__.setdefault("_logged_reasons", set())
        if reason not in logged:
            logged.add(reason)
            logger.info(
                "mcore_flash: %s backend runs the reference kernel for %s", self.name, reason
            )
        return True

    @abc.abstractmethod
    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, params: AttentionParams
    ) -> tuple[Tensor, SoftmaxStats, Any]:
        """Return ``(out, stats, rng_state)`` for q, k, v in ``params.layout``.

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
        stats: SoftmaxStats,
        rng_state: Any,
        params: AttentionParams,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``.

        ``out`` and ``stats`` may be *merged* results (context parallelism): the kernel must
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
    ) -> tuple[Tensor, SoftmaxStats, Any]:
        """Packed attention. q ``[tq, hq, d]``, k/v ``[tk, hkv, d]``; cu_seqlens are Python
        lists starting at 0. Returns ``(out [tq, hq, d], stats [1, hq, tq(, w)], rng_state)``."""
        outs, stats, states = [], [], []
        for i, ((q0, q1), (k0, k1)) in enumerate(_segments(cu_seqlens_q, cu_seqlens_k)):
            out, stat, state = self.forward(
                q[q0:q1].unsqueeze(0),
                k[k0:k1].unsqueeze(0),
                v[k0:k1].unsqueeze(0),
                _sequence_params(params, i),
            )
            outs.append(out.squeeze(0))
            stats.append(stat)
            states.append(state)
        return torch.cat(outs), SoftmaxStats.cat(stats), states

    def varlen_backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        stats: SoftmaxStats,
        rng_state: Any,
        cu_seqlens_q: list[int],
        cu_seqlens_k: list[int],
        params: AttentionParams,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of :meth:`varlen_forward`; same layouts as its inputs."""
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        segments = _segments(cu_seqlens_q, cu_seqlens_k)
        for i, (((q0, q1), (k0, k1)), state) in enumerate(zip(segments, rng_state)):
            grads = self.backward(
                dout[q0:q1].unsqueeze(0),
                q[q0:q1].unsqueeze(0),
                k[k0:k1].unsqueeze(0),
                v[k0:k1].unsqueeze(0),
                out[q0:q1].unsqueeze(0),
                stats.rows(slice(q0, q1)),
                state,
                _sequence_params(params, i),
            )
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g.squeeze(0) for g in grads)
        return dq, dk, dv


def _sequence_params(params: AttentionParams, index: int) -> AttentionParams:
    """The params of packed sequence ``index`` run as a batch of one (its row of ``[n, hq]``
    ALiBi slopes)."""
    if params.alibi_slopes is None or params.alibi_slopes.dim() == 1:
        return params
    return replace(params, alibi_slopes=params.alibi_slopes[index : index + 1])


def _segments(
    cu_seqlens_q: list[int], cu_seqlens_k: list[int]
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Pairs of (q range, k range) for each packed sequence."""
    q_ranges = list(zip(cu_seqlens_q[:-1], cu_seqlens_q[1:]))
    k_ranges = list(zip(cu_seqlens_k[:-1], cu_seqlens_k[1:]))
    return list(zip(q_ranges, k_ranges))


def forward_kernel(
    backend: AttentionBackend, q: Tensor, k: Tensor, v: Tensor, params: AttentionParams
):
    """``backend.forward`` for tensors in ``params.layout``, transposed (as views) into
    "bshd" for a backend whose kernels do not take that layout."""
    if params.layout in backend.layouts:
        return backend.forward(q, k, v, params)
    out, stats, rng_state = backend.forward(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), _bshd(params)
    )
    return out.transpose(0, 1), stats, rng_state


def backward_kernel(
    backend: AttentionBackend,
    dout,
    q,
    k,
    v,
    out,
    stats: SoftmaxStats,
    rng_state,
    params: AttentionParams,
) -> tuple[Tensor, Tensor, Tensor]:
    """``backend.backward`` for tensors in ``params.layout`` (see :func:`forward_kernel`)."""
    if params.layout in backend.layouts:
        return backend.backward(dout, q, k, v, out, stats, rng_state, params)
    views = (x.transpose(0, 1) for x in (dout, q, k, v, out))
    grads = backend.backward(*views, stats, rng_state, _bshd(params))
    return tuple(grad.transpose(0, 1) for grad in grads)


def _bshd(params: AttentionParams) -> AttentionParams:
    return replace(params, layout="bshd")
