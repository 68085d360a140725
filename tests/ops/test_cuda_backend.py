"""The ``cuda`` backend on the CPU: its kernel choice, and its calls into torch's kernels.

No GPU here. ``CudaBackend`` takes the kernel ops and the GPU description as arguments, so
these tests hand it :class:`cuda_double.AtenDouble` (each call checked by torch's own meta
kernel, then computed in float64 with the kernel's semantics: bottom-right causal and +inf
lse for flash, top-left causal for cuDNN) and a described GPU. The results are compared
with the float64 oracle; what ran, with which K/V shapes, is read off the double.
"""

from __future__ import annotations

import logging

import pytest
import torch

from mcore_flash.ops import flash_attn_func, flash_attn_varlen_func
from mcore_flash.ops.api import resolve_call
from mcore_flash.ops.backends.cuda import ENV_VAR, CudaBackend, CudaDevice

from _support import oracle
from _support.cuda_double import AtenDouble

H200 = CudaDevice((9, 0), 91600)  # torch prefers cuDNN attention here
H200_OLD_CUDNN = CudaDevice((9, 0), 91500)
A100 = CudaDevice((8, 0), 91600)
T4 = CudaDevice((7, 5), 91600)


@pytest.fixture(autouse=True)
def _no_kernel_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def _backend(device=H200, preference=None):
    double = AtenDouble()
    return CudaBackend(aten=double, device_info=lambda q: device, preference=preference), double


