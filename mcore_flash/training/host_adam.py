"""The host optimizer step with narrower Adam moments: ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``.

megatron-core's offloaded optimizer (``HybridDeviceOptimizer``, :mod:`.offload`) steps the host's
share with torch's ``AdamW``, whose moments are fp32: 12 bytes of host memory per parameter with
the fp32 master copy. Megatron-LM's ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` narrow them,
but megatron-core passes those dtypes only to Transformer Engine's ``FusedAdam``
(``optimizer/__init__.py``), which neither the NPU nor the CPU has. :class:`HostAdamW` is that
step for the host: torch's own AdamW arithmetic (``torch.optim.adam.adam``, decoupled weight
decay, the kernel the group asks for) in fp32, on moments *stored* in the group's
``exp_avg_dtype`` / ``exp_avg_sq_dtype``.

Numerics, per parameter and step: the stored moments are widened to fp32, torch's AdamW update
runs on them and on the fp32 master parameter exactly as with fp32 moments, and the new moments
are rounded to their storage dtype (round to nearest even) - what TE's ``FusedAdam`` does with
bf16 ``exp_avg_dtype``. With fp32 storage it *is* torch's AdamW, bit for bit. One parameter's
fp32 moments exist at a time, so the host holds the narrow state plus one parameter's widening.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

__all__ = ["HostAdamW", "MOMENT_DTYPES"]

# the storage dtypes of Adam's moments this step takes (Megatron-LM's names)
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class HostAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``exp_avg`` / ``exp_avg_sq`` are stored in each param group's
    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (constructor defaults: fp32) and widened to fp32
    for the update. Parameters are fp32 (the master copies); no amsgrad, no maximize."""

    def __init__(
        self,
        params,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        **kwargs,
    ):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            group.setdefault("exp_avg_dtype", exp_avg_dtype)
            group.setdefault("exp_avg_sq_dtype", exp_avg_sq_dtype)
            if group["amsgrad"] or group["maximize"]:
                raise ValueError(
                    "HostAdamW steps plain AdamW: amsgrad and maximize are not supported"
                )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, dtype=group["exp_avg_dtype"])
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=group["exp_avg_sq_dtype"])
                exp_avg = state["exp_avg"].float()  # the stored tensor itself when fp32
                exp_avg_sq = state["exp_avg_sq"].float()
                adam(
                    [param],
                    [param.grad],
                    [exp_avg],
                    [exp_avg_sq],
                    [],
                    [state["step"]],
                    foreach=False,
                    capturable=False,
                    differentiable=False,
                    fused=bool(group.get("fused")),
                    grad_scale=None,
                    found_inf=None,
                    has_complex=False,
                    decoupled_weight_decay=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
                state["exp_avg"].copy_(exp_avg)  # rounds to the storage dtype (no-op for fp32)
                state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss
