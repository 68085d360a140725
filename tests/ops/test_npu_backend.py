"""The NPU backend (``mcore_flash/ops/backends/npu.py``) against a contract double of torch_npu.

Part 1 checks the double itself (mcore_flash/emulation/fusion_attention.py) against an independent float64
oracle, so it can be trusted. Part 2 runs our backend through the public API with
``backend="npu"`` on CPU tensors and checks outputs, lse and gradients against the oracle
and the ``cpu``/``reference`` backends, and the arguments it passed to the op (recorded by
the double). Part 3 checks the input errors.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from mcore_flash.emulation import fusion_attention as nd
from mcore_flash.emulation import op_double
from mcore_flash.ops import flash_attn_func, flash_attn_varlen_func

from _support.oracle import BF16_GRAD, BF16_OUT

INF = float("inf")
FP32 = dict(atol=1e-5, rtol=1e-5)
# bf16 (BF16_OUT, BF16_GRAD): the double rounds a float64 result once, the reference backend
# accumulates in fp32.


# ---- oracle ---------------------------------------------------------------------------------


def causal_visible(sq, sk, bottom_right=True):
    """[sq, sk] bool, True = visible; bottom-right: key j visible to query i iff j <= i + sk - sq."""
    rows = torch.arange(sq).unsqueeze(-1)
    return torch.arange(sk) <= rows + ((sk - sq) if bottom_right else 0)


def oracle(q, k, v, scale, visible=None, keep=None, keep_prob=1.0, dout=None):
    """Naive float64 attention in BSND with GQA by repeat_interleave.

    visible: bool broadcastable to [b, hq, sq, sk] (True = visible); keep: dropout keep mask.
    Rows without a visible key give out = 0, lse = -inf. Returns (out, lse, grads or None).
    """
    q64, k64, v64 = (x.detach().double().requires_grad_(dout is not None) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    ke, ve = k64.repeat_interleave(g, dim=2), v64.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q64, ke) * scale
    if visible is not None:
        s = s.masked_fill(~visible, -INF)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), 0.0, m)
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(denom == 0, 1.0, denom)
    with torch.no_grad():
        lse = torch.where(denom > 0, m + torch.log(denom), -INF).squeeze(-1)
    if keep is not None:
        p = p * keep.double() / keep_prob
    out = torch.einsum("bhqk,bkhd->bqhd", p, ve)
    grads = None
    if dout is not None:
        out.backward(dout.double())
        grads = (q64.grad, k64.grad, v64.grad)
    return out.detach(), lse, grads


def varlen_oracle(q, k, v, cu_q, cu_k, scale, causal, keep=None, keep_prob=1.0, dout=None):
    """Per-sequence dense oracle over packed [T, H, D]; keep is [1, hq, Tq, Tk] (TND scores)."""
    outs, lses, dqs, dks, dvs = [], [], [], [], []
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        vis = causal_visible(q1 - q0, k1 - k0) if causal else None
        kp = None if keep is None else keep[:, :, q0:q1, k0:k1]
        out, lse, grads = oracle(
            q[q0:q1][None],
            k[k0:k1][None],
            v[k0:k1][None],
            scale,
            vis,
            kp,
            keep_prob,
            None if dout is None else dout[q0:q1][None],
        )
        outs.append(out[0])
        lses.append(lse[0])
        if grads:
            dqs.append(grads[0][0])
            dks.append(grads[1][0])
            dvs.append(grads[2][0])
    grads = (torch.cat(dqs), torch.cat(dks), torch.cat(dvs)) if dout is not None else None
    return torch.cat(outs), torch.cat(lses, dim=-1), grads


def rand_qkv(b, sq, sk, hq, hkv, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape_q = (b, sq, hq, d) if b else (sq, hq, d)
    shape_k = (b, sk, hkv, d) if b else (sk, hkv, d)
    q, k, v, do = (
        torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)
        for s in (shape_q, shape_k, shape_k, shape_q)
    )
    return q, k, v, do


def close(actual, expected, **tol):
    torch.testing.assert_close(actual.double(), expected.double(), **tol)


def grads_of(fn, q, k, v, dout):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(qq, kk, vv)
    out.backward(dout)
    return out.detach(), lse, (qq.grad, kk.grad, vv.grad)


def api(backend, q, k, v, dout, **kw):
    return grads_of(
        lambda a, b, c: flash_attn_func(a, b, c, backend=backend, return_lse=True, **kw),
        q,
        k,
        v,
        dout,
    )


def api_varlen(backend, q, k, v, dout, cu_q, cu_k, **kw):
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    mq = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    mk = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    return grads_of(
        lambda a, b, c: flash_attn_varlen_func(
            a, b, c, cq, ck, mq, mk, backend=backend, return_lse=True, **kw
        ),
        q,
        k,
        v,
        dout,
    )


def assert_same_result(res, expected, tol_out=FP32, tol_grad=FP32):
    out, lse, grads = res
    e_out, e_lse, e_grads = expected
    close(out, e_out, **tol_out)
    close(lse, e_lse, atol=1e-4 if tol_out is not FP32 else 1e-5, rtol=1e-5)
    for g, e in zip(grads, e_grads):
        close(g, e, **tol_grad)


# ===========================================================================================
# Part 1: the double against the oracle
# ===========================================================================================

MASK2048 = nd.compressed_causal_mask()


def _to_layout(x, layout, b_s_h_d=True):
    """BSND tensor -> the given layout."""
    b, s, n, d = x.shape
    return {
        "BSND": x,
        "BNSD": x.permute(0, 2, 1, 3),
        "BSH": x.reshape(b, s, n * d),
        "SBH": x.permute(1, 0, 2, 3).reshape(s, b, n * d),
    }[layout].contiguous()


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "SBH", "BSH"])
def test_double_layouts_causal_gqa_match_oracle(layout):
    torch_npu = op_double()
    q, k, v, do = rand_qkv(2, 6, 9, 4, 2, 8)
    scale = 0.37
    out, smax, ssum, sout, seed, offset, numels = torch_npu.npu_fusion_attention(
        _to_layout(q, layout),
        _to_layout(k, layout),
        _to_layout(v, layout),
        4,
        layout,
        atten_mask=MASK2048,
        scale=scale,
        sparse_mode=3,
    )
    e_out, e_lse, e_grads = oracle(q, k, v, scale, causal_visible(6, 9), dout=do)
    close(out, _to_layout(e_out, layout), **FP32)
    assert out.dtype == q.dtype and out.shape == _to_layout(q, layout).shape
    close(smax[..., 0] + torch.log(ssum[..., 0]), e_lse, **FP32)
    assert (seed, offset, numels) == (0, 0, 0) and sout.numel() == 0
    grads = torch_npu.npu_fusion_attention_grad(
        _to_layout(q, layout),
        _to_layout(k, layout),
        _to_layout(v, layout),
        _to_layout(do, layout),
        4,
        layout,
        atten_mask=MASK2048,
        softmax_max=smax,
        softmax_sum=ssum,
        attention_in=out,
        scale_value=scale,
        sparse_mode=3,
    )
    assert len(grads) == 5
    for g, e in zip(grads[:3], e_grads):
        close(g, _to_layout(e, layout), **FP32)


def test_double_causal_modes_2_and_3_differ_when_sq_ne_sk():
    torch_npu = op_double()
    q, k, v, _ = rand_qkv(1, 5, 8, 2, 2, 4)
    out2 = torch_npu.npu_fusion_attention(
        q, k, v, 2, "BSND", atten_mask=MASK2048, sparse_mode=2, scale=0.5
    )[0]
    out3 = torch_npu.npu_fusion_attention(
        q, k, v, 2, "BSND", atten_mask=MASK2048, sparse_mode=3, scale=0.5
    )[0]
    close(out2, oracle(q, k, v, 0.5, causal_visible(5, 8, bottom_right=False))[0], **FP32)
    close(out3, oracle(q, k, v, 0.5, causal_visible(5, 8, bottom_right=True))[0], **FP32)
    assert (out2 - out3).abs().max() > 1e-2
    # equal lengths: the two alignments coincide
    q, k, v, _ = rand_qkv(1, 6, 6, 2, 2, 4)
    a = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", atten_mask=MASK2048, sparse_mode=2)[0]
    b = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", atten_mask=MASK2048, sparse_mode=3)[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("sparse_mode", [0, 1, 2, 3])
def test_double_no_mask_is_full_attention_whatever_sparse_mode(sparse_mode):
    torch_npu = op_double()
    q, k, v, _ = rand_qkv(1, 7, 7, 2, 1, 8)
    out = torch_npu.npu_fusion_attention(
        q, k, v, 2, "BSND", atten_mask=None, sparse_mode=sparse_mode, scale=0.3
    )[0]
    close(out, oracle(q, k, v, 0.3)[0], **FP32)
    assert (out - oracle(q, k, v, 0.3, causal_visible(7, 7))[0]).abs().max() > 1e-2


@pytest.mark.parametrize("sparse_mode", [2, 3])
def test_double_rejects_non_compressed_mask_for_causal_modes(sparse_mode):
    torch_npu = op_double()
    q, k, v, _ = rand_qkv(1, 8, 8, 2, 2, 4)
    ss = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1)
    with pytest.raises(nd.NpuContractError, match="compressed"):
        torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", atten_mask=ss, sparse_mode=sparse_mode)
    with pytest.raises(nd.NpuContractError, match="triu"):  # right size, wrong content
        torch_npu.npu_fusion_attention(
            q, k, v, 2, "BSND", atten_mask=~MASK2048, sparse_mode=sparse_mode
        )
    with pytest.raises(nd.NpuContractError, match="compressed"):
        torch_npu.npu_fusion_attention(
            q, k, v, 2, "BSND", atten_mask=MASK2048[None, None], sparse_mode=sparse_mode
        )
    assert torch_npu.calls == []


def test_double_statistics_shapes_and_values():
    torch_npu = op_double()
    q, k, v, _ = rand_qkv(2, 5, 7, 4, 2, 8)
    visible = torch.rand(2, 4, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    visible[..., 0] = True
    out, smax, ssum, sout, seed, offset, numels = torch_npu.npu_fusion_attention(
        q, k, v, 4, "BSND", atten_mask=~visible, scale=0.25, sparse_mode=1
    )
    for x in (smax, ssum):
        assert x.dtype == torch.float32 and x.shape == (2, 4, 5, 8)
        assert torch.equal(x, x[..., :1].expand_as(x))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, dim=2)) * 0.25
    s = s.masked_fill(~visible, -INF)
    close(smax[..., 0], s.amax(-1), **FP32)
    close(ssum[..., 0], torch.exp(s - s.amax(-1, keepdim=True)).sum(-1), **FP32)
    close(out, oracle(q, k, v, 0.25, visible)[0], **FP32)
    assert sout.numel() == 0 and all(type(x) is int for x in (seed, offset, numels))


def test_double_tnd_statistics_are_shaped_tnd_but_ordered_ntd():
    """torch_npu 2.13: TND softmax_max/sum have shape [T, N, 8]; with the default
    softmax_layout="" their data is in [N, T, 8] order, with "TND" in [T, N, 8] order."""
    torch_npu = op_double()
    qt, kt, vt, _ = rand_qkv(0, 9, 9, 4, 2, 8)
    kw = dict(actual_seq_qlen=[4, 9], actual_seq_kvlen=[4, 9], scale=0.3)
    e_lse = varlen_oracle(qt, kt, vt, [0, 4, 9], [0, 4, 9], 0.3, False)[1]  # [N, T]
    _, smax, ssum, *_ = torch_npu.npu_fusion_attention(qt, kt, vt, 4, "TND", **kw)
    assert smax.shape == ssum.shape == (9, 4, 8) and smax.dtype == torch.float32
    ntd_max, ntd_sum = (
        smax.view(4, 9, 8)[..., 0],
        ssum.view(4, 9, 8)[..., 0],
    )  # the bytes in N-major order
    close(ntd_max + torch.log(ntd_sum), e_lse, **FP32)
    assert not torch.allclose(
        smax[..., 0].transpose(0, 1), ntd_max
    )  # read as [T, N] they are scrambled
    _, smax, ssum, *_ = torch_npu.npu_fusion_attention(
        qt, kt, vt, 4, "TND", softmax_layout="TND", **kw
    )
    close((smax[..., 0] + torch.log(ssum[..., 0])).transpose(0, 1), e_lse, **FP32)
    with pytest.raises(nd.NpuContractError, match="softmax_layout=TND only"):
        torch_npu.npu_fusion_attention(
            qt[None], kt[None], vt[None], 4, "BSND", softmax_layout="TND"
        )


def test_double_tnd_per_sequence_bottom_right_causal_and_grads():
    torch_npu = op_double()
    cu_q, cu_k = [0, 3, 6, 10], [0, 6, 9, 17]  # Sq <= Skv for every sequence, as TND causal needs
    q, k, v, do = rand_qkv(0, 10, 17, 4, 2, 8)
    kw = dict(scale=0.3, actual_seq_qlen=cu_q[1:], actual_seq_kvlen=cu_k[1:])
    out, smax, ssum, *_ = torch_npu.npu_fusion_attention(
        q, k, v, 4, "TND", atten_mask=MASK2048, sparse_mode=3, **kw
    )
    e_out, e_lse, e_grads = varlen_oracle(q, k, v, cu_q, cu_k, 0.3, True, dout=do)
    close(out, e_out, **FP32)
    close(smax.view(4, 10, 8)[..., 0] + torch.log(ssum.view(4, 10, 8)[..., 0]), e_lse, **FP32)
    grads = torch_npu.npu_fusion_attention_grad(
        q,
        k,
        v,
        do,
        4,
        "TND",
        atten_mask=MASK2048,
        softmax_max=smax,
        softmax_sum=ssum,
        attention_in=out,
        scale_value=0.3,
        sparse_mode=3,
        actual_seq_qlen=cu_q[1:],
        actual_seq_kvlen=cu_k[1:],
    )
    for g, e in zip(grads[:3], e_grads):
        close(g, e, **FP32)
    # no mask in TND: full attention inside each sequence, never across sequences
    out = torch_npu.npu_fusion_attention(q, k, v, 4, "TND", sparse_mode=3, **kw)[0]
    close(out, varlen_oracle(q, k, v, cu_q, cu_k, 0.3, False)[0], **FP32)


def test_double_tnd_has_no_inner_precise():
    """In varlen inner_precise does nothing: causal Sq > Skv and fully masked rows are errors."""
    torch_npu = op_double()
    q, k, v, _ = rand_qkv(0, 10, 7, 4, 2, 8)
    with pytest.raises(nd.NpuContractError, match="Sq=4 > Skv=1"):
        torch_npu.npu_fusion_attention(
            q,
            k,
            v,
            4,
            "TND",
            atten_mask=MASK2048,
            sparse_mode=3,
            inner_precise=2,
            actual_seq_qlen=[6, 10],
            actual_seq_kvlen=[6, 7],
        )
    with pytest.raises(nd.NpuContractError, match="see no key in TND"):  # queries without keys
        torch_npu.npu_fusion_attention(
            q, k, v, 4, "TND", inner_precise=2, actual_seq_qlen=[6, 10], actual_seq_kvlen=[7, 7]
        )
    assert torch_npu.calls == []


def test_double_grad_uses_the_given_statistics():
    torch_npu = op_double()
    q, k, v, do = rand_qkv(1, 6, 6, 2, 2, 8)
    out, smax, ssum, *_ = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", scale=0.5)
    kw = dict(attention_in=out, scale_value=0.5)
    g_own = torch_npu.npu_fusion_attention_grad(
        q, k, v, do, 2, "BSND", softmax_max=smax, softmax_sum=ssum, **kw
    )
    g_bad = torch_npu.npu_fusion_attention_grad(
        q, k, v, do, 2, "BSND", softmax_max=smax, softmax_sum=ssum * 2, **kw
    )
    for a, e in zip(g_own, oracle(q, k, v, 0.5, dout=do)[2]):
        close(a, e, **FP32)
    assert (g_bad[0] - g_own[0]).abs().max() > 1e-3


def test_double_grad_rejects_statistics_that_are_not_max_sum_pairs():
    """A logsumexp as softmax_max with softmax_sum = 1 gives the same probabilities in exact
    arithmetic, but it is not what the kernel takes: the double refuses it, and refuses
    statistics whose 8 copies differ."""
    torch_npu = op_double()
    q, k, v, do = rand_qkv(1, 6, 6, 2, 2, 8)
    out, smax, ssum, *_ = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", scale=0.5)
    kw = dict(attention_in=out, scale_value=0.5)
    lse = smax + torch.log(ssum)
    with pytest.raises(nd.NpuContractError, match="not a row maximum"):
        torch_npu.npu_fusion_attention_grad(
            q, k, v, do, 2, "BSND", softmax_max=lse, softmax_sum=torch.ones_like(ssum), **kw
        )
    with pytest.raises(nd.NpuContractError, match="below the largest score"):
        torch_npu.npu_fusion_attention_grad(
            q, k, v, do, 2, "BSND", softmax_max=smax - 1, softmax_sum=ssum, **kw
        )
    uneven = smax.clone()
    uneven[..., 3] += 1.0
    with pytest.raises(nd.NpuContractError, match="identical copies"):
        torch_npu.npu_fusion_attention_grad(
            q, k, v, do, 2, "BSND", softmax_max=uneven, softmax_sum=ssum, **kw
        )
    with pytest.raises(nd.NpuContractError, match="softmax_max"):  # stats without the 8 copies
        torch_npu.npu_fusion_attention_grad(
            q, k, v, do, 2, "BSND", softmax_max=smax[..., 0], softmax_sum=ssum[..., 0], **kw
        )


def test_double_grad_takes_statistics_merged_over_key_blocks():
    """Context parallelism: two calls over halves of the keys, merged as (max, sum) pairs
    (MindSpeed's rule); each half's grad op with the merged output and statistics gives the
    gradients of the whole attention."""
    torch_npu = op_double()
    q, k, v, do = rand_qkv(1, 6, 10, 2, 2, 8)
    halves = (slice(0, 5), slice(5, 10))
    parts = [
        torch_npu.npu_fusion_attention(q, k[:, h], v[:, h], 2, "BSND", scale=0.5) for h in halves
    ]
    (o1, m1, s1, *_), (o2, m2, s2, *_) = parts
    m = torch.maximum(m1, m2)
    w1, w2 = s1 * torch.exp(m1 - m), s2 * torch.exp(m2 - m)
    total = w1 + w2
    out = o1 * (w1 / total)[..., 0].transpose(1, 2).unsqueeze(-1) + o2 * (w2 / total)[
        ..., 0
    ].transpose(1, 2).unsqueeze(-1)
    e_out, _, (e_dq, e_dk, e_dv) = oracle(q, k, v, 0.5, dout=do)
    close(out, e_out, **FP32)
    dq = torch.zeros_like(q)
    for h in halves:
        g = torch_npu.npu_fusion_attention_grad(
            q,
            k[:, h],
            v[:, h],
            do,
            2,
            "BSND",
            softmax_max=m,
            softmax_sum=total,
            attention_in=out,
            scale_value=0.5,
        )
        dq += g[0]
        close(g[1], e_dk[:, h], **FP32)
        close(g[2], e_dv[:, h], **FP32)
    close(dq, e_dq, **FP32)


def test_double_dropout_reproducible_and_replayed():
    torch_npu = op_double()
    q, k, v, do = rand_qkv(1, 6, 8, 4, 2, 8)
    torch.manual_seed(7)
    res1 = torch_npu.npu_fusion_attention(q, k, v, 4, "BSND", keep_prob=0.6, scale=0.5)
    torch.manual_seed(7)
    res2 = torch_npu.npu_fusion_attention(q, k, v, 4, "BSND", keep_prob=0.6, scale=0.5)
    out, smax, ssum, _, seed, offset, numels = res1
    assert torch.equal(out, res2[0]) and (seed, offset, numels) == res2[4:]
    assert numels == 1 * 4 * 6 * 8 and offset != 0
    keep = nd.dropout_keep(seed, offset, (1, 4, 6, 8), 0.6)
    assert 0 < keep.double().mean() < 1
    e_out, e_lse, e_grads = oracle(q, k, v, 0.5, keep=keep, keep_prob=0.6, dout=do)
    close(out, e_out, **FP32)
    close(smax[..., 0] + torch.log(ssum[..., 0]), e_lse, **FP32)  # stats are pre-dropout
    kw = dict(
        softmax_max=smax,
        softmax_sum=ssum,
        attention_in=out,
        scale_value=0.5,
        keep_prob=0.6,
        seed=seed,
        offset=offset,
    )
    grads = torch_npu.npu_fusion_attention_grad(q, k, v, do, 4, "BSND", numels=numels, **kw)
    for g, e in zip(grads[:3], e_grads):
        close(g, e, **FP32)
    with pytest.raises(nd.NpuContractError, match="numels"):
        torch_npu.npu_fusion_attention_grad(q, k, v, do, 4, "BSND", numels=numels + 1, **kw)


def test_double_fully_masked_rows_need_inner_precise_2():
    torch_npu = op_double()
    q, k, v, do = rand_qkv(1, 4, 4, 2, 2, 8)
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 1, :] = True  # query 1 sees nothing
    with pytest.raises(nd.NpuContractError, match="inner_precise=2"):
        torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", atten_mask=mask, sparse_mode=1)
    out, smax, ssum, *_ = torch_npu.npu_fusion_attention(
        q, k, v, 2, "BSND", atten_mask=mask, sparse_mode=1, inner_precise=2
    )
    assert bool((out[:, 1] == 0).all()) and bool((ssum[:, :, 1] == 0).all())
    close(out, oracle(q, k, v, 1.0, ~mask)[0], **FP32)
    # sparse_mode=3 with Sq > Skv handles empty rows by itself
    q, k, v, _ = rand_qkv(1, 6, 3, 2, 2, 8)
    out = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", atten_mask=MASK2048, sparse_mode=3)[0]
    close(out, oracle(q, k, v, 1.0, causal_visible(6, 3))[0], **FP32)


def test_double_rejects_wrong_calls():
    torch_npu = op_double()
    op = torch_npu.npu_fusion_attention
    q, k, v, _ = rand_qkv(1, 4, 4, 4, 2, 8)
    err = nd.NpuContractError
    with pytest.raises(err, match="head_num"):
        op(q, k, v, 2, "BSND")
    with pytest.raises(err, match="same shape"):
        op(q, k, v[:, :3], 4, "BSND")
    with pytest.raises(err, match="multiple"):
        op(q[:, :, :3], k, v, 3, "BSND")
    with pytest.raises(err, match="dtype"):
        op(q.double(), k.double(), v.double(), 4, "BSND")
    with pytest.raises(err, match="head_dim"):
        big = torch.zeros(1, 2, 1, 800)
        op(big, big, big, 1, "BSND")
    with pytest.raises(err, match="256"):
        many = torch.zeros(1, 2, 300, 4)
        op(many, many, many, 300, "BSND")
    with pytest.raises(err, match="input_layout"):
        op(q, k, v, 4, "BSHD")
    with pytest.raises(err, match="not accepted"):  # 1NSS is not an accepted mask shape
        op(
            q.expand(2, -1, -1, -1),
            k.expand(2, -1, -1, -1),
            v.expand(2, -1, -1, -1),
            4,
            "BSND",
            atten_mask=torch.zeros(1, 4, 4, 4, dtype=torch.bool),
            sparse_mode=1,
        )
    with pytest.raises(err, match="bool/uint8"):
        op(q, k, v, 4, "BSND", atten_mask=torch.zeros(4, 4), sparse_mode=1)
    with pytest.raises(NotImplementedError, match="unsupported in the double"):
        op(q, k, v, 4, "BSND", atten_mask=MASK2048, sparse_mode=5)
    with pytest.raises(err, match="tockens"):  # band disagrees with an all-visible mask
        op(
            q,
            k,
            v,
            4,
            "BSND",
            atten_mask=torch.zeros(4, 4, dtype=torch.bool),
            pre_tockens=1,
            next_tockens=0,
        )
    qt, kt, vt = q[0], k[0], v[0]
    with pytest.raises(err, match="requires actual_seq"):
        op(qt, kt, vt, 4, "TND")
    with pytest.raises(err, match="WITHOUT the leading 0"):
        op(qt, kt, vt, 4, "TND", actual_seq_qlen=[0, 2, 4], actual_seq_kvlen=[0, 2, 4])
    with pytest.raises(err, match="list"):
        op(qt, kt, vt, 4, "TND", actual_seq_qlen=torch.tensor([2, 4]), actual_seq_kvlen=[2, 4])
    with pytest.raises(err, match="must equal T"):
        op(qt, kt, vt, 4, "TND", actual_seq_qlen=[2, 3], actual_seq_kvlen=[2, 4])
    with pytest.raises(err, match="only for TND"):
        op(q, k, v, 4, "BSND", actual_seq_qlen=[4], actual_seq_kvlen=[4])
    with pytest.raises(TypeError):  # keywords only past input_layout (positions vary by release)
        op(q, k, v, 4, "BSND", None, None, None, 0.5)
    assert torch_npu.calls == []


# ===========================================================================================
# Part 2: our backend through the public API, with the double installed
# ===========================================================================================

DENSE_CASES = [
    # b, sq, sk, hq, hkv, d, causal
    pytest.param(2, 16, 16, 4, 4, 64, False, id="mha-d64"),
    pytest.param(2, 16, 16, 4, 4, 64, True, id="mha-d64-causal"),
    pytest.param(1, 12, 20, 4, 2, 128, True, id="gqa-d128-causal-sq<sk"),
    pytest.param(2, 20, 12, 6, 1, 72, True, id="mqa-d72-causal-sq>sk"),
    pytest.param(1, 9, 17, 3, 3, 40, False, id="mha-d40-sq<sk"),
    pytest.param(2, 24, 10, 4, 2, 40, False, id="gqa-d40-sq>sk"),
]


def _check_dense_calls(calls, q, k, causal, dropout_p=0.0, scale=None, mask_shape=None):
    assert [c["name"] for c in calls] == ["npu_fusion_attention", "npu_fusion_attention_grad"]
    b, sq, hq, d = q.shape
    for c in calls:
        assert c["layout"] == "BSND"
        assert c["head_num"] == hq
        assert c["q_shape"] == tuple(q.shape)
        assert c["k_shape"] == c["v_shape"] == tuple(k.shape)  # K/V not expanded (native GQA)
        assert c["keep_prob"] == pytest.approx(1.0 - dropout_p, abs=1e-12)
        assert c["scale"] == pytest.approx(scale if scale is not None else 1.0 / math.sqrt(d))
        assert c["actual_seq_qlen"] is None
        if mask_shape is not None:
            assert c["sparse_mode"] == 1 and c["mask_shape"] == mask_shape
        elif causal:
            assert c["sparse_mode"] == 3 and c["mask_shape"] == (2048, 2048)
            assert torch.equal(c["atten_mask"], MASK2048)
        else:
            assert c["mask_shape"] is None  # full attention
    fwd, grad = calls
    assert (grad["seed"], grad["offset"], grad["numels"]) == (
        fwd["seed"],
        fwd["offset"],
        fwd["numels"],
    )


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,causal", DENSE_CASES)
def test_flash_attn_func_fp32_matches_oracle_and_other_backends(
    npu_double, b, sq, sk, hq, hkv, d, causal
):
    q, k, v, do = rand_qkv(b, sq, sk, hq, hkv, d)
    res = api("npu", q, k, v, do, causal=causal)
    _check_dense_calls(npu_double.calls, q, k, causal)
    visible = causal_visible(sq, sk) if causal else None
    assert_same_result(res, oracle(q, k, v, 1.0 / math.sqrt(d), visible, dout=do))
    for other in ("cpu", "reference"):
        assert_same_result(res, api(other, q, k, v, do, causal=causal))
    assert (
        res[0].dtype == torch.float32
        and res[1].dtype == torch.float32
        and res[1].shape == (b, hq, sq)
    )


def test_flash_attn_func_custom_scale(npu_double):
    q, k, v, do = rand_qkv(1, 8, 8, 2, 1, 16)
    res = api("npu", q, k, v, do, causal=True, softmax_scale=0.7)
    _check_dense_calls(npu_double.calls, q, k, True, scale=0.7)
    assert_same_result(res, oracle(q, k, v, 0.7, causal_visible(8, 8), dout=do))


@pytest.mark.parametrize(
    "b,sq,sk,hq,hkv,d,causal",
    [
        pytest.param(2, 16, 16, 4, 2, 64, True, id="gqa-causal"),
        pytest.param(1, 10, 14, 2, 1, 40, False, id="mqa-d40"),
    ],
)
def test_flash_attn_func_bf16(npu_double, b, sq, sk, hq, hkv, d, causal):
    q, k, v, do = rand_qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16)
    res = api("npu", q, k, v, do, causal=causal)
    assert res[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in res[2])
    _check_dense_calls(npu_double.calls, q, k, causal)
    visible = causal_visible(sq, sk) if causal else None
    assert_same_result(
        res, oracle(q, k, v, 1.0 / math.sqrt(d), visible, dout=do), BF16_OUT, BF16_GRAD
    )
    assert_same_result(res, api("reference", q, k, v, do, causal=causal), BF16_OUT, BF16_GRAD)


MASK_SHAPES = {  # our attn_mask shape -> the shape the op must receive (1NSS is not accepted)
    "B1SS": ((2, 1), (2, 1)),
    "1NSS": ((1, 4), (2, 4)),
    "BNSS": ((2, 4), (2, 4)),
    "11SS": ((1, 1), (1, 1)),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", list(MASK_SHAPES))
def test_flash_attn_func_explicit_mask(npu_double, kind, causal):
    b, sq, sk, hq, hkv, d = 2, 10, 14, 4, 2, 24
    q, k, v, do = rand_qkv(b, sq, sk, hq, hkv, d)
    lead, op_lead = MASK_SHAPES[kind]
    mask = torch.rand(*lead, sq, sk, generator=torch.Generator().manual_seed(3)) < 0.4
    mask[..., 0] = False  # every row keeps key 0 (visible under bottom-right causal since sq <= sk)
    res = api("npu", q, k, v, do, causal=causal, attn_mask=mask)
    _check_dense_calls(npu_double.calls, q, k, causal, mask_shape=(*op_lead, sq, sk))
    visible = ~mask
    if causal:
        visible = visible & causal_visible(sq, sk)
    assert_same_result(res, oracle(q, k, v, 1.0 / math.sqrt(d), visible, dout=do))
    for other in ("cpu", "reference"):
        assert_same_result(res, api(other, q, k, v, do, causal=causal, attn_mask=mask))


@pytest.mark.parametrize(
    "sq,sk,causal,empty_row",
    [
        pytest.param(6, 6, False, True, id="mask-empties-a-row"),
        pytest.param(8, 5, True, False, id="causal+mask-sq>sk"),
    ],
)
def test_flash_attn_func_mask_with_fully_masked_rows(npu_double, sq, sk, causal, empty_row):
    """base.py promises out = 0, lse = -inf, zero grads for rows that see no key; the contract
    says such rows need inner_precise=2 (the op only does that by itself for sparse_mode=3)."""
    q, k, v, do = rand_qkv(1, sq, sk, 2, 1, 16)
    mask = torch.zeros(1, 1, sq, sk, dtype=torch.bool)
    mask[..., 1, 2] = True
    if empty_row:
        mask[..., 2, :] = True
    expected = oracle(q, k, v, 0.25, ~mask & (causal_visible(sq, sk) if causal else True), dout=do)
    assert bool(torch.isneginf(expected[1]).any())
    res = api("npu", q, k, v, do, causal=causal, attn_mask=mask)
    assert_same_result(res, expected)
    assert_same_result(res, api("reference", q, k, v, do, causal=causal, attn_mask=mask))


@pytest.mark.parametrize("backend", ["npu", "cpu", "reference"])
def test_sbhd_layout_equals_bshd_and_reaches_the_npu_kernel_as_sbh_without_copies(
    npu_double, backend
):
    """Megatron's [s, b, h, d]: the npu kernel takes it as "SBH" (a view, no copy); the
    other backends take it as transposed views. Same results as flash-attn's [b, s, h, d]."""
    q, k, v, do = rand_qkv(2, 12, 12, 4, 2, 16)
    expected = api(backend, q, k, v, do, causal=True)
    npu_double.calls.clear()
    sbhd = [x.transpose(0, 1).contiguous() for x in (q, k, v, do)]
    out, lse, grads = api(backend, *sbhd, causal=True, layout="sbhd")
    assert_same_result((out.transpose(0, 1), lse, [g.transpose(0, 1) for g in grads]), expected)
    if backend == "npu":
        assert [(c["name"], c["layout"], c["noncontiguous"]) for c in npu_double.calls] == [
            ("npu_fusion_attention", "SBH", []),
            ("npu_fusion_attention_grad", "SBH", []),
        ]


def test_causal_long_sequence_uses_compressed_mask(npu_double):
    q, k, v, do = rand_qkv(1, 3000, 3000, 1, 1, 4)
    res = api("npu", q, k, v, do, causal=True)
    _check_dense_calls(npu_double.calls, q, k, True)  # (2048, 2048), never 3000 x 3000
    assert_same_result(
        res, oracle(q, k, v, 0.5, causal_visible(3000, 3000), dout=do)
    )  # out, lse and dq, dk, dv


VARLEN_CASES = [
    # cu_q, cu_k, hq, hkv, d, causal
    pytest.param([0, 5, 12, 20], [0, 5, 12, 20], 4, 2, 64, True, id="gqa-causal-same-lengths"),
    pytest.param([0, 3, 6, 10], [0, 6, 9, 17], 4, 1, 40, True, id="mqa-causal-uneven-sq<=sk"),
    pytest.param([0, 4, 11], [0, 9, 12], 2, 2, 72, False, id="mha-noncausal-uneven"),
]


def _check_varlen_calls(calls, q, k, cu_q, cu_k, causal, dropout_p=0.0):
    assert [c["name"] for c in calls] == ["npu_fusion_attention", "npu_fusion_attention_grad"]
    for c in calls:
        assert c["layout"] == "TND"
        assert c["head_num"] == q.shape[1]
        assert c["q_shape"] == tuple(q.shape) and c["k_shape"] == c["v_shape"] == tuple(k.shape)
        assert list(c["actual_seq_qlen"]) == cu_q[1:] and list(c["actual_seq_kvlen"]) == cu_k[1:]
        assert c["keep_prob"] == pytest.approx(1.0 - dropout_p, abs=1e-12)
        if causal:
            assert c["sparse_mode"] == 3 and c["mask_shape"] == (2048, 2048)
        else:
            assert c["mask_shape"] is None
    fwd, grad = calls
    assert (grad["seed"], grad["offset"], grad["numels"]) == (
        fwd["seed"],
        fwd["offset"],
        fwd["numels"],
    )


@pytest.mark.parametrize("cu_q,cu_k,hq,hkv,d,causal", VARLEN_CASES)
def test_flash_attn_varlen_func_matches_oracle_and_other_backends(
    npu_double, cu_q, cu_k, hq, hkv, d, causal
):
    q, k, v, do = rand_qkv(0, cu_q[-1], cu_k[-1], hq, hkv, d)
    res = api_varlen("npu", q, k, v, do, cu_q, cu_k, causal=causal)
    _check_varlen_calls(npu_double.calls, q, k, cu_q, cu_k, causal)
    assert res[1].shape == (hq, cu_q[-1])
    assert_same_result(res, varlen_oracle(q, k, v, cu_q, cu_k, 1.0 / math.sqrt(d), causal, dout=do))
    for other in ("cpu", "reference"):
        assert_same_result(res, api_varlen(other, q, k, v, do, cu_q, cu_k, causal=causal))


@pytest.mark.parametrize(
    "cu_q,cu_k,causal",
    [
        pytest.param([0, 3, 10, 14], [0, 6, 9, 17], True, id="causal-sq>sk"),
        pytest.param([0, 3, 10, 14], [0, 6, 6, 17], False, id="queries-without-keys"),
    ],
)
def test_varlen_packs_tnd_cannot_compute_run_the_reference_kernel(npu_double, cu_q, cu_k, causal):
    """TND has no inner_precise: such packs never reach the op (the double would raise)."""
    q, k, v, do = rand_qkv(0, cu_q[-1], cu_k[-1], 4, 2, 16)
    res = api_varlen("npu", q, k, v, do, cu_q, cu_k, causal=causal)
    assert npu_double.calls == []
    if causal:
        assert_same_result(res, varlen_oracle(q, k, v, cu_q, cu_k, 0.25, causal, dout=do))
    else:  # the float64 oracle cannot take a sequence without keys: rows 3..9 must be 0, -inf
        assert bool((res[0][3:10] == 0).all()) and bool(torch.isneginf(res[1][:, 3:10]).all())
        assert_same_result(res, api_varlen("reference", q, k, v, do, cu_q, cu_k, causal=causal))


def test_flash_attn_varlen_func_bf16(npu_double):
    cu = [0, 7, 9, 20]
    q, k, v, do = rand_qkv(0, 20, 20, 4, 2, 32, dtype=torch.bfloat16)
    res = api_varlen("npu", q, k, v, do, cu, cu, causal=True)
    _check_varlen_calls(npu_double.calls, q, k, cu, cu, True)
    expected = varlen_oracle(q, k, v, cu, cu, 1.0 / math.sqrt(32), True, dout=do)
    assert_same_result(res, expected, BF16_OUT, BF16_GRAD)


def _recovered_keep(call):
    return nd.dropout_keep(call["seed"], call["offset"], call["score_shape"], call["keep_prob"])


def test_dropout_dense_reproducible_and_consistent_with_backward(npu_double):
    q, k, v, do = rand_qkv(2, 12, 16, 4, 2, 32)
    p = 0.25

    def run(seed):
        torch.manual_seed(seed)
        return api("npu", q, k, v, do, causal=True, dropout_p=p)

    res1 = run(123)
    calls1 = list(npu_double.calls)
    res2 = run(123)
    for a, b in zip((res1[0], res1[1], *res1[2]), (res2[0], res2[1], *res2[2])):
        assert torch.equal(a, b)
    assert not torch.equal(run(321)[0], res1[0])
    _check_dense_calls(calls1, q, k, True, dropout_p=p)
    keep = _recovered_keep(calls1[0])  # [b, hq, sq, sk]
    assert 0.6 < keep.double().mean() < 0.9
    expected = oracle(
        q, k, v, 1.0 / math.sqrt(32), causal_visible(12, 16), keep=keep, keep_prob=1 - p, dout=do
    )
    assert_same_result(res1, expected)


def test_dropout_varlen_consistent_with_backward(npu_double):
    cu_q, cu_k = [0, 5, 10], [0, 7, 12]
    q, k, v, do = rand_qkv(0, 10, 12, 2, 1, 16)
    torch.manual_seed(5)
    res = api_varlen("npu", q, k, v, do, cu_q, cu_k, causal=True, dropout_p=0.3)
    _check_varlen_calls(npu_double.calls, q, k, cu_q, cu_k, True, dropout_p=0.3)
    keep = _recovered_keep(npu_double.calls[0])  # [1, hq, Tq, Tk]
    expected = varlen_oracle(q, k, v, cu_q, cu_k, 0.25, True, keep=keep, keep_prob=0.7, dout=do)
    assert_same_result(res, expected)


# ===========================================================================================
# Part 3: bad input through the API
# ===========================================================================================


def test_npu_backend_without_torch_npu_says_how_to_install(monkeypatch):
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("a real torch_npu is importable here")
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    q, k, v, _ = rand_qkv(1, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="pip install") as info:
        flash_attn_func(q, k, v, backend="npu")
    assert "CANN" in str(info.value)


@pytest.mark.parametrize(
    "shape_q,shape_k,dtype,error,match",
    [
        pytest.param((1, 4, 2, 8), (1, 4, 2, 8), torch.float64, TypeError, "float64", id="float64"),
        pytest.param(
            (1, 2, 1, 800),
            (1, 2, 1, 800),
            torch.float32,
            ValueError,
            "head_dim 800",
            id="head_dim-800",
        ),
        pytest.param(
            (1, 2, 300, 4),
            (1, 2, 1, 4),
            torch.float32,
            ValueError,
            "300 query heads",
            id="300-heads",
        ),
    ],
)
@pytest.mark.parametrize("varlen", [False, True])
def test_npu_backend_rejects_inputs_beyond_the_op(
    npu_double, shape_q, shape_k, dtype, error, match, varlen
):
    q, k = torch.zeros(shape_q, dtype=dtype), torch.zeros(shape_k, dtype=dtype)
    with pytest.raises(error, match=match):
        if varlen:
            cu = torch.tensor([0, shape_q[1]], dtype=torch.int32)
            flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, shape_q[1], shape_q[1], backend="npu")
        else:
            flash_attn_func(q, k, k, backend="npu")
    assert npu_double.calls == []  # rejected before reaching the op


