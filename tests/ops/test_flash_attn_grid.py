"""A CPU-sized port of flash-attn 2's test grid (``tests/test_flash_attn.py``), written here.

flash-attn's rule: compute a float reference (here float64, :mod:`tests.oracle`) and a
"PyTorch" reference in the SAME low precision as the kernel; the kernel's max error against
the float reference must be at most twice the PyTorch reference's (:func:`assert_within`),
for the output and for dq, dk, dv. Dropout cases take the kept/dropped pattern from
``return_attn_probs`` (flash-attn's ``S_dmask``: dropped entries negative) and give it to
both references. Every case runs on ``reference`` and ``cpu``; nothing is skipped.

Marked ``slow``: it runs in CI's Python 3.11 job (the whole suite) only. It calls no
megatron code, and both jobs run torch 2.13.0, so the 3.12 job would repeat it unchanged.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from mcore_flash.ops import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

from _support import oracle

pytestmark = pytest.mark.slow

BACKENDS = ["reference", "cpu"]
DTYPES = [torch.float16, torch.bfloat16]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
# flash-attn's (seqlen_q, seqlen_k) pairs, CPU-sized: sq < sk, sq > sk (causal: rows that see
# no key), equal, a single query
SEQLENS = [(113, 203), (128, 217), (256, 128), (203, 113), (1, 147), (127, 127)]
HEAD_DIMS = [32, 59, 128]


FLOOR = 1e-5


def assert_within(
    name: str, got: torch.Tensor, same_dtype: torch.Tensor, exact: torch.Tensor, factor: float = 2.0
):
    """flash-attn's tolerance: ``|got - exact| <= factor * |same_dtype - exact|`` (max norms),
    plus :data:`FLOOR` so that a tensor whose exact value is 0 and which the same-dtype
    reference hits exactly (dq of a row that sees one key) does not make the bound 0."""
    err = (got.double() - exact).abs().max().item()
    bound = factor * (same_dtype.double() - exact).abs().max().item() + FLOOR
    assert err <= bound, (
        f"{name}: error {err:.3e} > {factor} x PyTorch same-dtype error ({bound / factor:.3e})"
    )


def _seed(*parts) -> int:
    """A seed fixed by the case (not Python's per-process string hash)."""
    return zlib.crc32(repr(parts).encode())


def _window(local: bool, sk: int, seed: int) -> tuple[int, int]:
    """flash-attn draws ``window_size = randint(0, sk, (2,))`` for local cases."""
    if not local:
        return (-1, -1)
    g = torch.Generator().manual_seed(seed)
    left, right = torch.randint(0, max(sk, 1), (2,), generator=g).tolist()
    return int(left), int(right)


def _inputs(b, sq, sk, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(b, s, h, d, generator=g).to(dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv))
    )
    dout = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    return q, k, v, dout


def _check_case(
    backend,
    dtype,
    hq,
    hkv,
    d,
    sq,
    sk,
    causal,
    window,
    seed,
    softcap=0.0,
    alibi=False,
    dropout_p=0.0,
):
    q, k, v, dout = _inputs(2, sq, sk, hq, hkv, d, dtype, seed)
    slopes = (
        torch.rand(2, hq, generator=torch.Generator().manual_seed(seed + 1)) * 0.3
        if alibi
        else None
    )
    kwargs = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)
    qx, kx, vx = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse, probs = flash_attn_func(
        qx, kx, vx, dropout_p, None, causal, window, softcap, slopes, False, True, backend=backend
    )
    keep = None
    if dropout_p > 0:
        keep, kwargs["dropout_mask"], kwargs["dropout_p"] = probs >= 0, probs >= 0, dropout_p
    dq, dk, dv = torch.autograd.grad(out, (qx, kx, vx), dout)
    exact = oracle.attention_with_grads(q, k, v, dout, **kwargs)
    same = oracle.attention_with_grads(q, k, v, dout, dtype=dtype, **kwargs)
    for name, got, s, e in zip(
        ("out", "dq", "dk", "dv"), (out, dq, dk, dv), same[:1] + same[2:], exact[:1] + exact[2:]
    ):
        assert_within(name, got, s, e)
    has_key = torch.isfinite(exact[1])
    torch.testing.assert_close(lse[has_key], exact[1][has_key].float(), atol=1e-4, rtol=1e-4)
    assert bool(torch.isposinf(lse[~has_key]).all()), (
        "flash-attn's lse is +inf on rows that see no key"
    )
    if keep is None:  # the probabilities themselves (flash-attn's S_dmask without dropout)
        p_exact = oracle.probabilities(q, k, **kwargs)
        torch.testing.assert_close(probs.double(), p_exact, atol=2e-2, rtol=0)


