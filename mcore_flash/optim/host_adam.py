"""The host optimizer step with narrower Adam moments: ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``.

megatron-core's offloaded optimizer (``HybridDeviceOptimizer``, :mod:`mcore_flash.training.offload`)
steps the host's share with torch's ``AdamW``, whose moments are fp32: 12 bytes of host memory
per parameter with the fp32 master copy. Megatron-LM's ``--exp-avg-dtype`` /
``--exp-avg-sq-dtype`` narrow them, but megatron-core passes those dtypes only to Transformer
Engine's ``FusedAdam`` (``optimizer/__init__.py``), which neither the NPU nor the CPU has.
:class:`HostAdamW` is that step for the host: torch's own AdamW arithmetic
(``torch.optim.adam.adam``, decoupled weight decay, the kernel the group asks for) in fp32, on
moments *stored* in the group's ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (fp32 or bf16,
:data:`MOMENT_DTYPES`).

Invariants: with fp32 storage it *is* torch's AdamW, bit for bit; a bf16 moment is stored by
stochastic rounding, the fp32 one in expectation (numerics and memory: :class:`HostAdamW`);
its random bits are a function of what a checkpoint keeps (:func:`_rounding_bits`), so equal
optimizers fed equal gradients store equal moments and a run resumed from a state dict
continues bit for bit. Usage and evidence: docs/pretrain.md, "Optimizer offload".
"""

from __future__ import annotations

import numpy as np
import torch
from torch.optim.adam import adam

__all__ = ["HostAdamW", "MOMENT_DTYPES"]

# the storage dtypes of Adam's moments this step takes (Megatron-LM's names)
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _rounding_bits(index: int, shape: torch.Size, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The random low 16 bits (int32 in [0, 2**16), ``shape``) of ``exp_avg`` and of
    ``exp_avg_sq``: Philox keyed by the parameter's ``index`` and number of elements, its
    counter's second word ``step``: disjoint blocks of the cipher for every (parameter, step).

    Per parameter and step, 16 bits for each element of each bf16 moment, from Philox
    (numpy's counter-based generator) keyed by the parameter's position in the param groups
    (counted over all groups) and its number of elements, its counter set by the parameter's
    step count (after the update): a function of what a checkpoint keeps, independent of any
    global random state, and a stream of its own for every (parameter, step). So equal
    optimizers fed equal gradients store equal moments, and a run resumed from a state dict
    continues bit for bit."""
    numel = shape.numel()
    cipher = np.random.Philox(key=index + (numel << 64), counter=step << 64)
    words = cipher.random_raw((numel + 1) // 2).view(np.int32)[:numel]
    words = torch.from_numpy(words).view(shape)
    return (words >> 16).bitwise_and_(0xFFFF), words & 0xFFFF


def _store_rounded(stored: torch.Tensor, value: torch.Tensor, bits: torch.Tensor) -> None:
    """``stored`` (bf16) := ``value`` (fp32, overwritten) rounded stochastically with ``bits``
    added below bf16's; fp32 ``stored`` is ``value`` itself (widening it made no copy)."""
    if stored.dtype == torch.float32:
        return
    word = value.view(torch.int32)  # sign and magnitude: adding raises the magnitude
    word.add_(bits).bitwise_and_(-(1 << 16))  # bf16's bits only: the copy below is exact
    stored.copy_(value)


def _narrow(state: dict, group: dict) -> None:
    """``state``'s moments in ``group``'s storage dtypes (a loader may hand them back fp32:
    torch's ``load_state_dict``, megatron's checkpoint load; the values are the same)."""
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = state[key].to(group[f"{key}_dtype"])


class HostAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``exp_avg`` / ``exp_avg_sq`` are stored in each param group's
    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (:data:`MOMENT_DTYPES`' values; constructor
    defaults: fp32) and widened to fp32 for the update, bf16 ones stored by stochastic rounding.
    Parameters are fp32 (the master copies); no amsgrad, no maximize.

    Numerics, per parameter and step: the stored moments are widened to fp32, torch's AdamW
    update runs on them and on the fp32 master parameter exactly as with fp32 moments, and a
    bf16 moment is stored with *stochastic rounding*: one of the two bf16 values around the
    fp32 one, the upper (in magnitude) with probability equal to the fp32 value's distance
    from the lower over their gap (16 uniform random bits added to the fp32 word's low 16,
    which are then cut: :func:`_store_rounded`), so the stored moment is the fp32 one in
    expectation. Rounding to nearest would lose every update smaller than half a bf16 unit:
    with beta2 = 0.999 the second moment then stops following a falling gradient. With fp32
    storage it *is* torch's AdamW, bit for bit.

    Memory: one parameter's fp32 moments and random bits exist at a time, so the host holds
    the narrow state (2 bytes a bf16 moment) plus one parameter's widening (4 bytes an element
    a moment) and bits (12 bytes an element); moments a loader handed back wider (fp32) are
    stored narrow again by :meth:`HostAdamW.load_state_dict`, or at their next step when a
    loader set the state directly.
    """

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
            for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
                if group[key] not in MOMENT_DTYPES.values():
                    raise ValueError(f"HostAdamW stores {key} in fp32 or bf16, not {group[key]}")

    def load_state_dict(self, state_dict) -> None:
        """torch's load, which widens the moments to the parameters' fp32, then every moment
        stored in its group's dtype again at once (not at its next step)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for param in group["params"]:
                if self.state.get(param):
                    _narrow(self.state[param], group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, dtype=group["exp_avg_dtype"])
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=group["exp_avg_sq_dtype"])
                _narrow(state, group)  # a loader that set the state directly left them wider
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
                if torch.bfloat16 in (group["exp_avg_dtype"], group["exp_avg_sq_dtype"]):
                    bits = _rounding_bits(index, param.shape, int(state["step"]))
                    _store_rounded(state["exp_avg"], exp_avg, bits[0])
                    _store_rounded(state["exp_avg_sq"], exp_avg_sq, bits[1])
        return loss
