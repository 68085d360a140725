"""What one attention call keeps alive for backward: O(s), never an [sq, sk] matrix.

Everything autograd saves goes through ``torch.autograd.graph.saved_tensors_hooks``; the
pack hook records each saved tensor's shape and its storage (counted once per storage,
by ``untyped_storage().data_ptr()``, at the storage's full size -- a view keeps its whole
buffer alive). Forward only: backward is not run.
"""

from __future__ import annotations

import pytest
import torch

from mcore_flash.ops import flash_attn_func, flash_attn_varlen_func
from mcore_flash.ops.backends import ENV_VAR
from mcore_flash.ops.backends.reference import ReferenceBackend

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("reference", id="reference"),
    pytest.param(ReferenceBackend(block_q=64, block_k=128), id="reference-b64x128"),
]


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def _nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(fn, *inputs):
    """Run ``fn(*inputs)`` (inputs made leaves requiring grad) and record what is saved."""
    inputs = tuple(x.detach().requires_grad_(True) for x in inputs)
    storages: dict[int, int] = {}
    shapes: list[tuple[int, ...]] = []

    def pack(t):
        shapes.append(tuple(t.shape))
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*inputs)
    out, lse = result
    assert out.requires_grad and out.grad_fn is not None, "nothing recorded for backward"
    return sum(storages.values()), shapes, inputs, out, lse


def _dense(backend, s, h=8, hkv=None, d=64, dtype=torch.float32, **kwargs):
    hkv = hkv or h
    g = torch.Generator().manual_seed(s)
    q = torch.randn(1, s, h, d, generator=g).to(dtype)
    k = torch.randn(1, s, hkv, d, generator=g).to(dtype)
    v = torch.randn(1, s, hkv, d, generator=g).to(dtype)
    return _measure(
        lambda q, k, v: flash_attn_func(
            q, k, v, causal=True, backend=backend, return_lse=True, **kwargs
        ),
        q,
        k,
        v,
    )


def _check_bounds(saved, shapes, inputs, out, lse, sq, sk):
    q, k, v = inputs
    essential = _nbytes(q, k, v, out)
    # backward needs q, k, v, out and lse: if less is seen, the hooks saw nothing useful
    assert saved >= essential + _nbytes(lse), (
        f"saved {saved} B < q+k+v+out+lse; hooks not effective?"
    )
    big = [shape for shape in shapes if torch.Size(shape).numel() >= sq * sk]
    assert not big, f"saved tensors with >= sq*sk = {sq * sk} elements: {big}"
    bound = 1.05 * essential + _nbytes(lse)
    assert saved <= bound, (
        f"saved {saved} B > 1.05*(q+k+v+out) + lse = {bound:.0f} B; shapes {shapes}"
    )


@pytest.mark.parametrize(
    "backend,h",
    [pytest.param("cpu", 8, id="cpu-h8"), pytest.param("reference", 2, id="reference-h2")],
)
def test_saved_tensors_are_linear_in_seqlen(backend, h):
    """b=1, d=64, causal, fp32: s = 1K .. 8K; each doubling doubles saved bytes (+-5%).

    h=8 on cpu; h=2 for the pure-PyTorch reference kernel to keep its O(s^2) forward cheap
    (what is saved is linear in h either way).
    """
    sizes = [1024, 2048, 4096, 8192]
    saved = []
    for s in sizes:
        nbytes, shapes, inputs, out, lse = _dense(backend, s, h=h)
        _check_bounds(nbytes, shapes, inputs, out, lse, s, s)
        saved.append(nbytes)
        del inputs, out, lse
    ratios = [b / a for a, b in zip(saved, saved[1:])]
    assert all(1.9 <= r <= 2.1 for r in ratios), (
        f"saved bytes {saved}, ratios per doubling {ratios}"
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gqa_keeps_kv_unexpanded(backend, dtype):
    """hq=8, hkv=1: K/V saved at their own (8x smaller) size, not repeated per query head."""
    nbytes, shapes, inputs, out, lse = _dense(backend, 1024, h=8, hkv=1, dtype=dtype)
    _check_bounds(nbytes, shapes, inputs, out, lse, 1024, 1024)
    assert lse.dtype == torch.float32 and out.dtype == dtype


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_saves_no_mask(backend):
    """With dropout the mask is replayed from a seed, not saved."""
    nbytes, shapes, inputs, out, lse = _dense(backend, 1024, h=2, dropout_p=0.1)
    _check_bounds(nbytes, shapes, inputs, out, lse, 1024, 1024)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_mask_call_saves_no_score_matrix(backend):
    """With attn_mask the additive float mask / scores are not kept for backward.

    (The caller's own bool mask is referenced, not saved: it does not go through the hooks.)
    """
    mask = torch.zeros(1, 1, 1024, 1024, dtype=torch.bool)
    mask[..., ::7] = True
    nbytes, shapes, inputs, out, lse = _dense(backend, 1024, h=2, attn_mask=mask)
    _check_bounds(nbytes, shapes, inputs, out, lse, 1024, 1024)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_saved_tensors(backend):
    lengths = [1000, 24, 1000]
    cu = torch.tensor([0, 1000, 1024, 2024], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2024, 4, 64, generator=g) for _ in range(3))
    nbytes, shapes, inputs, out, lse = _measure(
        lambda q, k, v: flash_attn_varlen_func(
            q,
            k,
            v,
            cu,
            cu,
            max(lengths),
            max(lengths),
            causal=True,
            backend=backend,
            return_lse=True,
        ),
        q,
        k,
        v,
    )
    assert lse.shape == (4, 2024)
    _check_bounds(nbytes, shapes, inputs, out, lse, 1000, 1000)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "extra",
    [
        dict(window_size=(256, 0)),
        dict(window_size=(100, 300)),
        dict(alibi_slopes="slopes"),
        dict(softcap=20.0),
    ],
    ids=["window-256", "window-100-300", "alibi", "softcap"],
)
def test_windows_alibi_and_softcap_save_exactly_what_plain_causal_saves(backend, dtype, extra):
    """No mask, bias or float32 copy is kept: the bytes equal the plain causal call's
    (q, k, v, out in the input dtype and the float32 lse)."""
    if extra.get("alibi_slopes") == "slopes":
        extra = dict(alibi_slopes=torch.rand(4))
    plain = _dense(backend, 1024, h=4, hkv=2, dtype=dtype)
    nbytes, shapes, inputs, out, lse = _dense(backend, 1024, h=4, hkv=2, dtype=dtype, **extra)
    _check_bounds(nbytes, shapes, inputs, out, lse, 1024, 1024)
    assert nbytes == plain[0] == _nbytes(*inputs, out, lse)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_qkvpacked_saves_the_packed_buffer_once(backend):
    """The packed forms hand the kernel views of ``qkv``: its one buffer is what stays alive."""
    from mcore_flash.ops import flash_attn_qkvpacked_func

    qkv = torch.randn(1, 1024, 3, 4, 64)
    nbytes, shapes, (leaf,), out, lse = _measure(
        lambda x: flash_attn_qkvpacked_func(
            x, 0.0, None, True, (256, 0), backend=backend, return_lse=True
        ),
        qkv,
    )
    assert nbytes == _nbytes(leaf, out, lse)