# ---- sliding windows (sparse_mode 4) and the keywords the op lacks ------------------------------


def window_visible(sq, sk, left, right):
    """[sq, sk] bool: flash-attn's window, bottom-right: ``i + sk - sq - left <= j <= i + sk - sq + right``."""
    offset = torch.arange(sk) - torch.arange(sq).unsqueeze(-1) - (sk - sq)
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        visible &= offset >= -left
    if right >= 0:
        visible &= offset <= right
    return visible


@pytest.mark.parametrize(
    "sq,sk,window,causal",
    [
        pytest.param(24, 24, (5, 0), True, id="causal-window5"),
        pytest.param(24, 24, (3, 4), False, id="two-sided"),
        pytest.param(20, 12, (4, -1), False, id="left-only-sq>sk-empty-rows"),
        pytest.param(10, 30, (-1, 2), False, id="right-only-sq<sk"),
    ],
)
def test_window_is_sparse_mode_4_band_with_the_compressed_mask(npu_double, sq, sk, window, causal):
    q, k, v, do = rand_qkv(2, sq, sk, 4, 2, 16)
    res = api("npu", q, k, v, do, causal=causal, window_size=window)
    left, right = window[0], 0 if causal else window[1]
    for call in npu_double.calls:
        assert call["sparse_mode"] == 4 and torch.equal(call["atten_mask"], MASK2048)
        assert call["pre_tockens"] == (left if left >= 0 else 2147483647)
        assert call["next_tockens"] == (right if right >= 0 else 2147483647)
    visible = window_visible(sq, sk, left, right)
    empty = bool((~visible).all(dim=-1).any())
    assert all(call["inner_precise"] == (2 if empty else 0) for call in npu_double.calls)
    assert_same_result(res, oracle(q, k, v, 0.25, visible, dout=do))


