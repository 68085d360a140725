"""Argument validation for the public attention API: every error names the argument and the fix."""

from __future__ import annotations

import math
from typing import Optional

import torch

Tensor = torch.Tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_layout(layout, layouts: tuple[str, ...]) -> None:
    if layout not in layouts:
        raise ValueError(f"layout={layout!r} is not supported; choose one of {layouts}")


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, packed: bool, layout: str = "bshd") -> None:
    """Check types, ranks, dtypes and head counts of q, k, v.

    Dense (``packed=False``): q ``[b, sq, hq, d]``, k/v ``[b, sk, hkv, d]`` (``layout="sbhd"``:
    ``[sq, b, hq, d]``, ``[sk, b, hkv, d]``).
    Packed (``packed=True``): q ``[total_q, hq, d]``, k/v ``[total_k, hkv, d]``.
    """
    names = {"b": "batch", "s": "seqlen", "h": "heads", "d": "head_dim"}
    shape = (
        "[total, heads, head_dim]" if packed else "[" + ", ".join(names[c] for c in layout) + "]"
    )
    rank = 3 if packed else 4
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != rank:
            raise ValueError(f"{name} must have {rank} dims {shape}, got shape {tuple(x.shape)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"{name} has dtype {x.dtype}; use float16, bfloat16, float32 or float64"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    batch = layout.index("b")
    if not packed and q.shape[batch] != k.shape[batch]:
        raise ValueError(
            f"q and k must have the same batch size, got {q.shape[batch]} and {k.shape[batch]}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head_dim of q ({q.shape[-1]}) and k ({k.shape[-1]}) must match")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"number of query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA/MQA; "
            "choose num_query_groups that divides num_attention_heads"
        )


def resolve_scale(softmax_scale: Optional[float], head_dim: int) -> float:
    """``softmax_scale`` or the default ``1 / sqrt(head_dim)``."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if (
        not isinstance(softmax_scale, (int, float))
        or not math.isfinite(softmax_scale)
        or softmax_scale <= 0
    ):
        raise ValueError(
            f"softmax_scale must be a positive finite number or None, got {softmax_scale!r}"
        )
    return float(softmax_scale)


def check_dropout(dropout_p: float) -> float:
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def check_window_size(window_size) -> tuple[int, int]:
    """flash-attn's ``window_size=(left, right)``: two ints, each -1 (unbounded) or >= 0."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    ok = ok and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    if not ok:
        raise ValueError(
            f"window_size must be (left, right), two ints each -1 (unbounded) or >= 0, got {window_size!r}; "
            "e.g. window_size=(4095, 0) with causal=True for a 4096-token sliding window"
        )
    return int(window_size[0]), int(window_size[1])


def check_softcap(softcap) -> float:
    if (
        not isinstance(softcap, (int, float))
        or isinstance(softcap, bool)
        or not math.isfinite(softcap)
        or softcap < 0
    ):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    return float(softcap)


def check_alibi_slopes(
    slopes: Optional[Tensor], q: Tensor, batch: Optional[int]
) -> Optional[Tensor]:
    """ALiBi slopes: float32 ``[hq]`` or ``[batch, hq]`` on q's device (flash-attn's rule)."""
    if slopes is None:
        return None
    hq = q.shape[-2]
    shapes = [(hq,)] + ([(batch, hq)] if batch is not None else [])
    if (
        not isinstance(slopes, torch.Tensor)
        or slopes.dtype != torch.float32
        or tuple(slopes.shape) not in shapes
    ):
        got = (
            (slopes.dtype, tuple(slopes.shape))
            if isinstance(slopes, torch.Tensor)
            else type(slopes).__name__
        )
        raise ValueError(
            f"alibi_slopes must be a float32 tensor shaped {' or '.join(map(str, shapes))}, got {got}"
        )
    if slopes.device != q.device:
        raise ValueError(
            f"alibi_slopes is on {slopes.device} but q is on {q.device}; move it with .to(q.device)"
        )
    return slopes


def check_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_attn_mask(mask: Optional[Tensor], b: int, hq: int, sq: int, sk: int) -> None:
    """``attn_mask`` must be bool (True = masked out) with dims each 1 or ``[b, hq, sq, sk]``."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        kind = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"attn_mask must be a bool tensor (True = masked out), got {kind}")
    full = (b, hq, sq, sk)
    if (
        mask.dim() != 4
        or mask.shape[2:] != (sq, sk)
        or any(m not in (1, f) for m, f in zip(mask.shape[:2], full[:2]))
    ):
        raise ValueError(
            f"attn_mask shape {tuple(mask.shape)} is not supported: use [b|1, heads|1, sq, sk] = "
            f"[{b}|1, {hq}|1, {sq}, {sk}]"
        )


def check_cu_seqlens(cu_seqlens: Tensor, total: int, max_seqlen: int, name: str) -> list[int]:
    """Validate cumulative sequence lengths and return them as a Python list."""
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.dtype
        not in (
            torch.int32,
            torch.int64,
        )
    ):
        raise TypeError(
            f"{name} must be a 1-D int32/int64 tensor of cumulative lengths starting at 0"
        )
    values = [int(x) for x in cu_seqlens.tolist()]
    if len(values) < 2 or values[0] != 0:
        raise ValueError(f"{name} must start at 0 and hold at least one sequence, got {values[:8]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing (cumulative lengths), got {values[:8]}...")
    if values[-1] != total:
        raise ValueError(f"{name}[-1] = {values[-1]} must equal the packed length {total}")
    if max(lengths) > max_seqlen:
        raise ValueError(
            f"max_seqlen for {name} is {max_seqlen} but a sequence has {max(lengths)} tokens"
        )
    return values
