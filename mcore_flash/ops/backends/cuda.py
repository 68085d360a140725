"""CUDA backend: torch's fused attention kernels, called directly (no SDPA dispatch).

Two kernels, both with native GQA/MQA (K/V are never expanded): ``flash``
(:class:`FlashKernel`, FlashAttention-2 as built into torch; ``[b, s, h, d]`` as it is or
packed ``[t, h, d]``, causal aligned bottom-right) and ``cudnn`` (:class:`CudnnKernel`,
cuDNN's fused attention on ``[b, h, s, d]`` views). Each kernel's ``misfit`` names the calls
it cannot take.

:meth:`CudaBackend.choose_kernel` picks one per call (each choice logged once): by default
cuDNN where torch's own SDPA prefers it (:meth:`CudaDevice.prefers_cudnn`) and the call fits
it, otherwise flash; ``MCORE_FLASH_CUDA_KERNEL=flash|cudnn`` puts one kernel first. What
neither kernel takes -- fp32, an explicit mask, a window that excludes the diagonal, softcap,
ALiBi, ``deterministic=True``, empty sequences -- runs the reference kernel on the GPU
(logged once per reason). Why cuDNN first: ``docs/benchmarks.md``, "Attention kernels (GPU)".

This path has NOT run on a GPU in this project's CI (no GPU there): on the CPU the calls are
checked against a test double that validates each one with torch's own meta kernels and
computes in float64 (``tests/_support/cuda_double.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from .base import AttentionBackend, AttentionParams, SoftmaxStats, Tensor, inf_where_no_key
from .reference import ReferenceBackend

logger = logging.getLogger("mcore_flash")

ENV_VAR = "MCORE_FLASH_CUDA_KERNEL"
PREFERENCES = ("auto", "flash", "cudnn")
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CudaDevice:
    """What the kernel choice needs to know of a GPU."""

    capability: tuple[int, int]
    cudnn_version: int  # as torch.backends.cudnn.version() reports it (91600 = 9.16.0); 0 = none
    cuda_major: int = 12  # of the CUDA torch was built with
    cudnn_deprioritized: bool = False  # TORCH_CUDNN_SDPA_DEPRIORITIZED=1

    def prefers_cudnn(self) -> bool:
        """torch's own rule (sdp_utils.cpp ``check_prefer_cudnn_attention``): sm90 / sm10x
        (CUDA < 13 builds: minor 0 or 3 only) with cuDNN newer than 9.15.0, unless deprioritized."""
        major, minor = self.capability
        minor_ok = self.cuda_major >= 13 or minor in (0, 3)
        return (
            not self.cudnn_deprioritized
            and major in (9, 10)
            and minor_ok
            and self.cudnn_version > 91500
        )

    def __str__(self) -> str:
        major, minor = self.capability
        return f"sm{major}{minor}, cuDNN {self.cudnn_version or 'none'}"


@functools.lru_cache(maxsize=None)
def query_device(index: int) -> CudaDevice:
    """The :class:`CudaDevice` of ``cuda:index`` (asked once per device)."""
    return CudaDevice(
        tuple(torch.cuda.get_device_capability(index)),
        torch.backends.cudnn.version() or 0,
        int((torch.version.cuda or "0").split(".")[0]),
        os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0").lower() in ("1", "true", "on", "yes"),
    )


def _device_of(x: Tensor) -> CudaDevice:
    return query_device(
        x.device.index if x.device.index is not None else torch.cuda.current_device()
    )


class KernelState(NamedTuple):
    """What a kernel's backward needs from its forward besides the saved tensors."""

    kernel: str
    values: tuple
    lse_shape: tuple[int, ...]  # the kernel's own logsumexp shape


class Packed(NamedTuple):
    """Cumulative lengths of packed sequences, as the flash kernel takes them."""

    cu_q: Tensor  # int32 [n + 1] on the device
    cu_k: Tensor
    max_q: int
    max_k: int


def _shape_misfit(
    q: Tensor, k: Tensor, params: AttentionParams, max_head_dim: int, name: str
) -> Optional[str]:
    """The limits both kernels share (``None`` when the call fits)."""
    d = q.shape[-1]
    if q.dtype not in _HALF:
        return f"{q.dtype} ({name} takes float16/bfloat16)"
    if d % 8 or d > max_head_dim:
        return f"head_dim {d} ({name} takes multiples of 8 up to {max_head_dim})"
    if params.attn_mask is not None:
        return f"an explicit attn_mask ({name} takes none)"
    if params.softcap > 0 or params.alibi_slopes is not None:
        return f"softcap / alibi_slopes ({name} takes neither in backward)"
    if params.deterministic:
        return f"deterministic=True ({name}'s backward accumulates with atomics)"
    if 0 in (q.shape[-3], k.shape[-3]):
        return f"an empty sequence ({name} needs at least one query and one key)"
    return None


