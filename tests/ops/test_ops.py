"""mcore_flash.ops against a float64 naive oracle (tests/_support/oracle.py), on the backends this
machine has ("reference", a small-block reference instance, "cpu").

Tolerances: err = max|actual - expected| / max(1, max|expected|) over the finite entries,
plus, for bf16, nerr = ||actual - expected||_F / ||expected||_F.

* fp32 inputs: err <= 1e-5 for out, lse and grads (oracle on the same fp32 values in
  float64; observed <= 1.1e-6).
* bf16 inputs: oracle on the bf16-rounded inputs and bf16-rounded dout in float64.
  out/lse: err <= 1e-2 (observed <= 3e-3: the bf16 output rounding, 2^-9 relative).
  grads: err <= 3e-2 and nerr <= 1.5e-2. Observed: reference <= 5e-3; torch's CPU kernel
  up to err 1.7e-2 / nerr 7.8e-3 on dk/dv, growing with hq/hkv (MHA 3.4e-3, GQA-4 5.6e-3,
  MQA-8 7.8e-3 nerr) -- its GQA reduction of K/V grads is evidently done in bf16.
* Rows that see no key are checked exactly: out == 0, lse == -inf, their dq == 0, and no
  NaN anywhere.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from mcore_flash.ops import (
    BackendUnavailableError,
    available_backends,
    backend_names,
    flash_attn_func,
    flash_attn_varlen_func,
    get_backend,
    last_used_backend,
)
from mcore_flash.ops.backends import ENV_VAR
from mcore_flash.ops.backends.reference import ReferenceBackend

from _support import oracle

# (max-abs tolerance, Frobenius-relative tolerance or None) by dtype and kind of tensor
TOL = {
    torch.float32: {"out": (1e-5, None), "grad": (1e-5, None)},
    torch.bfloat16: {"out": (1e-2, 1e-2), "grad": (3e-2, 1.5e-2)},
}


def _tol(dtype, name):
    return TOL[dtype]["grad" if name.startswith("d") else "out"]


_SMALL_BLOCKS = ReferenceBackend(block_q=16, block_k=32)
BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param(_SMALL_BLOCKS, id="reference-b16x32"),
    pytest.param("cpu", id="cpu"),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# bf16 is computed in fp32 by the reference kernel, so the small-block instance adds nothing
# there: it runs fp32 only.
BACKEND_DTYPES = [
    pytest.param(b.values[0], d.values[0], id=f"{d.id}-{b.id}")
    for b in BACKENDS
    for d in DTYPES
    if not (b.id == "reference-b16x32" and d.id == "bf16")
]


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def _inputs(b, sq, sk, hq, hkv, d, dtype, seed=0):
    q = _rand(b, sq, hq, d, dtype=dtype, seed=seed)
    k = _rand(b, sk, hkv, d, dtype=dtype, seed=seed + 1)
    v = _rand(b, sk, hkv, d, dtype=dtype, seed=seed + 2)
    dout = _rand(b, sq, hq, d, dtype=dtype, seed=seed + 3)
    return q, k, v, dout


def assert_close(actual, expected, tol, what, norm_tol=None):
    """max|actual - expected| <= tol * max(1, max|expected|), inf positions identical;
    with ``norm_tol`` also ||actual - expected|| <= norm_tol * ||expected|| (finite part)."""
    if isinstance(tol, tuple):
        tol, norm_tol = tol
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{what}: has NaN"
    a_inf, e_inf = torch.isinf(a), torch.isinf(e)
    assert torch.equal(a_inf, e_inf), (
        f"{what}: inf pattern differs at {torch.nonzero(a_inf != e_inf)[:5].tolist()} "
        f"(actual {a[a_inf != e_inf][:5].tolist()}, expected {e[a_inf != e_inf][:5].tolist()})"
    )
    assert torch.equal(a[a_inf], e[e_inf]), f"{what}: inf signs differ"
    fin = ~e_inf
    if fin.any():
        scale = max(1.0, e[fin].abs().max().item())
        err = (a[fin] - e[fin]).abs().max().item()
        assert err <= tol * scale, f"{what}: max abs err {err:.3e} > {tol} * {scale:.3g}"
        if norm_tol is not None:
            nerr = ((a[fin] - e[fin]).norm() / e[fin].norm().clamp_min(1e-30)).item()
            assert nerr <= norm_tol, f"{what}: relative Frobenius err {nerr:.3e} > {norm_tol}"


def run_dense(backend, q, k, v, dout, **kwargs):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse = flash_attn_func(q, k, v, backend=backend, return_lse=True, **kwargs)
    out.backward(dout)
    return out, lse, q.grad, k.grad, v.grad


def check_dense(backend, q, k, v, dout, **kwargs):
    """Run one case through the backend and the oracle and compare everything."""
    dtype = q.dtype
    out, lse, dq, dk, dv = run_dense(backend, q, k, v, dout, **kwargs)
    e_out, e_lse, e_dq, e_dk, e_dv = oracle.attention_with_grads(q, k, v, dout, **kwargs)
    b, sq, hq, d = q.shape
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert lse.shape == (b, hq, sq)
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
    for name, a, e in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), (e_out, e_lse, e_dq, e_dk, e_dv)
    ):
        assert_close(a, e, _tol(dtype, name), name)
    # rows without a visible key: exact zeros (out [b, sq, hq, d], lse [b, hq, sq])
    empty = torch.isneginf(e_lse).transpose(1, 2)  # [b, sq, hq]
    if empty.any():
        assert torch.isneginf(lse.transpose(1, 2)[empty]).all()
        assert (out[empty] == 0).all(), "rows with no visible key must give out == 0"
        assert (dq[empty] == 0).all(), "rows with no visible key must give dq == 0"
    return empty


# --------------------------------------------------------------------------------------
# the oracle itself, against torch's math SDPA (float64; top-left causal == bottom-right
# when sq == sk)
# --------------------------------------------------------------------------------------


def test_oracle_matches_torch_sdpa():
    q, k, v, _ = _inputs(2, 24, 24, 8, 2, 16, torch.float64)
    mask = torch.rand(2, 8, 24, 24, generator=torch.Generator().manual_seed(5)) < 0.3
    mask[..., 3, :] = False  # SDPA gives NaN for fully masked rows; keep all rows alive
    for causal in (False, True):
        for m in (None, mask):
            out, lse = oracle.attention(q, k, v, causal=causal, attn_mask=m)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=None if m is None else ~m,
                is_causal=causal,
                enable_gqa=True,
            ).transpose(1, 2)
            torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # bottom-right causal, sq > sk: query i sees keys j <= i - (sq - sk); first rows see none
    out, lse = oracle.attention(q[:, :10], k[:, :4], v[:, :4], causal=True)
    assert torch.isneginf(lse[:, :, :6]).all() and torch.isfinite(lse[:, :, 6:]).all()
    assert (out[:, :6] == 0).all()
    torch.testing.assert_close(out[:, 6, :, :], v[:, 0].repeat_interleave(4, dim=1))


# --------------------------------------------------------------------------------------
# dense flash_attn_func vs oracle
# --------------------------------------------------------------------------------------

DENSE_CASES = [
    # b, sq, sk, hq, hkv, d
    pytest.param((2, 37, 37, 4, 4, 64), id="mha-s37-d64"),
    pytest.param((1, 37, 100, 8, 2, 64), id="gqa-sq37<sk100-d64"),
    pytest.param((1, 100, 37, 8, 2, 64), id="gqa-sq100>sk37-d64"),
    pytest.param((2, 64, 64, 8, 2, 128), id="gqa-s64-d128"),
    pytest.param((1, 100, 100, 8, 1, 40), id="mqa-s100-d40"),
    pytest.param((1, 45, 77, 6, 3, 72), id="gqa-sq45<sk77-d72"),
]


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", DENSE_CASES)
def test_dense_matches_oracle(backend, dtype, causal, case):
    b, sq, sk, hq, hkv, d = case
    q, k, v, dout = _inputs(b, sq, sk, hq, hkv, d, dtype, seed=sum(case))
    empty = check_dense(backend, q, k, v, dout, causal=causal)
    # bottom-right causal with sq > sk leaves the first sq - sk rows without any key
    assert bool(empty.any()) == (causal and sq > sk)
    if causal and sq > sk:
        assert empty[:, : sq - sk].all() and not empty[:, sq - sk :].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("scale", [0.05, 0.3, 2.0])
def test_custom_softmax_scale(backend, causal, scale):
    # scale 2.0 makes the softmax very peaked: stresses the online-softmax rescaling
    q, k, v, dout = _inputs(1, 50, 70, 4, 2, 32, torch.float32, seed=11)
    check_dense(backend, q, k, v, dout, causal=causal, softmax_scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_sq_gt_sk_no_nan_and_zero_rows(backend):
    """sq > sk, causal: rows 0 .. sq-sk-1 see nothing; everything stays finite."""
    q, k, v, dout = _inputs(2, 40, 7, 4, 1, 16, torch.float32, seed=3)
    out, lse, dq, dk, dv = run_dense(backend, q, k, v, dout, causal=True)
    assert torch.isneginf(lse[:, :, :33]).all() and torch.isfinite(lse[:, :, 33:]).all()
    assert (out[:, :33] == 0).all() and (dq[:, :33] == 0).all()
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_dout(backend):
    """dout from .sum() is an expanded stride-0 tensor; from a transpose, non-contiguous."""
    q, k, v, _ = _inputs(1, 20, 20, 4, 2, 16, torch.float32, seed=4)
    w = _rand(1, 4, 20, 16, dtype=torch.float32, seed=9)
    for loss_fn, dout in (
        (lambda o: o.sum(), torch.ones(1, 20, 4, 16)),
        (lambda o: (o.transpose(1, 2) * w).sum(), w.transpose(1, 2)),
    ):
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        loss_fn(flash_attn_func(qq, kk, vv, causal=True, backend=backend)).backward()
        _, _, e_dq, e_dk, e_dv = oracle.attention_with_grads(q, k, v, dout, causal=True)
        assert_close(qq.grad, e_dq, 1e-5, "dq")
        assert_close(kk.grad, e_dk, 1e-5, "dk")
        assert_close(vv.grad, e_dv, 1e-5, "dv")


# --------------------------------------------------------------------------------------
# explicit bool attn_mask
# --------------------------------------------------------------------------------------


def _mask(shape, seed, full_row=5):
    m = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.35
    m[..., full_row, :] = True  # a fully masked query row everywhere
    return m


MASK_SHAPES = [
    pytest.param("b1", id="[b,1,sq,sk]"),
    pytest.param("1h", id="[1,h,sq,sk]"),
    pytest.param("bh", id="[b,h,sq,sk]"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", MASK_SHAPES)
@pytest.mark.parametrize("sq,sk", [(40, 40), (37, 53)], ids=["sq=sk", "sq<sk"])
def test_bool_mask(backend, causal, kind, sq, sk):
    b, hq, hkv, d = 2, 8, 2, 32
    q, k, v, dout = _inputs(b, sq, sk, hq, hkv, d, torch.float32, seed=21)
    shape = {"b1": (b, 1, sq, sk), "1h": (1, hq, sq, sk), "bh": (b, hq, sq, sk)}[kind]
    mask = _mask(shape, seed=len(kind) + sq)
    # keep each row's diagonal key, so that causal + mask together empty no further row
    # (that case has its own test below); rows 5 and 9 stay fully masked
    diag = torch.arange(sq)
    mask[..., diag, diag + sk - sq] = False
    mask[..., 5, :] = True
    if kind != "b1":
        mask[:, 3, 9, :] = True  # one head only: checks the head <-> mask-head mapping
    empty = check_dense(backend, q, k, v, dout, causal=causal, attn_mask=mask)
    assert empty[:, 5].all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sq,sk", [(16, 16), (10, 16)], ids=["sq=sk", "sq<sk"])
def test_mask_and_causal_together_empty_a_row(backend, sq, sk):
    """A row that neither the mask nor causal empties alone, but both together do:
    causal lets row 0 see keys 0 .. sk-sq, the mask hides exactly those."""
    q, k, v, dout = _inputs(1, sq, sk, 2, 2, 16, torch.float32, seed=31)
    mask = torch.zeros(1, 1, sq, sk, dtype=torch.bool)
    mask[0, 0, 0, : sk - sq + 1] = True
    empty = check_dense(backend, q, k, v, dout, causal=True, attn_mask=mask)
    assert empty[0, 0].all() and empty.sum() == 2


# --------------------------------------------------------------------------------------
# varlen
# --------------------------------------------------------------------------------------

VARLEN_CASES = [
    pytest.param(([5, 17, 1, 40], [5, 17, 1, 40]), id="self-5,17,1,40"),
    pytest.param(([5, 17, 1, 40], [9, 17, 3, 33]), id="cross-q5,17,1,40-k9,17,3,33"),
]


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def check_varlen(backend, lq, lk, causal, dtype, hq=4, hkv=2, d=64):
    tq, tk = sum(lq), sum(lk)
    q = _rand(tq, hq, d, dtype=dtype, seed=1)
    k = _rand(tk, hkv, d, dtype=dtype, seed=2)
    v = _rand(tk, hkv, d, dtype=dtype, seed=3)
    dout = _rand(tq, hq, d, dtype=dtype, seed=4)
    cu_q, cu_k = _cu(lq), _cu(lk)
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse = flash_attn_varlen_func(
        qq, kk, vv, cu_q, cu_k, max(lq), max(lk), causal=causal, backend=backend, return_lse=True
    )
    out.backward(dout)
    assert out.shape == (tq, hq, d) and out.dtype == dtype
    assert lse.shape == (hq, tq) and lse.dtype == torch.float32
    e = oracle.varlen_attention_with_grads(
        q, k, v, dout, cu_q.tolist(), cu_k.tolist(), causal=causal
    )
    for name, a, x in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, qq.grad, kk.grad, vv.grad), e
    ):
        assert_close(a, x, _tol(dtype, name), name)
    return out, lse


@pytest.mark.parametrize(
    "backend,dtype",
    [p for p in BACKEND_DTYPES if p.id.startswith("fp32") or p.id == "bf16-cpu"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", VARLEN_CASES)
def test_varlen_matches_per_sequence_oracle(backend, dtype, causal, lengths):
    lq, lk = lengths
    out, lse = check_varlen(backend, lq, lk, causal, dtype)
    # the cross case with causal: last sequence has sq=40 > sk=33 -> 7 empty rows
    if causal and lq != lk:
        assert torch.isneginf(lse[:, 23:30]).all() and (out[23:30] == 0).all()


def test_varlen_differs_from_one_long_sequence():
    """Sanity of the oracle comparison: packing must not equal attending across sequences."""
    lq = [5, 17, 1, 40]
    q, k, v = (_rand(63, 4, 16, dtype=torch.float32, seed=s) for s in (1, 2, 3))
    packed = flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lq), 40, 40, backend="cpu")
    whole = flash_attn_func(q[None], k[None], v[None], backend="cpu")[0]
    assert (packed - whole).abs().max() > 1e-2


def _zero_length_case(backend, which):
    """Empty query or key axes: nothing to compute, out 0 / lse -inf where rows exist."""
    for causal in (False, True):
        if which == "varlen":
            # seq 1: sq=0, sk=2 (its keys get zero grads); seq 2: sq=3, sk=0 (empty rows)
            check_varlen(backend, [5, 0, 3, 12], [5, 2, 0, 12], causal, torch.float32, d=16)
        else:
            sq, sk = (0, 5) if which == "dense-sq0" else (5, 0)
            q, k, v, dout = _inputs(1, sq, sk, 2, 1, 16, torch.float32, seed=51)
            check_dense(backend, q, k, v, dout, causal=causal)


def _in_subprocess(snippet):
    """Run ``snippet`` with this module imported as ``t`` in a fresh interpreter, so that a
    kernel that kills the process (SIGFPE) fails one test instead of the whole session."""
    here = os.path.dirname(__file__)  # tests/ops, and tests/ for _support
    code = f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]; import test_ops as t; {snippet}"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit code {r.returncode}"
    assert r.returncode == 0, f"{snippet!r}: {how}; stderr tail:\n{r.stderr[-2000:]}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["dense-sq0", "dense-sk0", "varlen"])
def test_zero_length(backend, which):
    """checks.py accepts empty sequences (cu_seqlens only needs to be non-decreasing)."""
    if backend == "cpu":
        _in_subprocess(f"t._zero_length_case('cpu', {which!r})")
    else:
        _zero_length_case(backend, which)


# --------------------------------------------------------------------------------------
# dropout (reference kernel; the cpu backend must fall back to it, not drop the dropout)
# --------------------------------------------------------------------------------------

DROPOUT_BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param(ReferenceBackend(block_q=4, block_k=8), id="reference-b4x8"),
    pytest.param("cpu", id="cpu"),
]


# sq == sk: with causal and sq != sk the cpu backend would fall back for that reason alone
DROPOUT_SHAPE = (2, 21, 21, 4, 2, 16)


def _dropout_run(backend, seed, p=0.3, causal=True, shape=DROPOUT_SHAPE):
    q, k, v, dout = _inputs(*shape, torch.float32, seed=7)
    torch.manual_seed(seed)
    return run_dense(backend, q, k, v, dout, causal=causal, dropout_p=p)


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_same_seed_reproducible_and_seeds_differ(backend):
    a = _dropout_run(backend, seed=123)
    b = _dropout_run(backend, seed=123)
    c = _dropout_run(backend, seed=124)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), f"{name} differs for the same seed"
    for name, x, z in zip(("out", "dq", "dk", "dv"), (a[0],) + a[2:], (c[0],) + c[2:]):
        assert not torch.equal(x, z), f"{name} identical for different seeds"
    # lse is the dropout-free softmax statistic
    assert torch.equal(a[1], c[1])


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_is_applied(backend):
    q, k, v, dout = _inputs(*DROPOUT_SHAPE, torch.float32, seed=7)
    plain = run_dense(backend, q, k, v, dout, causal=True)
    dropped = _dropout_run(backend, seed=5, p=0.5)
    for name, x, y in zip(
        ("out", "dq", "dk", "dv"), (plain[0],) + plain[2:], (dropped[0],) + dropped[2:]
    ):
        assert (x - y).abs().max() > 1e-2, f"dropout_p=0.5 left {name} unchanged"


def test_cpu_dropout_is_the_reference_kernel():
    """cpu + dropout must run the reference kernel (same seed => bit-identical)."""
    ref = _dropout_run("reference", seed=77)
    cpu = _dropout_run("cpu", seed=77)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), ref, cpu):
        assert torch.equal(x, y), f"cpu {name} != reference {name} under dropout"


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS[1:])  # "reference" == "cpu" (test above)
def test_dropout_unbiased_with_expected_variance(backend):
    """E[out] = dropout-free out and Var[out] = p/(1-p) * sum_j P_ij^2 v_j^2.

    N = 200 seeds. Each element's seed-mean is within 6 standard errors of the oracle
    (P(|Z| > 6) ~ 2e-9 per element); the mean squared z-score is ~1 (accepted 0.6 .. 1.6);
    the empirical variance is within 25% of the exact one on average.
    """
    p, n = 0.3, 200
    b, sq, sk, hq, hkv, d = 1, 10, 10, 2, 1, 8
    q, k, v, _ = _inputs(b, sq, sk, hq, hkv, d, torch.float32, seed=17)
    outs = []
    for seed in range(n):
        torch.manual_seed(1000 + seed)
        outs.append(flash_attn_func(q, k, v, dropout_p=p, causal=True, backend=backend).double())
    outs = torch.stack(outs)
    # exact moments from the oracle's probabilities
    vis = oracle.visible(sq, sk, True)
    s = torch.einsum(
        "bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(hq // hkv, 2)
    ) / math.sqrt(d)
    probs = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
    vf = v.double().repeat_interleave(hq // hkv, 2)
    mean = torch.einsum("bhij,bjhd->bihd", probs, vf)
    var = p / (1 - p) * torch.einsum("bhij,bjhd->bihd", probs**2, vf**2)
    z = (outs.mean(0) - mean) / (var / n).sqrt()
    assert z.abs().max() < 6, f"max |z| = {z.abs().max():.2f}"
    assert 0.6 < (z**2).mean() < 1.6, f"mean z^2 = {(z**2).mean():.2f}"
    ratio = (outs.var(0) / var).mean()
    assert 0.75 < ratio < 1.25, f"empirical/exact variance = {ratio:.3f}"


@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
@pytest.mark.parametrize(
    "causal,sq,sk",
    [(False, 6, 9), (True, 7, 7), (True, 9, 6)],
    ids=["full-6x9", "causal-7x7", "causal-9x6"],
)
def test_dropout_gradcheck_float64(backend, causal, sq, sk):
    """Backward replays forward's dropout mask: gradcheck with the seed reset in the function."""
    q, k, v, _ = _inputs(1, sq, sk, 2, 1, 4, torch.float64, seed=41)

    def fn(q, k, v):
        torch.manual_seed(2024)
        return flash_attn_func(q, k, v, dropout_p=0.4, causal=causal, backend=backend)

    args = tuple(x.clone().requires_grad_(True) for x in (q, k, v))
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64_empty_rows_and_mask(backend):
    """No dropout: causal sq > sk plus a mask, finite differences in float64."""
    q, k, v, _ = _inputs(1, 9, 6, 2, 1, 4, torch.float64, seed=43)
    mask = torch.zeros(1, 2, 9, 6, dtype=torch.bool)
    mask[0, 1, 6, 0] = True  # head 1, row 6: its only visible key masked -> empty

    def fn(q, k, v):
        return flash_attn_func(q, k, v, causal=True, attn_mask=mask, backend=backend)

    args = tuple(x.clone().requires_grad_(True) for x in (q, k, v))
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------
# backend registry
# --------------------------------------------------------------------------------------