def test_window_with_an_explicit_mask_folds_the_band_into_it(npu_double):
    q, k, v, do = rand_qkv(1, 16, 16, 2, 2, 16)
    mask = torch.rand(1, 1, 16, 16, generator=torch.Generator().manual_seed(1)) < 0.2
    res = api("npu", q, k, v, do, causal=True, window_size=(6, 0), attn_mask=mask)
    assert all(call["sparse_mode"] == 1 for call in npu_double.calls)
    assert_same_result(res, oracle(q, k, v, 0.25, window_visible(16, 16, 6, 0) & ~mask, dout=do))


def test_varlen_window_is_band_per_sequence(npu_double):
    cu = [0, 9, 30, 44]
    q, k, v, do = rand_qkv(0, 44, 44, 4, 1, 16)
    res = api_varlen("npu", q, k, v, do, cu, cu, causal=True, window_size=(4, 0))
    assert [c["sparse_mode"] for c in npu_double.calls] == [4, 4]
    assert npu_double.calls[0]["layout"] == "TND"
    parts = [
        oracle(
            q[a:b][None],
            k[a:b][None],
            v[a:b][None],
            0.25,
            window_visible(b - a, b - a, 4, 0),
            dout=do[a:b][None],
        )
        for a, b in zip(cu, cu[1:])
    ]
    expected = (
        torch.cat([p[0][0] for p in parts]),
        torch.cat([p[1][0] for p in parts], dim=-1),
        tuple(torch.cat([p[2][i][0] for p in parts]) for i in range(3)),
    )
    assert_same_result(res, expected)


