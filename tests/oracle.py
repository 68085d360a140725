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


def visible(sq: int, sk: int, causal: bool, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bool ``[.., sq, sk]``: True where query i may attend to key j.

    Bottom-right causal: key j visible to query i iff ``j - i <= sk - sq``.
    ``attn_mask`` is True = masked out (broadcast against ``[b, h, sq, sk]``).
    """
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed = (j - i) <= (sk - sq)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out [b, sq, hq, d] float64, lse [b, hq, sq] float64)``; differentiable."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    assert hq % hkv == 0
    groups = hq // hkv
    # GQA/MQA: query head h uses key/value head h // groups.
    k_full = k.repeat_interleave(groups, dim=2)
    v_full = v.repeat_interleave(groups, dim=2)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale

    scores = torch.einsum("bihd,bjhd->bhij", q, k_full) * scale  # [b, hq, sq, sk]
    allowed = visible(sq, sk, causal, attn_mask).expand(b, hq, sq, sk)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64)
    scores = torch.where(allowed, scores, neg_inf)

    has_key = allowed.any(dim=-1)  # [b, hq, sq]
    zero = torch.zeros((), dtype=torch.float64)
    raw_max = scores.amax(dim=-1) if sk > 0 else torch.zeros(b, hq, sq, dtype=torch.float64)
    row_max = torch.where(has_key, raw_max, zero).detach()
    expd = torch.exp(scores - row_max.unsqueeze(-1))  # exactly 0 where masked
    denom = expd.sum(dim=-1)
    probs = expd / torch.where(has_key, denom, torch.ones((), dtype=torch.float64)).unsqueeze(-1)
    out = torch.einsum("bhij,bjhd->bihd", probs, v_full)
    lse = torch.where(has_key, row_max + torch.log(torch.where(has_key, denom, 1.0)), neg_inf)
    return out, lse


def attention_with_grads(q, k, v, dout, **kwargs):
    """Float64 ``(out, lse, dq, dk, dv)`` for the given upstream gradient ``dout``."""
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    out, lse = attention(q64, k64, v64, **kwargs)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), lse.detach(), dq, dk, dv


def varlen_attention_with_grads(q, k, v, dout, cu_q, cu_k, **kwargs):
    """Packed ``[total, h, d]``: each sequence through :func:`attention_with_grads` alone.

    Returns ``(out [tq, hq, d], lse [hq, tq], dq, dk, dv)``.
    """
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    for (q0, q1), (k0, k1) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
        o, l, dq, dk, dv = attention_with_grads(
            q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], dout[q0:q1][None], **kwargs
        )
        outs.append(o[0])
        lses.append(l[0])
        dqs.append(dq[0])
        dks.append(dk[0])
        dvs.append(dv[0])
    return torch.cat(outs), torch.cat(lses, dim=-1), torch.cat(dqs), torch.cat(dks), torch.cat(dvs)