def test_available_backends_here():
    avail = available_backends()
    assert set(backend_names()) == {"npu", "cuda", "cpu", "reference"}
    assert "cpu" in avail and "reference" in avail
    assert ("cuda" in avail) == torch.cuda.is_available()
    assert set(avail) <= set(backend_names())


def test_get_backend_auto_and_env(monkeypatch):
    assert get_backend(None, "cpu").name == "cpu"
    assert get_backend("reference").name == "reference"
    monkeypatch.setenv(ENV_VAR, "reference")
    assert get_backend(None, "cpu").name == "reference"
    monkeypatch.setenv(ENV_VAR, "nope")
    with pytest.raises(ValueError, match="nope"):
        get_backend(None, "cpu")


def test_last_used_backend_reports_each_call():
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 8, torch.float32)
    flash_attn_func(q, k, v, backend="reference")
    assert last_used_backend() == "reference"
    flash_attn_func(q, k, v)  # auto on CPU tensors
    assert last_used_backend() == "cpu"
    flash_attn_func(q, k, v, backend="reference")
    assert last_used_backend() == "reference"
    flash_attn_varlen_func(q[0], k[0], v[0], _cu([8]), _cu([8]), 8, 8, backend="cpu")
    assert last_used_backend() == "cpu"


def test_backend_choice_is_logged_once_per_backend(caplog, monkeypatch):
    from mcore_flash.ops import backends

    monkeypatch.setattr(backends, "_logged", set())  # as in a fresh process
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 8, torch.float32)
    with caplog.at_level(logging.INFO, logger="mcore_flash"):
        for _ in range(3):
            flash_attn_func(q, k, v, backend="reference")
            flash_attn_func(q, k, v)
    lines = [r.getMessage() for r in caplog.records if "using attention backend" in r.getMessage()]
    assert lines == [
        "mcore_flash: using attention backend 'reference'",
        "mcore_flash: using attention backend 'cpu'",
    ]