def test_double_band_rejects_tockens_that_do_not_overlap():
    forward, _ = nd.make_ops([])
    q, k, v, _ = rand_qkv(1, 8, 8, 2, 2, 16)
    with pytest.raises(nd.NpuContractError, match="do not overlap"):
        forward(
            q,
            k,
            v,
            2,
            "BSND",
            atten_mask=MASK2048,
            sparse_mode=4,
            pre_tockens=-3,
            next_tockens=1,
            scale=0.25,
        )
    with pytest.raises(nd.NpuContractError, match="must be < Skv"):
        forward(
            q,
            k,
            v,
            2,
            "BSND",
            atten_mask=MASK2048,
            sparse_mode=4,
            pre_tockens=20,
            next_tockens=-8,
            scale=0.25,
        )


@pytest.mark.parametrize("keyword", [dict(softcap=30.0), dict(deterministic=True), "alibi"])
def test_npu_backend_refuses_keywords_the_op_lacks_naming_them(npu_double, keyword):
    q, k, v, _ = rand_qkv(1, 8, 8, 2, 2, 16)
    kwargs = dict(alibi_slopes=torch.ones(2)) if keyword == "alibi" else keyword
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"npu backend: {name}"):
        flash_attn_func(q, k, v, backend="npu", **kwargs)