def _qkv(b=2, sq=128, sk=None, hq=4, hkv=None, d=64, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    sk, hkv = sk or sq, hkv or hq
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    return q, k, v


def _choice(device, preference=None, causal=True, band=None, shape=None, **kwargs):
    q, k, _ = _qkv(**(shape or {}))
    backend, _ = _backend(device, preference)
    _, params = resolve_call(q, causal, None, kwargs.pop("dropout_p", 0.0), "reference", **kwargs)
    if band is not None:
        params = params.with_band(*band)
    return backend.choose_kernel(q, k, params)


@pytest.mark.parametrize(
    "device,preference,kwargs,expected",
    [
        (H200, None, {}, "cudnn"),
        (A100, None, {}, "flash"),
        (H200_OLD_CUDNN, None, {}, "flash"),
        (H200, "flash", {}, "flash"),
        (A100, "cudnn", {}, "cudnn"),
        (H200, None, dict(shape=dict(sq=64, sk=128)), "flash"),  # cuDNN's causal is top-left
        (H200, None, dict(causal=False, shape=dict(sq=64, sk=128)), "cudnn"),
        (H200, None, dict(window_size=(32, 0)), "flash"),
        (H200, None, dict(causal=False, window_size=(32, 16)), "flash"),
        (H200, None, dict(causal=False, band=(3, 40)), None),  # a ring hop's band off the diagonal
        (H200, None, dict(causal=False, band=(-40, -3)), None),
        (H200, None, dict(dropout_p=0.1), "flash"),  # cuDNN: multiples of 1/16 only
        (H200, None, dict(dropout_p=0.125), "cudnn"),
        (H200, None, dict(shape=dict(hq=8, hkv=2)), "cudnn"),
        (H200, None, dict(shape=dict(d=160)), "flash"),
        (H200, None, dict(shape=dict(d=72)), "cudnn"),
        (H200, None, dict(shape=dict(d=100)), None),
        (H200, None, dict(shape=dict(d=264)), None),
        (H200, None, dict(shape=dict(dtype=torch.float32)), None),
        (H200, None, dict(softcap=30.0), None),
        (H200, None, dict(alibi_slopes=torch.rand(4)), None),
        (H200, None, dict(deterministic=True), None),
        (H200, None, dict(attn_mask=torch.zeros(1, 1, 128, 128, dtype=torch.bool)), None),
        (H200, None, dict(shape=dict(sk=1)), "flash"),
        (H200, None, dict(causal=False, shape=dict(sq=1)), "flash"),  # cuDNN: no single query
        (H200, None, dict(causal=False, window_size=(30, 20), shape=dict(sq=160, sk=96)), "flash"),
        # sq > sk + 1 and no right side below sk: torch's flash caps that side at sk
        (H200, None, dict(causal=False, window_size=(8, -1), shape=dict(sq=160, sk=96)), None),
        (H200, None, dict(causal=False, window_size=(8, 100), shape=dict(sq=160, sk=96)), None),
        (CudaDevice((8, 6), 91600), None, dict(shape=dict(d=192)), "flash"),
        (
            CudaDevice((8, 6), 91600),
            None,
            dict(shape=dict(d=256)),
            None,
        ),  # its flash backward: d <= 192
        (CudaDevice((9, 0), 91600, cudnn_deprioritized=True), None, {}, "flash"),
        (CudaDevice((10, 1), 91600, cuda_major=12), None, {}, "flash"),
        (CudaDevice((10, 1), 91600, cuda_major=13), None, {}, "cudnn"),
        (
            CudaDevice((9, 0), 91200),
            "cudnn",
            dict(dropout_p=0.125),
            "flash",
        ),  # cuDNN 9.11-9.13: no dropout
        (T4, None, {}, None),
    ],
)
def test_kernel_choice(device, preference, kwargs, expected):
    """cuDNN where torch prefers it and the call fits, then flash, then the reference kernel."""
    assert _choice(device, preference, **kwargs) == expected


def test_kernel_preference_is_validated(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fastest")
    with pytest.raises(ValueError, match=f"{ENV_VAR}='fastest'.*'auto', 'flash', 'cudnn'"):
        _choice(H200)
    monkeypatch.setenv(ENV_VAR, "flash")
    assert _choice(H200) == "flash"


def test_kernel_choice_is_logged_once(caplog):
    q, k, v = _qkv()
    backend, _ = _backend(H200)
    with caplog.at_level(logging.INFO, logger="mcore_flash"):
        for _ in range(2):
            flash_attn_func(q, k, v, causal=True, backend=backend)
        flash_attn_func(q, k[:, :64], v[:, :64], causal=True, backend=backend)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "mcore_flash: cuda backend runs the cudnn kernel (sm90, cuDNN 91600)",
        "mcore_flash: cuda backend runs the flash kernel (sm90, cuDNN 91600), not cudnn: "
        "causal with sq != sk (cuDNN aligns causal top-left)",
    ]


CASES = [  # (q/k/v shapes, keywords, whether a torch kernel runs: False = the reference kernel)
    pytest.param(dict(), dict(causal=True), True, id="mha-causal"),
    pytest.param(dict(hq=8, hkv=2), dict(causal=True), True, id="gqa-causal"),
    pytest.param(dict(hq=4, hkv=1), dict(), True, id="mqa"),
    pytest.param(dict(sq=96, sk=160, hq=4, hkv=2), dict(), True, id="gqa-sq<sk"),
    pytest.param(dict(sq=96, sk=160, hq=4, hkv=2), dict(causal=True), True, id="gqa-causal-sq<sk"),
    pytest.param(dict(sq=160, sk=96), dict(causal=True), True, id="causal-sq>sk-empty-rows"),
    pytest.param(dict(hq=8, hkv=2), dict(window_size=(24, 8)), True, id="gqa-window"),
    pytest.param(
        dict(hq=8, hkv=2, dtype=torch.bfloat16),
        dict(causal=True, window_size=(40, 0)),
        True,
        id="bf16-causal-window",
    ),
    pytest.param(dict(sq=160, sk=96), dict(window_size=(30, 20)), True, id="window-sq>sk"),
    pytest.param(dict(sq=96, sk=160), dict(window_size=(30, -1)), True, id="window-sq<sk-no-right"),
    pytest.param(
        dict(sq=160, sk=96), dict(window_size=(8, -1)), False, id="window-sq>sk+1-no-right"
    ),
]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("device", [pytest.param(H200, id="h200"), pytest.param(A100, id="a100")])
@pytest.mark.parametrize("shape,kwargs,on_a_kernel", CASES)
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_backend_equals_the_oracle_without_expanding_kv(device, shape, kwargs, on_a_kernel, layout):
    """Output, lse (-inf on rows without keys) and gradients equal float64 math; the kernels
    see K/V with hkv heads."""
    q, k, v = _qkv(**shape)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    backend, double = _backend(device)
    to = (lambda x: x) if layout == "bshd" else (lambda x: x.transpose(0, 1).contiguous())
    q_, k_, v_ = (to(x).requires_grad_(True) for x in (q, k, v))
    out, lse = flash_attn_func(
        q_, k_, v_, backend=backend, return_lse=True, layout=layout, **kwargs
    )
    out.backward(to(dout))
    want = oracle.attention_with_grads(q, k, v, dout, **_oracle_kwargs(kwargs))
    back = (lambda x: x) if layout == "bshd" else (lambda x: x.transpose(0, 1))
    got = (back(out), lse, back(q_.grad), back(k_.grad), back(v_.grad))
    tol = TOLERANCE[q.dtype]
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.dtype == (torch.float32 if name == "lse" else q.dtype), name
        torch.testing.assert_close(g.double(), w, atol=tol, rtol=tol, msg=name)
    if not on_a_kernel:
        assert not double.calls
        return
    kernels = {name.split("_")[0] for name, _ in double.calls}
    assert len(kernels) == 1 and {name.split("_")[1] for name, _ in double.calls} == {
        "forward",
        "backward",
    }
    assert {shape[-2] if "flash" in kernels else shape[1] for _, shape in double.calls} == {
        k.shape[2]
    }


def _oracle_kwargs(kwargs):
    kwargs = dict(kwargs)
    if "window_size" in kwargs:
        kwargs["window"] = kwargs.pop("window_size")
    return kwargs


@pytest.mark.parametrize("device,kernel", [(H200, "cudnn"), (A100, "flash")])
def test_dropout_state_reaches_the_backward_kernel(device, kernel):
    """Backward redraws forward's dropout mask only from the RNG state handed back: the
    gradients equal the oracle's under the mask the double drew in forward."""
    q, k, v = _qkv(hq=4, hkv=2)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    backend, double = _backend(device)
    q_, k_, v_ = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = flash_attn_func(q_, k_, v_, dropout_p=0.25, causal=True, backend=backend)
    mask = double.last_keep_mask()
    assert 0.6 < mask.double().mean() < 0.9
    out.backward(dout)
    want = oracle.attention_with_grads(
        q, k, v, dout, causal=True, dropout_mask=mask, dropout_p=0.25
    )
    for g, w in zip((out, q_.grad, k_.grad, v_.grad), (want[0], *want[2:])):
        torch.testing.assert_close(g.double(), w, atol=2e-3, rtol=2e-3)
    assert {name for name, _ in double.calls} == {f"{kernel}_forward", f"{kernel}_backward"}


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (16, 4))])
def test_packed_sequences_run_in_one_flash_call(causal, window):
    """Packed sequences: one flash call with int32 cumulative lengths on the device, equal to
    the oracle run per sequence."""
    lengths_q, lengths_k = [40, 7, 81], [40, 19, 81]
    cu_q, cu_k = [0, 40, 47, 128], [0, 40, 59, 140]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths_q), 8, 64, generator=g).half()
    k, v = (torch.randn(sum(lengths_k), 2, 64, generator=g).half() for _ in range(2))
    dout = torch.randn(q.shape, generator=g).half()
    backend, double = _backend(H200)
    q_, k_, v_ = (x.clone().requires_grad_(True) for x in (q, k, v))
    cu = lambda c: torch.tensor(c, dtype=torch.int32)  # noqa: E731
    out = flash_attn_varlen_func(
        q_, k_, v_, cu(cu_q), cu(cu_k), 81, 81, causal=causal, window_size=window, backend=backend
    )
    out.backward(dout)
    want = oracle.varlen_attention_with_grads(
        q, k, v, dout, cu_q, cu_k, causal=causal, window=window
    )
    for g_, w in zip((out, q_.grad, k_.grad, v_.grad), (want[0], *want[2:])):
        torch.testing.assert_close(g_.double(), w, atol=2e-3, rtol=2e-3)
    assert double.calls == [("flash_forward", (140, 2, 64)), ("flash_backward", (140, 2, 64))]


