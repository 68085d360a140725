"""Pure-PyTorch FlashAttention-2: the readable specification and the oracle for the others.

Forward walks the keys block by block with an online softmax (running row max ``m`` and
row sum ``l``), so no ``[sq, sk]`` matrix ever exists in full; it keeps ``out`` and
``lse = m + log(l)``. Backward recomputes each block's probabilities from ``lse`` and uses
``D = rowsum(dout * out)`` (Dao 2023, Algorithm 2). Dropout masks are drawn per block from
a seed taken from the device's default generator, so backward replays them exactly and
``torch.manual_seed`` (or Megatron's RNG tracker) makes runs reproducible.

Causal attention and sliding windows are bands of visible keys (``AttentionParams.band``):
key blocks outside the band of every row of a query block are never visited. ``softcap``
and ALiBi are applied to each block's scores, and backward multiplies by the cap's slope
``1 - tanh^2``. Runs on any device; fp16/bf16 inputs are computed in fp32, fp64 in fp64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .base import (
    AttentionBackend,
    AttentionParams,
    SoftmaxStats,
    Tensor,
    alibi_bias,
    band_crosses,
    band_mask,
    band_rows,
    inf_where_no_key,
)


@dataclass(frozen=True)
class DropoutState:
    """What backward needs to redraw forward's dropout masks."""

    seed: int
    block_q: int
    block_k: int