class FlashKernel:
    """FlashAttention-2 in torch: dense ``[b, s, h, d]`` or packed ``[t, h, d]``.

    ``aten._flash_attention_forward`` / ``_flash_attention_backward``: ``[b, s, h, d]`` as it
    is, packed ``[t, h, d]`` with cumulative lengths, causal aligned bottom-right (our
    convention, also for sq != sk), sliding windows whose two sides are >= 0 (with sq > sk + 1
    also a right side below sk: torch caps a larger or missing one at sk), dropout. sm80-sm121,
    fp16/bf16, head_dim a multiple of 8 up to 256 (192 on sm86-sm89 and sm12x, whose flash
    backward takes no more).
    """

    name = "flash"

    def __init__(self, aten):
        self.aten = aten

    def misfit(
        self, q: Tensor, k: Tensor, params: AttentionParams, device: CudaDevice, lengths=None
    ) -> Optional[str]:
        """Why the kernel cannot take the call (None: it can); ``lengths`` ``[(sq, sk), ...]``
        of packed sequences."""
        if not (8, 0) <= device.capability <= (12, 1):
            return f"{device} (torch's flash kernel runs on sm80-sm121)"
        if q.shape[-1] > 192 and (
            (8, 6) <= device.capability <= (8, 9) or device.capability >= (12, 0)
        ):
            return (
                f"head_dim {q.shape[-1]} on {device} (its flash backward takes at most 192 there)"
            )
        lo, hi = params.window or (None, None)
        if (lo is not None and lo > 0) or (hi is not None and hi < 0):
            return "a window that excludes the diagonal (the flash kernel reads a negative side as unbounded)"
        lengths = lengths or [(q.shape[1], k.shape[1])]
        max_k = max(sk for _, sk in lengths)
        if (
            params.window is not None
            and any(sq > max_k + 1 for sq, _ in lengths)
            and (hi is None or hi >= max_k)
        ):
            return "a window without a right side below sk with sq > sk + 1 (the flash kernel caps that side at sk)"
        return _shape_misfit(q, k, params, 256, "torch's flash kernel")

    def forward(self, q, k, v, params: AttentionParams, packed: Optional[Packed] = None):
        """``(out like q, lse float32 [b, h, sq] or [h, t] with -inf on rows without keys,
        state)``."""
        out, lse, rng, unused, _ = self.aten._flash_attention_forward(
            *(_last_dim_contiguous(x) for x in (q, k, v)),
            *_lengths(q, k, packed),
            params.dropout_p,
            params.causal,
            False,
            **_flash_keywords(params),
        )
        lse = torch.where(
            torch.isposinf(lse), float("-inf"), lse
        )  # the kernel's +inf: flash-attn's convention
        return out, lse, KernelState(self.name, (rng, unused), tuple(lse.shape))

    def backward(
        self,
        dout,
        q,
        k,
        v,
        out,
        lse: Tensor,
        state: KernelState,
        params,
        packed: Optional[Packed] = None,
    ):
        return self.aten._flash_attention_backward(
            *(_last_dim_contiguous(x) for x in (dout, q, k, v, out)),
            inf_where_no_key(lse.reshape(state.lse_shape)).contiguous(),
            *_lengths(q, k, packed),
            params.dropout_p,
            params.causal,
            *state.values,
            **_flash_keywords(params),
        )


def _lengths(q: Tensor, k: Tensor, packed: Optional[Packed]) -> tuple:
    """``(cum_seq_q, cum_seq_k, max_q, max_k)`` of the flash kernel: None and the dense lengths
    for ``[b, s, h, d]``."""
    return packed or (None, None, q.shape[1], k.shape[1])


def _flash_keywords(params: AttentionParams) -> dict:
    """The scale and flash-attn's ``window_size_left/right`` for the band (None = unbounded)."""
    lo, hi = params.window or (None, None)
    return dict(
        scale=params.softmax_scale,
        window_size_left=None if lo is None else -lo,
        window_size_right=hi,
    )


