"""A float64 naive attention oracle, written independently of ``mcore_flash.ops``.

Everything is materialised: the full ``[b, h, sq, sk]`` score matrix, an explicit
bottom-right causal mask, the bool mask, GQA by repeating K/V heads. Rows that see no key
give ``out = 0`` and ``lse = -inf`` and receive zero gradients. Gradients come from
float64 autograd through this function.

Layout (flash-attn): q ``[b, sq, hq, d]``, k/v ``[b, sk, hkv, d]``; lse ``[b, hq, sq]``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

# The project's bf16 tolerances: a bf16 computation against its fp32/float64 counterpart
# (outputs, gradients), rounding once per kernel with fp32 accumulation.
BF16_OUT = dict(atol=1.5e-2, rtol=1.5e-2)
BF16_GRAD = dict(atol=3e-2, rtol=3e-2)


def visible(
    sq: int,
    sk: int,
    causal: bool,
    attn_mask: Optional[torch.Tensor] = None,
    window: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """Bool ``[.., sq, sk]``: True where query i may attend to key j.

    Bottom-right causal: key j visible to query i iff ``j - i <= sk - sq``.
    ``window = (left, right)`` (flash-attn's, -1 = unbounded): ``i + sk - sq - left <= j <=
    i + sk - sq + right``. ``attn_mask`` is True = masked out (broadcast against ``[b, h, sq, sk]``).
    """
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed = (j - i) <= (sk - sq)
    left, right = window
    if left >= 0:
        allowed = allowed & (j >= i + sk - sq - left)
    if right >= 0:
        allowed = allowed & (j <= i + sk - sq + right)
    allowed = allowed.view(1, 1, sq, sk)
    if attn_mask is not None:
        allowed = allowed & ~attn_mask.to(torch.bool)
    return allowed


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    attn_mask: Optional[torch.Tensor] = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out [b, sq, hq, d], lse [b, hq, sq])`` in ``dtype``; differentiable.

    ``softcap``: scores ``c * tanh(s / c)``; ``alibi_slopes`` (``[hq]`` or ``[b, hq]``): plus
    ``-slope * |i + sk - sq - j|``; ``dropout_mask`` (bool ``[b, hq, sq, sk]``, True = kept):
    kept probabilities scaled by ``1 / (1 - dropout_p)`` (lse is that of the undropped softmax).
    ``dtype=q.dtype`` gives flash-attn's same-precision "PyTorch" reference, float64 the oracle.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    assert hq % hkv == 0
    groups = hq // hkv
    # GQA/MQA: query head h uses key/value head h // groups.
    k_full = k.repeat_interleave(groups, dim=2)
    v_full = v.repeat_interleave(groups, dim=2)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale

    scores = torch.einsum("bihd,bjhd->bhij", q * scale, k_full)  # [b, hq, sq, sk]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        slopes = alibi_slopes.view(-1, hq, 1, 1).to(dtype)
        i = torch.arange(sq).view(sq, 1)
        j = torch.arange(sk).view(1, sk)
        scores = scores - slopes * (i + sk - sq - j).abs().to(dtype)
    allowed = visible(sq, sk, causal, attn_mask, window).expand(b, hq, sq, sk)
    neg_inf = torch.tensor(float("-inf"), dtype=dtype)
    scores = torch.where(allowed, scores, neg_inf)

    has_key = allowed.any(dim=-1, keepdim=True)  # [b, hq, sq, 1]
    # rows that see no key get 0 scores (so no NaN reaches autograd) and probability 0
    scores = torch.where(has_key, scores, torch.zeros((), dtype=dtype))
    zero = torch.zeros((), dtype=dtype)
    probs = torch.where(has_key, torch.softmax(scores, dim=-1), zero)
    if dropout_mask is not None:
        probs = torch.where(dropout_mask, probs / (1.0 - dropout_p), zero)
    out = torch.einsum("bhij,bjhd->bihd", probs, v_full)
    lse = torch.where(has_key[..., 0], torch.logsumexp(scores, dim=-1), neg_inf)
    return out, lse


def probabilities(q: torch.Tensor, k: torch.Tensor, **kwargs) -> torch.Tensor:
    """Float64 ``[b, hq, sq, sk]`` attention probabilities (0 where hidden): the output for
    ``v`` = the identity over the keys."""
    b, sk, hkv, _ = k.shape
    eye = torch.eye(sk, dtype=torch.float64).view(1, sk, 1, sk).expand(b, sk, hkv, sk)
    out, _ = attention(q, k, eye, **kwargs)  # [b, sq, hq, sk]
    return out.permute(0, 2, 1, 3)


def attention_with_grads(q, k, v, dout, dtype: torch.dtype = torch.float64, **kwargs):
    """``(out, lse, dq, dk, dv)`` in ``dtype`` (float64: the oracle) for the upstream gradient ``dout``."""
    q64, k64, v64 = (x.detach().to(dtype).requires_grad_(True) for x in (q, k, v))
    out, lse = attention(q64, k64, v64, dtype=dtype, **kwargs)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.to(dtype))
    return out.detach(), lse.detach(), dq, dk, dv


def varlen_attention_with_grads(q, k, v, dout, cu_q, cu_k, **kwargs):
    """Packed ``[total, h, d]``: each sequence through :func:`attention_with_grads` alone.

    Returns ``(out [tq, hq, d], lse [hq, tq], dq, dk, dv)``.
    """
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    for (q0, q1), (k0, k1) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
        o, lse, dq, dk, dv = attention_with_grads(
            q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], dout[q0:q1][None], **kwargs
        )
        outs.append(o[0])
        lses.append(lse[0])
        dqs.append(dq[0])
        dks.append(dk[0])
        dvs.append(dv[0])
    return torch.cat(outs), torch.cat(lses, dim=-1), torch.cat(dqs), torch.cat(dks), torch.cat(dvs)