class ReferenceBackend(AttentionBackend):
    """Blockwise online-softmax attention written with plain tensor ops."""

    name = "reference"

    def __init__(self, block_q: int = 256, block_k: int = 512):
        if block_q < 1 or block_k < 1:
            raise ValueError(
                f"block sizes must be positive, got block_q={block_q}, block_k={block_k}"
            )
        self.block_q = block_q
        self.block_k = block_k

    def forward(self, q, k, v, params):
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        compute_dtype = _compute_dtype(q.dtype)
        qg, kg, vg = (
            _grouped(q, hkv, compute_dtype),
            _grouped(k, hkv, compute_dtype),
            _grouped(v, hkv, compute_dtype),
        )
        mask = _grouped_mask(params.attn_mask, hkv, hq // hkv)
        state = (
            _new_dropout_state(q.device, self.block_q, self.block_k)
            if params.dropout_p > 0
            else None
        )

        out = torch.zeros(qg.shape[:-1] + (v.shape[-1],), dtype=compute_dtype, device=q.device)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for (q0, q1), kv_blocks in _block_plan(sq, sk, params, self.block_q, self.block_k):
            q_blk = qg[..., q0:q1, :]
            row_max = torch.full(
                q_blk.shape[:-1], float("-inf"), dtype=compute_dtype, device=q.device
            )
            row_sum = torch.zeros_like(row_max)
            acc = torch.zeros(
                q_blk.shape[:-1] + (v.shape[-1],), dtype=compute_dtype, device=q.device
            )
            for k0, k1 in kv_blocks:
                scores, _ = _masked_scores(
                    q_blk, kg[..., k0:k1, :], params, mask, (q0, q1), (k0, k1), sq, sk
                )
                new_max = torch.maximum(row_max, scores.amax(dim=-1))
                safe_max = _finite_or_zero(new_max)
                probs = torch.exp(scores - safe_max.unsqueeze(-1))
                rescale = torch.exp(row_max - safe_max)
                row_sum = row_sum * rescale + probs.sum(dim=-1)
                keep = _dropout_keep(probs, params.dropout_p, state, q0, k0)
                if keep is not None:
                    probs = probs * keep
                acc = acc * rescale.unsqueeze(-1) + probs @ vg[..., k0:k1, :]
                row_max = new_max
            empty = row_sum == 0
            out[..., q0:q1, :] = acc / torch.where(empty, 1.0, row_sum).unsqueeze(-1)
            lse[..., q0:q1] = torch.where(
                empty,
                float("-inf"),
                _finite_or_zero(row_max) + torch.log(torch.where(empty, 1.0, row_sum)),
            ).float()
        return _ungrouped(out, q.dtype), SoftmaxStats(lse.reshape(b, hq, sq)), state

    def backward(self, dout, q, k, v, out, stats, rng_state, params):
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        compute_dtype = _compute_dtype(q.dtype)
        qg, kg, vg = (
            _grouped(q, hkv, compute_dtype),
            _grouped(k, hkv, compute_dtype),
            _grouped(v, hkv, compute_dtype),
        )
        doutg, outg = _grouped(dout, hkv, compute_dtype), _grouped(out, hkv, compute_dtype)
        mask = _grouped_mask(params.attn_mask, hkv, hq // hkv)
        lse_g = inf_where_no_key(stats.lse().reshape(qg.shape[:-1]).to(compute_dtype))
        delta = (doutg * outg).sum(dim=-1)
        block_q, block_k = (
            (rng_state.block_q, rng_state.block_k) if rng_state else (self.block_q, self.block_k)
        )

        dq = torch.zeros_like(qg)
        dk = torch.zeros_like(kg)
        dv = torch.zeros_like(vg)
        for (q0, q1), kv_blocks in _block_plan(sq, sk, params, block_q, block_k):
            q_blk, do_blk = qg[..., q0:q1, :], doutg[..., q0:q1, :]
            for k0, k1 in kv_blocks:
                k_blk, v_blk = kg[..., k0:k1, :], vg[..., k0:k1, :]
                scores, softcap_slope = _masked_scores(
                    q_blk, k_blk, params, mask, (q0, q1), (k0, k1), sq, sk
                )
                probs = torch.exp(scores - lse_g[..., q0:q1].unsqueeze(-1))
                dprobs = do_blk @ v_blk.transpose(-1, -2)
                dropped = probs
                keep = _dropout_keep(probs, params.dropout_p, rng_state, q0, k0)
                if keep is not None:
                    dropped, dprobs = probs * keep, dprobs * keep
                dv[..., k0:k1, :] += (dropped.transpose(-1, -2) @ do_blk).sum(dim=2, keepdim=True)
                dscores = probs * (dprobs - delta[..., q0:q1].unsqueeze(-1)) * params.softmax_scale
                if softcap_slope is not None:
                    dscores = dscores * softcap_slope
                dq[..., q0:q1, :] += dscores @ k_blk
                dk[..., k0:k1, :] += (dscores.transpose(-1, -2) @ q_blk).sum(dim=2, keepdim=True)
        return _ungrouped(dq, q.dtype), _ungrouped(dk, k.dtype), _ungrouped(dv, v.dtype)


# ---- layout helpers ----------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x: Tensor, hkv: int, dtype: torch.dtype) -> Tensor:
    """``[b, s, h, d]`` -> ``[b, hkv, h // hkv, s, d]`` (a view where possible).

    For K/V (``h == hkv``) the group dim is 1 and broadcasts against the query groups, so
    GQA never materialises repeated keys or values.
    """
    b, s, h, d = x.shape
    return x.view(b, s, hkv, h // hkv, d).permute(0, 2, 3, 1, 4).to(dtype)


def _ungrouped(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`_grouped`: ``[b, hkv, g, s, d]`` -> ``[b, s, hkv * g, d]``."""
    b, hkv, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hkv * g, d).to(dtype)


def _grouped_mask(mask: Optional[Tensor], hkv: int, groups: int) -> Optional[Tensor]:
    """``[b|1, hq|1, sq, sk]`` bool -> broadcastable against ``[b, hkv, g, sq, sk]``."""
    if mask is None:
        return None
    b, h, sq, sk = mask.shape
    if h == 1:
        return mask.unsqueeze(1)
    return mask.reshape(b, hkv, groups, sq, sk)


def _finite_or_zero(x: Tensor) -> Tensor:
    """Replace -inf (rows that have seen no key yet) by 0 so ``exp(s - m)`` stays finite."""
    return torch.where(torch.isneginf(x), 0.0, x)


# ---- block iteration ---------------------------------------------------------------------


def _block_plan(
    sq: int, sk: int, params: AttentionParams, block_q: int, block_k: int
) -> Iterator[tuple[tuple[int, int], list[tuple[int, int]]]]:
    """Yield each query block with the key blocks it can see.

    Only the keys inside the band (causal and/or sliding window, bottom-right aligned) of
    some row of the block are visited: blocks entirely outside it are skipped, never
    computed and masked.
    """
    lo, hi = params.band()
    for q0 in range(0, sq, block_q):
        q1 = min(q0 + block_q, sq)
        k_start, k_end = band_rows(lo, hi, q0, q1, sq, sk)
        yield (q0, q1), [(k0, min(k0 + block_k, k_end)) for k0 in range(k_start, k_end, block_k)]


def _masked_scores(
    q_blk: Tensor,
    k_blk: Tensor,
    params: AttentionParams,
    mask: Optional[Tensor],
    q_range: tuple[int, int],
    k_range: tuple[int, int],
    sq: int,
    sk: int,
) -> tuple[Tensor, Optional[Tensor]]:
    """Scores of one block: scaled, soft-capped, ALiBi-biased, with -inf where the band
    (causal / window) or the mask hides a key. Also ``d capped / d scaled`` = ``1 - tanh^2``
    when ``softcap`` is on (None otherwise), for backward."""
    scores = (q_blk @ k_blk.transpose(-1, -2)) * params.softmax_scale
    softcap_slope = None
    if params.softcap > 0:
        capped = torch.tanh(scores / params.softcap)
        softcap_slope = 1.0 - capped * capped
        scores = capped * params.softcap
    if params.alibi_slopes is not None:
        bias = alibi_bias(params, q_range, k_range, sq, sk)  # [b|1, hq, bq, bk]
        b, hkv, groups = bias.shape[0], scores.shape[1], scores.shape[2]
        scores = scores + bias.view(b, hkv, groups, *bias.shape[2:]).to(scores.dtype)
    lo, hi = params.band()
    if band_crosses(lo, hi, q_range, k_range, sq, sk):
        scores = scores.masked_fill(
            band_mask(lo, hi, q_range, k_range, sq, sk, scores.device), float("-inf")
        )
    if mask is not None:
        (q0, q1), (k0, k1) = q_range, k_range
        scores = scores.masked_fill(mask[..., q0:q1, k0:k1], float("-inf"))
    return scores, softcap_slope


# ---- dropout -----------------------------------------------------------------------------


def _new_dropout_state(device: torch.device, block_q: int, block_k: int) -> DropoutState:
    """Draw a seed from the device's default generator (so manual_seed / RNG trackers apply)."""
    seed = int(torch.randint(0, 2**62, (1,), device=device).item())
    return DropoutState(seed=seed, block_q=block_q, block_k=block_k)


def _dropout_keep(
    x: Tensor, p: float, state: Optional[DropoutState], q0: int, k0: int
) -> Optional[Tensor]:
    """The dropout multiplier for block (q0, k0): 0 with probability ``p``, else ``1/(1-p)``.

    It depends only on the seed and the block's position, so forward and backward draw
    the same one. None when ``p == 0``.
    """
    if p == 0.0:
        return None
    generator = torch.Generator(device=x.device)
    generator.manual_seed((state.seed + q0 * 1_000_003 + k0) % 2**63)
    keep = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32) >= p
    return keep.to(x.dtype) / (1.0 - p)


# ---- probabilities (return_attn_probs) ----------------------------------------------------


def attention_probs(
    q: Tensor, k: Tensor, lse: Tensor, rng_state: Optional[DropoutState], params: AttentionParams
) -> Tensor:
    """The float32 ``[b, hq, sq, sk]`` probabilities ``exp(score - lse)`` of a finished forward
    (q ``[b, sq, hq, d]``, k ``[b, sk, hkv, d]``, lse ``[b, hq, sq]``), negated where its
    dropout dropped them (flash-attn's ``S_dmask`` encoding). Materialises the matrix:
    for tests only. The dropout masks are redrawn from ``rng_state`` block by block, as
    :meth:`ReferenceBackend.backward` does."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    compute_dtype = _compute_dtype(q.dtype)
    qg, kg = _grouped(q, hkv, compute_dtype), _grouped(k, hkv, compute_dtype)
    mask = _grouped_mask(params.attn_mask, hkv, hq // hkv)
    lse_g = inf_where_no_key(lse.reshape(qg.shape[:-1]).to(compute_dtype))
    block_q, block_k = (
        (rng_state.block_q, rng_state.block_k) if rng_state else (max(sq, 1), max(sk, 1))
    )
    probs = torch.zeros(qg.shape[:-1] + (sk,), dtype=compute_dtype, device=q.device)
    for (q0, q1), kv_blocks in _block_plan(sq, sk, params, block_q, block_k):
        for k0, k1 in kv_blocks:
            scores, _ = _masked_scores(
                qg[..., q0:q1, :], kg[..., k0:k1, :], params, mask, (q0, q1), (k0, k1), sq, sk
            )
            block = torch.exp(scores - lse_g[..., q0:q1].unsqueeze(-1))
            keep = _dropout_keep(block, params.dropout_p, rng_state, q0, k0)
            probs[..., q0:q1, k0:k1] = (
                block if keep is None else torch.where(keep > 0, block, -block)
            )
    return probs.reshape(b, hq, sq, sk).float()