class CudnnKernel:
    """cuDNN's fused attention on ``[b, h, s, d]`` views of ``[b, s, h, d]``.

    ``aten._scaled_dot_product_cudnn_attention`` and its backward. Its causal mask is aligned
    top-left, so a causal call uses it only when sq == sk; no windows; at least two queries and
    two keys; dropout in multiples of 1/16 (none on cuDNN 9.11-9.13); head_dim a multiple of 8
    up to 128.
    """

    name = "cudnn"

    def __init__(self, aten):
        self.aten = aten

    def misfit(
        self, q: Tensor, k: Tensor, params: AttentionParams, device: CudaDevice
    ) -> Optional[str]:
        if device.cudnn_version < 90000 or not (8, 0) <= device.capability <= (12, 1):
            return f"{device} (torch's cuDNN attention needs cuDNN 9 on sm80-sm121)"
        if params.window is not None:
            return "a sliding window (cuDNN attention in torch takes none)"
        if params.causal and q.shape[1] != k.shape[1]:
            return "causal with sq != sk (cuDNN aligns causal top-left)"
        if params.dropout_p * 16 != int(params.dropout_p * 16):
            return f"dropout_p={params.dropout_p} (cuDNN takes multiples of 1/16)"
        if 1 in (q.shape[1], k.shape[1]):
            return "one query or one key (cuDNN attention takes at least two of each)"
        if max(q.shape[0], q.shape[2]) > 65535:
            return "a batch or head count above 65535 (cuDNN's limit)"
        if params.dropout_p > 0 and 91100 < device.cudnn_version < 91400:
            return f"dropout on cuDNN {device.cudnn_version} (cuDNN 9.11-9.13 attention has none)"
        return _shape_misfit(q, k, params, 128, "cuDNN attention")

    def forward(self, q, k, v, params: AttentionParams):
        b, sq, h, _ = q.shape
        out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = (
            self.aten._scaled_dot_product_cudnn_attention(
                *(_last_dim_contiguous(x).transpose(1, 2) for x in (q, k, v)),
                None,
                True,
                params.dropout_p,
                params.causal,
                False,
                scale=params.softmax_scale,
            )
        )
        state = KernelState(self.name, (cu_q, cu_k, max_q, max_k, seed, offset), tuple(lse.shape))
        return out.transpose(1, 2), lse.reshape(b, h, sq), state

    def backward(self, dout, q, k, v, out, lse: Tensor, state: KernelState, params):
        cu_q, cu_k, max_q, max_k, seed, offset = state.values
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        # out and its gradient in the layout forward gave out (q's): older torch caches the
        # backward graph by q/k/v strides alone, so other strides for them would reuse a stale one
        out, dout = _in_layout_of(q, out), _in_layout_of(q, dout)
        dq, dk, dv = self.aten._scaled_dot_product_cudnn_attention_backward(
            *(x.transpose(1, 2) for x in (dout, q, k, v, out)),
            lse.contiguous().reshape(state.lse_shape),
            seed,
            offset,
            None,
            cu_q,
            cu_k,
            max_q,
            max_k,
            params.dropout_p,
            params.causal,
            scale=params.softmax_scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    """The kernels need a unit stride on head_dim (any other strides are fine)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _in_layout_of(reference: Tensor, x: Tensor) -> Tensor:
    """``x`` with its dims in memory in ``reference``'s order (a copy only when they are not)."""
    order = sorted(range(x.dim()), key=lambda dim: -reference.stride(dim))
    permuted = x.permute(order)
    if permuted.is_contiguous():
        return x
    inverse = sorted(range(x.dim()), key=order.__getitem__)
    return permuted.contiguous().permute(inverse)


class CudaBackend(AttentionBackend):
    """torch's cuDNN and FlashAttention-2 kernels on NVIDIA GPUs.

    ``aten`` (default ``torch.ops.aten``) holds the four kernel ops and ``device_info``
    (default :func:`query_device` of the tensors' device) describes the GPU: tests pass a
    double of each.

    What neither kernel takes runs the reference kernel on the GPU (logged once per reason):
    fp32, an explicit mask, a window that excludes the diagonal, softcap, ALiBi (torch's flash
    backward has no slopes), ``deterministic=True`` (both backward kernels accumulate with
    atomics), empty sequences.
    """

    name = "cuda"

    def __init__(
        self,
        aten=None,
        device_info: Optional[Callable[[Tensor], CudaDevice]] = None,
        preference=None,
    ):
        aten = torch.ops.aten if aten is None else aten
        self.kernels = {kernel.name: kernel for kernel in (CudnnKernel(aten), FlashKernel(aten))}
        self.device_info = device_info or _device_of
        self.preference = preference
        self.fallback = ReferenceBackend()

    def unavailable_reason(self) -> str:
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        return ""

    def kernel_order(self, device: CudaDevice) -> tuple[str, ...]:
        """The kernels to try, best first, for ``preference`` (or ``$MCORE_FLASH_CUDA_KERNEL``)."""
        preference = self.preference or os.environ.get(ENV_VAR) or "auto"
        if preference not in PREFERENCES:
            raise ValueError(
                f"{ENV_VAR}={preference!r} is not a kernel; choose one of {PREFERENCES}"
            )
        if preference == "flash" or (preference == "auto" and not device.prefers_cudnn()):
            return ("flash",)
        return ("cudnn", "flash")

    def choose_kernel(self, q: Tensor, k: Tensor, params: AttentionParams) -> Optional[str]:
        """The kernel that runs this call (None: the reference kernel), from the arguments alone.

        The first of :meth:`kernel_order` whose ``misfit`` is None; each choice is logged once.
        By default that is cuDNN where torch's own SDPA prefers it -- sm90/sm100/sm103 (any
        sm9x/sm10x on CUDA 13 builds) with a cuDNN newer than 9.15, unless
        ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set (``check_prefer_cudnn_attention`` in torch's
        ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``; :meth:`CudaDevice.prefers_cudnn`)
        -- and the call fits it, otherwise flash. The measurement behind that order (cuDNN
        well ahead of torch's flash kernel on an H200, issue 16) is in ``docs/benchmarks.md``,
        "Attention kernels (GPU)"; ``mcore-flash bench-cuda`` measures both on the machine at
        hand.
        """
        device = self.device_info(q)
        misfits = []
        for name in self.kernel_order(device):
            misfit = self.kernels[name].misfit(q, k, params, device)
            if misfit is None:
                self._log_once(
                    f"mcore_flash: cuda backend runs the {name} kernel ({device})"
                    + _because(misfits)
                )
                return name
            misfits.append(f"{name}: {misfit}")
        self._falls_back("; ".join(misfits))
        return None

    def _log_once(self, message: str) -> None:
        logged = self.__dict__.setdefault("_logged_choices", set())
        if message not in logged:
            logged.add(message)
            logger.info(message)

    def forward(self, q, k, v, params):
        kernel = self.choose_kernel(q, k, params)
        if kernel is None:
            return self.fallback.forward(q, k, v, params)
        out, lse, state = self.kernels[kernel].forward(q, k, v, params)
        return out, SoftmaxStats(lse), state

    def backward(self, dout, q, k, v, out, stats, rng_state, params):
        if not isinstance(rng_state, KernelState):
            return self.fallback.backward(dout, q, k, v, out, stats, rng_state, params)
        return self.kernels[rng_state.kernel].backward(
            dout, q, k, v, out, stats.lse(), rng_state, params
        )

    # Packed sequences: the flash kernel takes them in one call; anything else loops over the
    # sequences (the base class), each choosing its own kernel.

    def varlen_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, params):
        flash = self.kernels["flash"]
        lengths = list(zip(_lengths_of(cu_seqlens_q), _lengths_of(cu_seqlens_k)))
        if (
            0 in sum(lengths, ())
            or flash.misfit(q, k, params, self.device_info(q), lengths) is not None
        ):
            return super().varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, params)
        packed = _packed(cu_seqlens_q, cu_seqlens_k, q.device)
        out, lse, state = flash.forward(q, k, v, params, packed)
        return out, SoftmaxStats(lse.unsqueeze(0)), state

    def varlen_backward(
        self, dout, q, k, v, out, stats, rng_state, cu_seqlens_q, cu_seqlens_k, params
    ):
        if not isinstance(rng_state, KernelState):
            return super().varlen_backward(
                dout, q, k, v, out, stats, rng_state, cu_seqlens_q, cu_seqlens_k, params
            )
        packed = _packed(cu_seqlens_q, cu_seqlens_k, q.device)
        return self.kernels["flash"].backward(
            dout, q, k, v, out, stats.lse()[0], rng_state, params, packed
        )


def _lengths_of(cu_seqlens: list[int]) -> list[int]:
    return [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]


def _packed(cu_seqlens_q: list[int], cu_seqlens_k: list[int], device) -> Packed:
    def tensor(cu):
        return torch.tensor(cu, dtype=torch.int32, device=device)

    return Packed(
        tensor(cu_seqlens_q),
        tensor(cu_seqlens_k),
        max(_lengths_of(cu_seqlens_q)),
        max(_lengths_of(cu_seqlens_k)),
    )


def _because(misfits: list[str]) -> str:
    return f", not {'; '.join(misfits)}" if misfits else ""