OUTPUT_GRID = list(
    itertools.product(DTYPES, HEADS, HEAD_DIMS, SEQLENS, [False, True], [False, True])
)
# the cpu backend's bf16 forward as CPUs without bf16 units run it (in float32); backend="cpu"
# runs whichever this machine picks (``compute_dtype``)
CPU_FLOAT32_FORWARD = "cpu-float32-forward"
OUTPUT_CASES = [(backend, *case) for case in OUTPUT_GRID for backend in BACKENDS] + [
    (CPU_FLOAT32_FORWARD, *case) for case in OUTPUT_GRID if case[0] == torch.bfloat16
]


@pytest.mark.parametrize(
    "backend,dtype,mha_type,d,seqlens,causal,local",
    OUTPUT_CASES,
    ids=[
        f"{b}-{str(t).split('.')[-1]}-{m}-d{d}-{sq}x{sk}-{'causal' if c else 'full'}-"
        f"{'local' if w else 'global'}"
        for b, t, m, d, (sq, sk), c, w in OUTPUT_CASES
    ],
)
def test_flash_attn_output(backend, dtype, mha_type, d, seqlens, causal, local):
    from mcore_flash.ops.backends.cpu import CpuBackend

    if backend == CPU_FLOAT32_FORWARD:
        backend = CpuBackend(native_bf16=False)
    (hq, hkv), (sq, sk) = HEADS[mha_type], seqlens
    seed = _seed(d, sq, sk, causal, local, mha_type)
    _check_case(backend, dtype, hq, hkv, d, sq, sk, causal, _window(local, sk, seed), seed)


FEATURE_GRID = list(
    itertools.product(
        DTYPES,
        ["mha", "gqa"],
        [(113, 203), (203, 113), (127, 127)],
        [False, True],
        [False, True],
        ["softcap", "alibi", "both"],
    )
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,mha_type,seqlens,causal,local,feature",
    FEATURE_GRID,
    ids=[
        f"{str(t).split('.')[-1]}-{m}-{sq}x{sk}-{'causal' if c else 'full'}-{'local' if w else 'global'}-{f}"
        for t, m, (sq, sk), c, w, f in FEATURE_GRID
    ],
)
def test_flash_attn_softcap_and_alibi(backend, dtype, mha_type, seqlens, causal, local, feature):
    """flash-attn's softcap (50.0 there; 5.0 here so the cap bites at d=64) and alibi cases."""
    (hq, hkv), (sq, sk) = HEADS[mha_type], seqlens
    seed = _seed(sq, sk, causal, local, mha_type, feature)
    softcap = 5.0 if feature in ("softcap", "both") else 0.0
    _check_case(
        backend,
        dtype,
        hq,
        hkv,
        64,
        sq,
        sk,
        causal,
        _window(local, sk, seed),
        seed,
        softcap,
        feature != "softcap",
    )