def test_last_used_backend_with_instance():
    """An AttentionBackend instance passed as backend= is what the call used."""
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 8, torch.float32)
    flash_attn_func(q, k, v, backend="cpu")
    assert last_used_backend() == "cpu"
    flash_attn_func(q, k, v, backend=ReferenceBackend(block_q=4, block_k=4))
    assert last_used_backend() == "reference"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_backend_unavailable_here():
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 8, torch.float32)
    with pytest.raises(BackendUnavailableError, match="'cuda'") as info:
        flash_attn_func(q, k, v, backend="cuda")
    assert isinstance(info.value, ValueError)
    with pytest.raises(BackendUnavailableError, match="'cuda'"):
        get_backend("cuda")


# --------------------------------------------------------------------------------------
# bad input -> clear errors naming the argument
# --------------------------------------------------------------------------------------


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


Q, K, V = _t(2, 8, 4, 16), _t(2, 8, 2, 16), _t(2, 8, 2, 16)
PQ, PK = _t(10, 4, 16), _t(10, 2, 16)

DENSE_ERRORS = [
    pytest.param(dict(q=_t(8, 4, 16)), ValueError, r"q must have 4 dims", id="q-rank3"),
    pytest.param(dict(k=_t(2, 8, 2, 16, 1)), ValueError, r"k must have 4 dims", id="k-rank5"),
    pytest.param(dict(v=_t(2, 8, 2)), ValueError, r"v must have 4 dims", id="v-rank3"),
    pytest.param(
        dict(k=_t(2, 8, 3, 16), v=_t(2, 8, 3, 16)),
        ValueError,
        r"query heads \(4\).*key/value heads \(3\)",
        id="hq%hkv",
    ),
    pytest.param(
        dict(k=_t(2, 8, 2, 8), v=_t(2, 8, 2, 8)),
        ValueError,
        r"head_dim of q \(16\) and k \(8\)",
        id="head_dim",
    ),
    pytest.param(
        dict(v=_t(2, 9, 2, 16)), ValueError, r"k and v must have the same shape", id="kv-shape"
    ),
    pytest.param(dict(k=_t(3, 8, 2, 16), v=_t(3, 8, 2, 16)), ValueError, r"batch size", id="batch"),
    pytest.param(
        dict(k=_t(2, 8, 2, 16, dtype=torch.bfloat16), v=_t(2, 8, 2, 16, dtype=torch.bfloat16)),
        TypeError,
        r"q, k, v must share one dtype",
        id="dtype-mismatch",
    ),
    pytest.param(
        dict(q=_t(2, 8, 4, 16, dtype=torch.int64)),
        TypeError,
        r"q has dtype torch.int64",
        id="int-dtype",
    ),
    pytest.param(dict(q=[[1.0]]), TypeError, r"q must be a torch.Tensor", id="not-tensor"),
    pytest.param(
        dict(backend="flashy"), ValueError, r"unknown attention backend 'flashy'", id="backend-name"
    ),
    pytest.param(dict(dropout_p=1.0), ValueError, r"dropout_p", id="dropout=1"),
    pytest.param(dict(dropout_p=-0.1), ValueError, r"dropout_p", id="dropout<0"),
    pytest.param(dict(softmax_scale=0.0), ValueError, r"softmax_scale", id="scale=0"),
    pytest.param(dict(softmax_scale=float("nan")), ValueError, r"softmax_scale", id="scale=nan"),
    pytest.param(
        dict(attn_mask=_t(2, 1, 8, 8)), TypeError, r"attn_mask must be a bool", id="mask-float"
    ),
    pytest.param(
        dict(attn_mask=torch.zeros(2, 3, 8, 8, dtype=torch.bool)),
        ValueError,
        r"attn_mask shape",
        id="mask-heads",
    ),
    pytest.param(
        dict(attn_mask=torch.zeros(8, 8, dtype=torch.bool)),
        ValueError,
        r"attn_mask shape",
        id="mask-rank2",
    ),
    pytest.param(
        dict(attn_mask=torch.zeros(2, 4, 8, 9, dtype=torch.bool)),
        ValueError,
        r"attn_mask shape",
        id="mask-sk",
    ),
]


