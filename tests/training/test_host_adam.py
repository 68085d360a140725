"""The host step with narrower Adam moments (``mcore_flash.training.host_adam.HostAdamW``).

Oracles: torch's own ``AdamW`` (fp32 moments: the same step bit for bit, its fused kernel as
megatron-core builds it and the single-tensor loop) and float64 math of AdamW whose moments
are stored in bf16 (each step from the state the class holds: the update in float64, the new
moments rounded to bf16 once). The class computes in fp32, so its parameters may differ from
float64 by fp32 rounding (a few units of 2**-24 relative: 1e-6 allowed); its stored moments
equal float64's rounded to nearest bf16, but within 2**-20 of a tie, where fp32's rounding may
tip them by one unit in bf16's last place.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_flash.training.host_adam import HostAdamW

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = [(64, 48), (300,)]


def _grads(steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(steps)]


def _params(seed: int = 1) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


@pytest.mark.parametrize("fused", [False, True])
def test_fp32_moments_step_as_torchs_adamw_bit_for_bit(fused):
    ours, theirs = _params(), _params()
    host = HostAdamW(ours, fused=fused, **HYPER)
    torch_adamw = torch.optim.AdamW(theirs, fused=fused, foreach=False, **HYPER)
    for grads in _grads(5):
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        host.step()
        torch_adamw.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(host.state[p][key], torch_adamw.state[q][key]), key


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 (8 significant bits) at each value of ``x``."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_moments_step_as_float64_adamw_with_bf16_storage(fused):
    lr, (beta1, beta2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]
    params = _params()
    host = HostAdamW(
        params,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
        fused=fused,
        **HYPER,
    )
    for step, grads in enumerate(_grads(6), start=1):
        before = []
        for p, g in zip(params, grads):
            state = host.state.get(p, {})
            m = state["exp_avg"].double() if state else torch.zeros(p.shape, dtype=torch.float64)
            v = state["exp_avg_sq"].double() if state else torch.zeros(p.shape, dtype=torch.float64)
            before.append((p.detach().double().clone(), m, v))
            p.grad = g.clone()
        host.step()
        for p, g, (p64, m, v) in zip(params, grads, before):
            g64 = g.double()
            m = beta1 * m + (1 - beta1) * g64
            v = beta2 * v + (1 - beta2) * g64 * g64
            denom = v.sqrt() / math.sqrt(1 - beta2**step) + eps
            want = p64 * (1 - lr * wd) - lr / (1 - beta1**step) * m / denom
            state = host.state[p]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
            assert float(state["step"]) == step
            assert torch.allclose(p.detach().double(), want, rtol=1e-6, atol=1e-9), step
            for stored, exact in ((state["exp_avg"], m), (state["exp_avg_sq"], v)):
                rounded = exact.to(torch.bfloat16).double()  # nearest, ties to even
                ulp = _bf16_ulp(exact)
                # fp32's rounding (~2**-24 relative) can change the rounding only near a tie
                near_tie = ((exact - rounded).abs() - ulp / 2).abs() <= 2.0**-20 * exact.abs()
                off = (stored.double() - rounded).abs()
                assert bool((off[~near_tie] == 0).all()), step
                assert bool((off[near_tie] <= ulp[near_tie]).all()), step


def test_bf16_moments_take_half_the_bytes_of_fp32_ones():
    params = _params()
    host = HostAdamW(params, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for p, g in zip(params, _grads(1)[0]):
        p.grad = g
    host.step()
    elements = sum(p.numel() for p in params)
    moment_bytes = sum(
        t.numel() * t.element_size()
        for state in host.state.values()
        for key, t in state.items()
        if key != "step"
    )
    assert moment_bytes == 2 * 2 * elements


def test_amsgrad_is_refused_by_name():
    with pytest.raises(ValueError, match="amsgrad"):
        HostAdamW(_params(), amsgrad=True)
