"""A CPU test double of the four torch kernels the ``cuda`` backend calls.

Each call is first run through torch's own meta kernel for that op, with the same arguments
on meta tensors of the same shapes and strides: a wrong argument count, name or shape fails
there as it would on a GPU, and the double's results must have the shapes the meta kernel
gives. Then the call is computed in float64 on the CPU with the kernel's semantics, which
differ from this project's convention where the kernels do:

* flash (``aten._flash_attention_forward`` / ``_backward``): ``[b, s, h, d]``, or packed
  ``[t, h, d]`` with int32 cumulative lengths on the tensors' device; causal aligned
  bottom-right; ``window_size_left/right`` None or negative = unbounded; lse ``[b, h, sq]``
  (packed: ``[h, t]``) with **+inf** on rows that see no key, whose output is 0.
* cudnn (``aten._scaled_dot_product_cudnn_attention`` / ``_backward``): ``[b, h, s, d]``;
  causal aligned **top-left**; lse ``[b, h, sq, 1]``.

GQA: query head h reads key/value head ``h // (hq // hkv)``; the double records the K shape
of every call. Dropout keeps each probability with ``1 - p``, drawn from a generator whose
seed travels in the kernel's RNG-state tensors: backward redraws the same mask only if the
backend hands that state back. Backward uses the ``out`` and ``logsumexp`` it is given
(FlashAttention-2's formulas: ``dS = P * (dP - rowsum(dO * O))``), so stale or -inf
statistics show up as wrong or NaN gradients.
"""

from __future__ import annotations

import functools
import itertools
from typing import Optional

import torch

Tensor = torch.Tensor
aten = torch.ops.aten


