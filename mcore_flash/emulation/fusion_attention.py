"""``npu_fusion_attention`` and its grad op as a contract double (pure PyTorch).

Written from the documented operator contract (``docs/npu-contract.md``: torch_npu 2.13's
op docs and meta registrations), not from our backend: it computes the math naively in
float64 and casts back, and it RAISES (:class:`NpuContractError`) on calls the contract
says are wrong or give silently wrong results on hardware, so a wrong call from our backend
fails a test instead of passing. Where the contract is silent, or the double does not
support an argument (``NotImplementedError``), its choices are listed in that page's
section "The doubles' choices" and asserted by tests/ops/test_npu_backend.py. The emulated
``torch_npu`` (:mod:`mcore_flash.emulation`) serves it; tests also use it directly on CPU
tensors::

    forward, grad = make_ops(calls := [])         # calls: one dict per op call
    out, smax, ssum, _, seed, offset, numels = forward(q, k, v, head_num, "BSND", scale=...)

A call's arguments and their checks: :mod:`.fusion_attention_args`; which keys each query
sees: :mod:`.fusion_attention_visibility`.
"""

from __future__ import annotations

import torch

from mcore_flash.npu_contract import MAX_TOCKENS

from .fusion_attention_args import (
    DropoutDraw,
    FusionAttentionArgs,
    FusionAttentionGradArgs,
    NpuContractError,
    _call_record,
    _canonical_qkv,
    _check_grad_inputs,
    _common_checks,
    _fail,
    _from_bnsd,
    _given_args,
    _sequence_ends,
    _to_bnsd,
)
from .fusion_attention_visibility import _check_empty_rows, _visible, compressed_causal_mask

__all__ = [
    "DropoutDraw",
    "FusionAttentionArgs",
    "FusionAttentionGradArgs",
    "NpuContractError",
    "compressed_causal_mask",
    "dropout_keep",
    "make_ops",
]


# ---- dropout --------------------------------------------------------------------------------


def dropout_keep(seed: int, offset: int, shape, keep_prob: float, device=None) -> torch.Tensor:
    """The bool keep mask of a call with this (seed, offset) over ``shape``."""
    gen = torch.Generator().manual_seed(int(seed) + int(offset))
    return (torch.rand(tuple(shape), generator=gen, dtype=torch.float64) < keep_prob).to(device)


def _draw_dropout(device, numels: int) -> DropoutDraw:
    """A forward's (seed, offset) from the default generator of ``device``, as the kernel
    draws them from the NPU's; offset is never 0, so a caller that drops it is caught."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), device=device).item())
    offset = int(torch.randint(1, 2**20, (1,), device=device).item()) * 16
    return DropoutDraw(seed, offset, numels)


# ---- statistics and scores ------------------------------------------------------------------


def _stats_out(row_stat: torch.Tensor, layout: str, softmax_layout: str) -> torch.Tensor:
    """Canonical ``[B, N, Sq]`` -> the op's float32 ``[B, N, Sq, 8]``, or TND ``[T, N, 8]``
    (data in ``[N, T, 8]`` order unless ``softmax_layout="TND"``)."""
    stat = row_stat.float().unsqueeze(-1).expand(*row_stat.shape, 8)
    if layout != "TND":
        return stat.contiguous()
    n, t = stat.shape[1], stat.shape[2]
    if softmax_layout == "TND":
        return stat.squeeze(0).transpose(0, 1).contiguous()
    return stat.squeeze(0).contiguous().view(t, n, 8)


def _stats_in(stat: torch.Tensor, layout: str, softmax_layout: str, n: int) -> torch.Tensor:
    """Inverse of :func:`_stats_out`: the op's statistics -> canonical ``[B, N, Sq, 8]`` float64."""
    if layout != "TND":
        return stat.double()
    t = stat.shape[0]
    if softmax_layout == "TND":
        return stat.transpose(0, 1).unsqueeze(0).double()
    return stat.reshape(n, t, 8).unsqueeze(0).double()