@pytest.mark.parametrize("override,exc,pattern", DENSE_ERRORS)
def test_dense_bad_input(override, exc, pattern):
    kw = dict(q=Q, k=K, v=V)
    kw.update(override)
    with pytest.raises(exc, match=pattern):
        flash_attn_func(**kw)


def _cu_t(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


VARLEN_ERRORS = [
    pytest.param(dict(q=_t(1, 10, 4, 16)), ValueError, r"q must have 3 dims", id="q-rank4"),
    pytest.param(
        dict(cu_seqlens_q=_cu_t([0, 6, 4, 10])),
        ValueError,
        r"cu_seqlens_q must be non-decreasing",
        id="decreasing",
    ),
    pytest.param(
        dict(cu_seqlens_k=_cu_t([1, 4, 10])),
        ValueError,
        r"cu_seqlens_k must start at 0",
        id="not-from-0",
    ),
    pytest.param(
        dict(cu_seqlens_q=_cu_t([0, 4, 9])),
        ValueError,
        r"cu_seqlens_q\[-1\] = 9.*10",
        id="last!=total",
    ),
    pytest.param(
        dict(max_seqlen_k=5), ValueError, r"max_seqlen for cu_seqlens_k is 5.*6", id="max_seqlen"
    ),
    pytest.param(
        dict(cu_seqlens_k=_cu_t([0, 3, 7, 10])),
        ValueError,
        r"cu_seqlens_q and cu_seqlens_k.*same number of sequences",
        id="counts",
    ),
    pytest.param(
        dict(cu_seqlens_q=_cu_t([0.0, 4.0, 10.0], torch.float32)),
        TypeError,
        r"cu_seqlens_q",
        id="cu-float",
    ),
    pytest.param(dict(dropout_p=1.0), ValueError, r"dropout_p", id="dropout=1"),
    pytest.param(dict(backend="cuda"), ValueError, r"'cuda'", id="backend-cuda"),
]


@pytest.mark.parametrize("override,exc,pattern", VARLEN_ERRORS)
def test_varlen_bad_input(override, exc, pattern):
    if override.get("backend") == "cuda" and torch.cuda.is_available():
        pytest.skip("cuda is available here")
    kw = dict(
        q=PQ,
        k=PK,
        v=PK.clone(),
        cu_seqlens_q=_cu_t([0, 4, 10]),
        cu_seqlens_k=_cu_t([0, 4, 10]),
        max_seqlen_q=6,
        max_seqlen_k=6,
    )
    kw.update(override)
    with pytest.raises(exc, match=pattern):
        flash_attn_varlen_func(**kw)


def test_valid_inputs_of_the_error_tables_run():
    """The baselines the error tables perturb are themselves valid (so each error is due
    to exactly the perturbed argument)."""
    assert flash_attn_func(Q, K, V).shape == Q.shape
    assert (
        flash_attn_func(Q, K, V, attn_mask=torch.zeros(2, 4, 8, 8, dtype=torch.bool)).shape
        == Q.shape
    )
    out = flash_attn_varlen_func(PQ, PK, PK.clone(), _cu_t([0, 4, 10]), _cu_t([0, 4, 10]), 6, 6)
    assert out.shape == PQ.shape


def test_cpu_compute_dtype_is_decided_in_one_place():
    """Backward and fp16 always in float32; bf16 forward in bf16 only with bf16 units and no ALiBi."""
    from mcore_flash.ops.backends.cpu import compute_dtype

    bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    assert compute_dtype(bf16, backward=False, native_bf16=True) == bf16
    assert compute_dtype(bf16, backward=False, native_bf16=False) == fp32
    assert compute_dtype(bf16, backward=False, alibi=True, native_bf16=True) == fp32
    assert compute_dtype(bf16, backward=True, native_bf16=True) == fp32
    assert {compute_dtype(fp16, b, native_bf16=True) for b in (False, True)} == {fp32}
    assert compute_dtype(fp32, False) == fp32 and compute_dtype(fp64, True) == fp64


def _visible_pairs(sq, sk, window, causal):
    from _support import oracle

    return oracle.visible(sq, sk, causal, window=window)[0, 0]


@pytest.mark.parametrize("window,causal", [((40, 0), True), ((25, 30), False), ((-1, 10), False)])
def test_reference_visits_only_blocks_the_band_reaches(monkeypatch, window, causal):
    """Every visited (query block, key block) holds a visible pair, and together they cover all."""
    from mcore_flash.ops.backends import reference

    visited = []
    real = reference._masked_scores
    monkeypatch.setattr(
        reference, "_masked_scores", lambda *a: visited.append((a[4], a[5])) or real(*a)
    )
    sq, sk = 200, 260
    q, k, v = (torch.randn(1, s, 2, 16) for s in (sq, sk, sk))
    flash_attn_func(
        q,
        k,
        v,
        0.0,
        None,
        causal,
        window,
        backend=reference.ReferenceBackend(block_q=32, block_k=32),
    )
    visible = _visible_pairs(sq, sk, window, causal)
    covered = torch.zeros_like(visible)
    for (q0, q1), (k0, k1) in visited:
        assert visible[q0:q1, k0:k1].any(), f"block {(q0, q1)} x {(k0, k1)} is outside the band"
        covered[q0:q1, k0:k1] = True
    assert bool((covered | ~visible).all())


@pytest.mark.parametrize("window,causal", [((40, 0), True), ((25, 30), False)])
def test_cpu_chunks_call_the_kernel_on_the_band_keys_only(monkeypatch, window, causal):
    """Each query chunk reaches the kernel with exactly the key range its rows can see."""
    from mcore_flash.ops.backends import cpu

    calls = []
    real = cpu._fused_forward

    def recording(q, k, *args, **kwargs):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, *args, **kwargs)

    monkeypatch.setattr(cpu, "_fused_forward", recording)
    sq, sk = 300, 300
    q, k, v = (torch.randn(1, s, 2, 16) for s in (sq, sk, sk))
    flash_attn_func(q, k, v, 0.0, None, causal, window, backend=cpu.CpuBackend(query_chunk=64))
    visible = _visible_pairs(sq, sk, window, causal)
    expected = []
    for q0 in range(0, sq, 64):
        cols = visible[q0 : q0 + 64].any(dim=0).nonzero()
        expected.append((min(64, sq - q0), int(cols.max() - cols.min() + 1)))
    assert calls == expected