def _meta(x):
    if isinstance(x, Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _check_with_meta(op, args, kwargs, results) -> None:
    """Run ``op`` on meta copies of the arguments; the double's results must match its shapes."""
    expected = op(*map(_meta, args), **{k: _meta(v) for k, v in kwargs.items()})
    for got, want in zip(results, expected):
        if isinstance(want, Tensor) and isinstance(got, Tensor):
            assert got.shape == want.shape and got.dtype == want.dtype, (
                op,
                got.shape,
                want.shape,
                got.dtype,
                want.dtype,
            )


def _checked_by_meta(op):
    """Decorator for the double of ``op`` (a method of :class:`AtenDouble`): after the double
    computes, :func:`_check_with_meta` runs ``op``'s meta kernel on the same call's arguments,
    positional and keyword, as the backend passed them."""

    def decorate(double):
        @functools.wraps(double)
        def checked(self, *args, **kw):
            results = double(self, *args, **kw)
            _check_with_meta(op, args, kw, results)
            return results

        return checked

    return decorate


def _flash_allowed(sq: int, sk: int, causal: bool, left, right, max_k: int) -> Tensor:
    """FlashAttention-2's mask as torch's ``mha_fwd``/``mha_bwd`` and ``set_params_fprop`` set it
    up: causal makes the right side 0; a side >= max_k (the longest key sequence) is dropped;
    with one side left, the other becomes max_k; then ``i + sk - sq - left <= j <= i + sk - sq +
    right`` (bottom-right), unless both sides are unbounded."""
    left = -1 if left is None else left
    right = 0 if causal else (-1 if right is None else right)
    left, right = (-1 if x >= max_k else x for x in (left, right))
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left < 0 and right < 0:
        return allowed
    offset = torch.arange(sk).view(1, sk) - torch.arange(sq).view(sq, 1) - (sk - sq)
    return allowed & (offset >= -left) & (offset <= right)


def _top_left_allowed(sq: int, sk: int, causal: bool) -> Tensor:
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    return allowed.tril() if causal else allowed


def _expand(x: Tensor, heads: int) -> Tensor:
    """``[b, hkv, s, d]`` -> ``[b, heads, s, d]`` (the double may expand; the backend may not)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _scores(q, k, allowed, scale):
    s = (q @ _expand(k, q.shape[1]).transpose(-1, -2)) * scale
    return s.masked_fill(~allowed, float("-inf"))


def _forward(q, k, v, allowed, scale, keep):
    """float64 ``[b, h, s, d]`` math: ``(out, lse)`` with +inf on rows without keys."""
    s = _scores(q, k, allowed, scale)
    lse = torch.logsumexp(s, dim=-1)
    lse = torch.where(torch.isneginf(lse), float("inf"), lse)
    p = torch.exp(s - lse[..., None])
    out = (p * keep) @ _expand(v, q.shape[1])
    return out, lse


def _group_sum(grad: Tensor, hkv: int) -> Tensor:
    b, h, s, d = grad.shape
    return grad.view(b, hkv, h // hkv, s, d).sum(dim=2)


def _backward(dout, q, k, v, out, lse, allowed, scale, keep):
    p = torch.exp(_scores(q, k, allowed, scale) - lse[..., None])
    dv = _group_sum((p * keep).transpose(-1, -2) @ dout, k.shape[1])
    dp = (dout @ _expand(v, q.shape[1]).transpose(-1, -2)) * keep
    ds = p * (dp - (dout * out).sum(dim=-1, keepdim=True))
    dq = ds @ _expand(k, q.shape[1]) * scale
    dk = _group_sum(ds.transpose(-1, -2) @ q, k.shape[1]) * scale
    return dq, dk, dv


def _f64(*xs):
    return [x.double() for x in xs]


class AtenDouble:
    """Stands in for ``torch.ops.aten`` in :class:`mcore_flash.ops.backends.cuda.CudaBackend`."""

    def __init__(self):
        self.calls: list[tuple[str, tuple[int, ...]]] = []  # (op, key shape as passed)
        self.masks: dict[
            int, list[Tensor]
        ] = {}  # seed -> a keep mask per sequence (scaled by 1 / (1 - p))
        self._seeds = itertools.count(1)

    def last_keep_mask(self) -> Tensor:
        """Bool ``[b, h, sq, sk]``, True = kept: the dropout of the latest dense forward."""
        return self.masks[max(self.masks)][0] > 0

    def _new_seed(self) -> int:
        seed = next(self._seeds)
        self.masks[seed] = []
        return seed

    def _draw(self, seed: int, shape, dropout_p: float) -> Tensor:
        keep = torch.ones(shape, dtype=torch.float64)
        if dropout_p > 0:
            g = torch.Generator().manual_seed(seed * 1000 + len(self.masks[seed]))
            keep = (torch.rand(shape, generator=g) >= dropout_p).double() / (1 - dropout_p)
        self.masks[seed].append(keep)
        return keep

    # ---- flash -------------------------------------------------------------------------
    @_checked_by_meta(aten._flash_attention_forward)
    def _flash_attention_forward(
        self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, **kw
    ):
        self.calls.append(("flash_forward", tuple(k.shape)))
        assert not return_debug_mask
        seed = self._new_seed()
        outs, lses = [], []
        for qs, ks in _segments(q, cu_q, cu_k, max_q, max_k, k):
            q4 = _take(q, qs)
            k4, v4 = (_take(x, ks) for x in (k, v))
            b, h, sq, sk = q4.shape[0], q4.shape[1], q4.shape[2], k4.shape[2]
            allowed = _flash_allowed(
                sq, sk, is_causal, kw.get("window_size_left"), kw.get("window_size_right"), max_k
            )
            out, lse = _forward(
                q4, k4, v4, allowed, kw["scale"], self._draw(seed, (b, h, sq, sk), dropout_p)
            )
            outs.append(out.transpose(1, 2))
            lses.append(lse)
        if cu_q is None:
            out, lse = outs[0], lses[0]
        else:
            out, lse = torch.cat([o[0] for o in outs]), torch.cat([x[0] for x in lses], dim=-1)
        rng = torch.tensor([seed, 0], dtype=torch.uint64)
        return (
            torch.empty_like(q).copy_(out),
            lse.float(),
            rng,
            torch.empty((), dtype=torch.uint64),
            torch.empty(0, dtype=q.dtype),
        )

    @_checked_by_meta(aten._flash_attention_backward)
    def _flash_attention_backward(
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        rng,
        unused,
        **kw,
    ):
        self.calls.append(("flash_backward", tuple(k.shape)))
        keeps = self.masks[int(rng[0].item())]
        grads = [torch.zeros_like(x, dtype=torch.float64) for x in (q, k, v)]
        for (qs, ks), keep in zip(_segments(q, cu_q, cu_k, max_q, max_k, k), keeps):
            do4, q4, o4 = (_take(x, qs) for x in (dout, q, out))
            k4, v4 = (_take(x, ks) for x in (k, v))
            lse4 = lse.double() if qs is None else lse[:, qs].double().unsqueeze(0)
            left, right = kw.get("window_size_left"), kw.get("window_size_right")
            allowed = _flash_allowed(q4.shape[2], k4.shape[2], is_causal, left, right, max_k)
            dq4, dk4, dv4 = _backward(do4, q4, k4, v4, o4, lse4, allowed, kw["scale"], keep)
            for acc, rows, grad in zip(grads, (qs, ks, ks), (dq4, dk4, dv4)):
                _put(acc, rows, grad)
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))

    # ---- cudnn -------------------------------------------------------------------------
    @_checked_by_meta(aten._scaled_dot_product_cudnn_attention)
    def _scaled_dot_product_cudnn_attention(
        self, q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, **kw
    ):
        self.calls.append(("cudnn_forward", tuple(k.shape)))
        assert attn_bias is None and compute_log_sumexp and not return_debug_mask
        seed = self._new_seed()
        keep = self._draw(seed, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), dropout_p)
        out, lse = _forward(
            *_f64(q, k, v), _top_left_allowed(q.shape[2], k.shape[2], is_causal), kw["scale"], keep
        )
        seed_t, offset_t = torch.tensor(seed), torch.tensor(0)
        return (
            torch.empty_like(q).copy_(out),
            lse.float().unsqueeze(-1),
            None,
            None,
            q.shape[2],
            k.shape[2],
            seed_t,
            offset_t,
            None,
        )

    @_checked_by_meta(aten._scaled_dot_product_cudnn_attention_backward)
    def _scaled_dot_product_cudnn_attention_backward(
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        seed,
        offset,
        attn_bias,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        **kw,
    ):
        self.calls.append(("cudnn_backward", tuple(k.shape)))
        assert dout.stride() == out.stride() == torch.empty_like(q).stride(), (
            "out / dout not in q's layout (graph cache)"
        )
        assert lse.shape == (q.shape[0], q.shape[1], q.shape[2], 1), lse.shape
        allowed = _top_left_allowed(q.shape[2], k.shape[2], is_causal)
        keep = self.masks[int(seed)][0]
        grads = _backward(
            *_f64(dout, q, k, v, out), lse[..., 0].double(), allowed, kw["scale"], keep
        )
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


def _take(x: Tensor, rows: Optional[slice]) -> Tensor:
    """float64 ``[b, h, s, d]`` of a dense ``[b, s, h, d]`` (rows None) or of packed rows."""
    x = x if rows is None else x[rows].unsqueeze(0)
    return x.double().transpose(1, 2)


def _put(acc: Tensor, rows: Optional[slice], grad: Tensor) -> None:
    """Write a ``[b, h, s, d]`` gradient back in the kernel's layout."""
    grad = grad.transpose(1, 2)
    if rows is None:
        acc.copy_(grad)
    else:
        acc[rows] = grad[0]


def _segments(q, cu_q, cu_k, max_q, max_k, k) -> list[tuple[Optional[slice], Optional[slice]]]:
    """(query rows, key rows) of each sequence: ``[(None, None)]`` for a dense batch."""
    if cu_q is None:
        assert (max_q, max_k) == (q.shape[1], k.shape[1])
        return [(None, None)]
    for cu in (cu_q, cu_k):
        assert cu.dtype == torch.int32 and cu.device == q.device, (cu.dtype, cu.device)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    assert max_q == max(b - a for a, b in zip(starts_q, starts_q[1:]))
    assert max_k == max(b - a for a, b in zip(starts_k, starts_k[1:]))
    return [
        (slice(*starts_q[i : i + 2]), slice(*starts_k[i : i + 2])) for i in range(len(starts_q) - 1)
    ]