def _check_statistics(scores, visible, softmax_max, softmax_sum) -> None:
    """The grad op's statistics must be (row max, row sum) pairs, 8 identical copies each.

    ``scores`` ``[B, N, Sq, Skv]`` float64, masked entries -inf; statistics canonical
    ``[B, N, Sq, 8]``. For a row that sees a key here, ``softmax_max`` M is at least this
    call's largest score m; if M > m the maximum lies in keys of another call (merged
    statistics), whose ``exp(0)`` then adds at least 1 to ``softmax_sum`` beyond what this
    call's keys contribute. A logsumexp with sum 1 is neither. Rows whose scores or statistics
    are NaN (a diverged run) are not checked: the kernel passes NaN on as any op does.
    """
    for name, stat in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        first = stat[..., :1]
        if not bool(((stat == first) | (stat.isnan() & first.isnan())).all()):
            _fail(f"{name}: the 8 trailing values of each row must be identical copies")
    big, total = softmax_max[..., 0], softmax_sum[..., 0]
    finite = ~(scores.isnan().any(dim=-1) | big.isnan() | total.isnan())
    seen = visible.expand(scores.shape).any(dim=-1) & finite
    local_max = scores.amax(dim=-1)
    tol = 1e-4 * torch.clamp(local_max.abs(), min=1.0)
    local_sum = torch.exp(scores - torch.where(seen, big, 0.0).unsqueeze(-1)).sum(dim=-1)
    below = seen & (big < local_max - tol)
    if bool(below.any()):
        _fail(
            f"softmax_max is below the largest score of {int(below.sum())} rows: it is not a row maximum"
        )
    is_max = (big - local_max).abs() <= tol
    merged = total - local_sum >= 1.0 - 1e-3
    wrong = seen & ~(is_max | merged)
    if bool(wrong.any()):
        _fail(
            f"softmax_max of {int(wrong.sum())} rows is not a row maximum of the scores (a logsumexp with "
            "softmax_sum = 1?): pass the forward's softmax_max/softmax_sum, or (max, sum) pairs merged from them"
        )


def _scores(q, k, v, scale: float, visible):
    """K and V repeated to the query heads (GQA) and the scaled scores, -inf where not visible."""
    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = (q @ ke.transpose(-1, -2)) * float(scale)
    return ke, ve, s.masked_fill(~visible, float("-inf"))


# ---- the operators ----------------------------------------------------------------------------


def make_ops(record: list):
    """``(npu_fusion_attention, npu_fusion_attention_grad)`` appending one dict per call to ``record``."""
    return _forward_op(record), _grad_op(record)


def _forward_op(record: list):
    """The ``npu_fusion_attention`` double, appending one dict per call to ``record``."""

    def npu_fusion_attention(
        query,
        key,
        value,
        head_num,
        input_layout,
        *,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        scale=1.0,
        keep_prob=1.0,
        pre_tockens=MAX_TOCKENS,
        next_tockens=MAX_TOCKENS,
        inner_precise=0,
        prefix=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        sparse_mode=0,
        gen_mask_parallel=True,
        sync=False,
        softmax_layout="",
        sink=None,
        dropout_mask=None,
        seed=0,
        offset=0,
    ):
        """``-> (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``."""
        args = _given_args(FusionAttentionArgs, locals())
        q, k, v, _, _ = _canonical_qkv(args)
        _common_checks(args)
        if dropout_mask is not None or seed or offset:
            raise NotImplementedError(
                "npu_double: dropout_mask / seed / offset inputs are unsupported in the double"
            )
        seq_q, seq_k = _sequence_ends(args, q, k)
        visible = _visible(args, q, k, seq_q, seq_k)
        empty = _check_empty_rows(args, visible, seq_q, seq_k)
        ke, ve, s = _scores(q, k, v, scale, visible)
        row_max = s.amax(dim=-1)
        empty = empty.expand(row_max.shape)
        safe_max = torch.where(empty, 0.0, row_max)
        e = torch.exp(s - safe_max.unsqueeze(-1))
        row_sum = e.sum(dim=-1)
        p = e / torch.where(empty, 1.0, row_sum).unsqueeze(-1)

        dropout = DropoutDraw()
        if keep_prob < 1.0:
            dropout = _draw_dropout(query.device, p.numel())
            p = (
                p
                * dropout_keep(dropout.seed, dropout.offset, p.shape, keep_prob, p.device)
                / keep_prob
            )
        out = (p @ ve).to(query.dtype)

        max_out = torch.where(empty, float("-inf"), row_max)
        record.append(_call_record("npu_fusion_attention", args, dropout, p.shape))
        stats = [_stats_out(x, input_layout, softmax_layout) for x in (max_out, row_sum)]
        softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
        return (
            _from_bnsd(out, input_layout),
            stats[0],
            stats[1],
            softmax_out,
            dropout.seed,
            dropout.offset,
            dropout.numels,
        )

    return npu_fusion_attention