def test_packed_sequences_with_an_empty_one_run_one_by_one():
    """An empty sequence: each sequence runs alone (the empty one on the reference kernel)."""
    cu_q = [0, 64, 64, 128]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(128, 4, 64, generator=g).half().requires_grad_(True) for _ in range(3))
    backend, double = _backend(H200)
    cu = torch.tensor(cu_q, dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, causal=True, backend=backend)
    out.sum().backward()
    want = oracle.varlen_attention_with_grads(q, k, v, torch.ones_like(q), cu_q, cu_q, causal=True)
    torch.testing.assert_close(out.double(), want[0], atol=2e-3, rtol=2e-3)
    assert [name for name, _ in double.calls] == ["cudnn_forward"] * 2 + ["cudnn_backward"] * 2


@pytest.mark.parametrize("device", [pytest.param(H200, id="cudnn"), pytest.param(A100, id="flash")])
@pytest.mark.parametrize("hkv", [4, 1])
def test_saved_for_backward_is_exactly_q_k_v_out_lse(device, hkv):
    """What autograd keeps is q, k, v, out and the float32 lse, byte for byte (GQA included)."""
    q, k, v = _qkv(sq=256, hq=4, hkv=hkv)
    backend, _ = _backend(device)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, lse = flash_attn_func(q, k, v, causal=True, backend=backend, return_lse=True)
    assert sum(storages.values()) == sum(x.numel() * x.element_size() for x in (q, k, v, out, lse))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run by scripts/gpu_check.sh on one)"
)
@pytest.mark.parametrize("preference", ["flash", "cudnn"])
@pytest.mark.parametrize("shape,kwargs,on_a_kernel", CASES)
def test_torchs_kernels_on_a_gpu_equal_the_oracle(preference, shape, kwargs, on_a_kernel):
    """The same cases on a real GPU with torch's kernels, each kernel put first in turn."""
    q, k, v = (x.cuda() for x in _qkv(**shape))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype).cuda()
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = flash_attn_func(
        *leaves, backend=CudaBackend(preference=preference), return_lse=True, **kwargs
    )
    out.backward(dout)
    want = oracle.attention_with_grads(
        *(x.cpu() for x in (q, k, v, dout)), **_oracle_kwargs(kwargs)
    )
    tol = TOLERANCE[q.dtype]
    for name, g, w in zip(
        ("out", "lse", "dq", "dk", "dv"), (out, lse, *(x.grad for x in leaves)), want
    ):
        torch.testing.assert_close(g.cpu().double(), w, atol=tol, rtol=tol, msg=name)


def test_cudnn_backward_takes_out_and_its_gradient_in_any_strides():
    """A merged output (context parallelism) or a gradient in other strides reaches cuDNN in
    q's layout, as forward gave it (older torch caches backward graphs by q/k/v strides)."""
    q, k, v = _qkv(hq=4, hkv=2)
    backend, double = _backend(H200)
    _, params = resolve_call(q, True, None, 0.0, "reference")
    out, stats, state = backend.forward(q, k, v, params)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    want = backend.backward(dout, q, k, v, out, stats, state, params)
    other = lambda x: x.transpose(0, 1).contiguous().transpose(0, 1)  # noqa: E731  same values, sbhd memory
    got = backend.backward(other(dout), q, k, v, other(out), stats, state, params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    assert [name for name, _ in double.calls] == [
        "cudnn_forward",
        "cudnn_backward",
        "cudnn_backward",
    ]