DROPOUT_GRID = list(
    itertools.product(DTYPES, [(113, 203), (127, 127)], [False, True], [False, True])
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,seqlens,causal,local", DROPOUT_GRID)
def test_flash_attn_dropout(backend, dtype, seqlens, causal, local):
    """Dropout 0.17 (flash-attn's value); the kept pattern comes back through return_attn_probs."""
    sq, sk = seqlens
    seed = _seed(sq, sk, causal, local)
    torch.manual_seed(seed)
    _check_case(
        backend, dtype, 4, 2, 32, sq, sk, causal, _window(local, sk, seed), seed, dropout_p=0.17
    )


def _varlen_lengths(n: int, longest: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(1, longest + 1, (n,), generator=g)]


VARLEN_GRID = list(
    itertools.product(DTYPES, ["mha", "mqa"], [32, 59], [False, True], [False, True], [False, True])
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,mha_type,d,causal,local,alibi", VARLEN_GRID)
def test_flash_attn_varlen_output(backend, dtype, mha_type, d, causal, local, alibi):
    """flash-attn's varlen test: random lengths (here 3 sequences up to 90 queries / 120 keys)."""
    (hq, hkv) = HEADS[mha_type]
    seed = _seed(mha_type, d, causal, local, alibi)
    lens_q, lens_k = _varlen_lengths(3, 90, seed), _varlen_lengths(3, 120, seed + 1)
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_k)), dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
    slopes = torch.rand(3, hq, generator=g) * 0.3 if alibi else None
    window = _window(local, min(lens_k), seed)
    qx, kx, vx = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse, probs = flash_attn_varlen_func(
        qx,
        kx,
        vx,
        cu_q,
        cu_k,
        max(lens_q),
        max(lens_k),
        0.0,
        None,
        causal,
        window,
        0.0,
        slopes,
        False,
        True,
        backend=backend,
    )
    assert probs is None
    grads = torch.autograd.grad(out, (qx, kx, vx), dout)
    per_seq = []
    for dtype_ in (torch.float64, dtype):
        results = [[], [], [], [], []]
        for i, ((q0, q1), (k0, k1)) in enumerate(
            zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:]))
        ):
            kwargs = dict(
                causal=causal,
                window=window,
                alibi_slopes=None if slopes is None else slopes[i : i + 1],
            )
            parts = oracle.attention_with_grads(
                q[q0:q1][None],
                k[k0:k1][None],
                v[k0:k1][None],
                dout[q0:q1][None],
                dtype=dtype_,
                **kwargs,
            )
            for acc, part in zip(results, parts):
                acc.append(part[0])
        per_seq.append([torch.cat(r, dim=-1 if j == 1 else 0) for j, r in enumerate(results)])
    exact, same = per_seq
    for name, got, s, e in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), same[:1] + same[2:], exact[:1] + exact[2:]
    ):
        assert_within(name, got, s, e)
    has_key = torch.isfinite(exact[1])
    torch.testing.assert_close(lse[has_key], exact[1][has_key].float(), atol=1e-4, rtol=1e-4)
    assert bool(torch.isposinf(lse[~has_key]).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_forms_equal_the_unpacked_call(backend):
    """qkvpacked / kvpacked (dense and varlen) give the unpacked call's outputs and gradients,
    gradients in the packed shape."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 57, 3, 4, 32, generator=g, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = (x.detach().clone().requires_grad_(True) for x in qkv.unbind(2))
    dout = torch.randn(2, 57, 4, 32, generator=g, dtype=torch.bfloat16)
    args = (0.0, None, True, (16, 0))
    expected = flash_attn_func(q, k, v, *args, backend=backend)
    expected.backward(dout)
    got = flash_attn_qkvpacked_func(qkv, *args, backend=backend)
    got.backward(dout)
    assert torch.equal(got, expected) and qkv.grad.shape == qkv.shape
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2))

    kv = torch.stack([k.detach(), v.detach()], dim=2).requires_grad_(True)
    q2 = q.detach().clone().requires_grad_(True)
    got = flash_attn_kvpacked_func(q2, kv, *args, backend=backend)
    got.backward(dout)
    assert torch.equal(got, expected) and torch.equal(kv.grad, torch.stack([k.grad, v.grad], dim=2))

    cu = torch.tensor([0, 20, 57], dtype=torch.int32)
    flat = qkv.detach()[0].clone().requires_grad_(True)  # [57, 3, 4, 32]
    fq, fk, fv = (x.detach().clone().requires_grad_(True) for x in flat.unbind(1))
    expected = flash_attn_varlen_func(fq, fk, fv, cu, cu, 37, 37, *args, backend=backend)
    expected.backward(dout[0])
    got = flash_attn_varlen_qkvpacked_func(flat, cu, 37, *args, backend=backend)
    got.backward(dout[0])
    assert torch.equal(got, expected) and torch.equal(
        flat.grad, torch.stack([fq.grad, fk.grad, fv.grad], dim=1)
    )
    fkv = torch.stack([fk.detach(), fv.detach()], dim=1).requires_grad_(True)
    got = flash_attn_varlen_kvpacked_func(fq.detach(), fkv, cu, cu, 37, 37, *args, backend=backend)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_backward_is_bit_identical(backend):
    """``deterministic=True``: two backward passes give the same bits (flash-attn's check)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(2, 300, h, 64, generator=g, dtype=torch.bfloat16, requires_grad=True)
        for h in (8, 2, 2)
    )
    dout = torch.randn(2, 300, 8, 64, generator=g, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        out = flash_attn_func(q, k, v, 0.0, None, True, (100, 0), 0.0, None, True, backend=backend)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for first, second in zip(*runs):
        assert torch.equal(first, second)