def _grad_op(record: list):
    """The ``npu_fusion_attention_grad`` double, appending one dict per call to ``record``."""

    def npu_fusion_attention_grad(
        query,
        key,
        value,
        dy,
        head_num,
        input_layout,
        *,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        softmax_max=None,
        softmax_sum=None,
        softmax_in=None,
        attention_in=None,
        scale_value=1.0,
        keep_prob=1.0,
        pre_tockens=MAX_TOCKENS,
        next_tockens=MAX_TOCKENS,
        inner_precise=0,
        seed=0,
        offset=0,
        numels=0,
        prefix=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        sparse_mode=0,
        gen_mask_parallel=True,
        sync=False,
        softmax_layout="",
        sink=None,
    ):
        """``-> (dq, dk, dv, dpse, dsink)``: ``dpse`` None, ``dsink`` empty, as torch_npu 2.13."""
        args = _given_args(
            FusionAttentionGradArgs,
            locals(),
            scale=scale_value,
            dropout=DropoutDraw(seed, offset, numels),
        )
        q, k, v, nq, nkv = _canonical_qkv(args)
        _common_checks(args)
        seq_q, seq_k = _sequence_ends(args, q, k)
        _check_grad_inputs(args, q)
        visible = _visible(args, q, k, seq_q, seq_k)
        empty = _check_empty_rows(args, visible, seq_q, seq_k)
        ke, ve, s = _scores(q, k, v, scale_value, visible)
        stats_max = _stats_in(softmax_max, input_layout, softmax_layout, nq)
        stats_sum = _stats_in(softmax_sum, input_layout, softmax_layout, nq)
        _check_statistics(s, visible, stats_max, stats_sum)
        smax, ssum = stats_max[..., 0], stats_sum[..., 0]
        do = _to_bnsd(dy, input_layout, head_num, "dy").double()
        o = _to_bnsd(attention_in, input_layout, head_num, "attention_in").double()
        p = torch.exp(s - smax.unsqueeze(-1)) / ssum.unsqueeze(-1)  # the GIVEN statistics
        p = torch.where(empty.expand(smax.shape).unsqueeze(-1), 0.0, p)

        dp = do @ ve.transpose(-1, -2)
        pd = p
        if keep_prob < 1.0:
            if numels != p.numel():
                _fail(
                    f"numels={numels} does not match this call's dropout size {p.numel()} (replay mismatch)"
                )
            z = dropout_keep(seed, offset, p.shape, keep_prob, p.device).double() / keep_prob
            pd, dp = p * z, dp * z
        delta = (do * o).sum(dim=-1, keepdim=True)
        ds = p * (dp - delta)
        dq = (ds @ ke) * float(scale_value)
        dke = (ds.transpose(-1, -2) @ q) * float(scale_value)
        dve = pd.transpose(-1, -2) @ do
        bk, _, skk, d = k.shape
        dk = dke.view(bk, nkv, nq // nkv, skk, d).sum(dim=2)
        dv = dve.view(bk, nkv, nq // nkv, skk, v.shape[-1]).sum(dim=2)
        record.append(_call_record("npu_fusion_attention_grad", args, args.dropout, p.shape))

        grads = (
            _from_bnsd(x, input_layout).to(like.dtype)
            for x, like in ((dq, query), (dk, key), (dv, value))
        )
        return (*grads, None, torch.empty(0, device=query.device))

    return npu_fusion_attention_grad
