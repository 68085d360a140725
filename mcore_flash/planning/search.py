"""Layout search: every TP x PP x CP (x interleaving) x recompute choice that fits, ranked.

Ranking (best first): layouts that leave at least ``safety_margin`` (default 5%) of the
device free before tight ones (the transient buffers and the runtime reserve are
estimates); then the predicted step time on the hardware profile (:mod:`.step_time`:
compute with recompute, exposed TP / CP-ring / PP / DP communication, the pipeline
bubble); then less communication (smaller CP, PP, TP), then more free memory. The step-time
model's exposed ring time replaces the former rule of thumb that ring CP needs >= 8K
tokens per rank.

The memory ladder: each layout is tried with each recompute mode (flash attention alone,
then recompute, "recompute just enough" included); one that still does not fit climbs to
ZeRO-3, Megatron-FSDP with each of ``fsdp_choices`` (``optim_grads_params``,
``optim_grads``) over its ``dp * cp > 1`` ranks: by default (``climb="needed"``) only when
no layout of the device count fits on the lower rungs, full recompute included (a search
whose ``recompute_choices`` leave out ``full`` has not finished the recompute rung and does
not climb), with ``climb="each"`` for every layout that does not. ``Candidate.rung`` says which rung it needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Optional, Sequence

from .activations import RECOMPUTE_MODES
from .fsdp import PLANNED_STRATEGIES
from .hardware import DEFAULT_HARDWARE, HARDWARE_PROFILES, HardwareProfile
from .layout import Layout
from .memory import MemoryPlan, plan_memory
from .models import ModelShape
from .step_time import StepTime, predict_step_time

__all__ = ["Candidate", "search_layouts", "default_global_batch_size", "SEARCH_RECOMPUTE_MODES"]

DEFAULT_TOKENS_PER_STEP = 4 * 2**20  # Llama-2's 4M-token batches
# what --search tries (and --recompute accepts): our modes; Megatron's stock core_attention
# recompute saves nothing with a fused kernel (README "Recompute")
SEARCH_RECOMPUTE_MODES = tuple(mode for mode in RECOMPUTE_MODES if mode != "core_attention")


@dataclass
class Candidate:
    """A layout the search found: its memory plan and its predicted step time."""

    plan: MemoryPlan
    step: StepTime

    @property
    def rung(self) -> str:
        """The memory-ladder rung the layout needed (:attr:`.layout.Layout.rung`)."""
        return self.plan.layout.rung

    def to_dict(self) -> dict:
        return {**self.plan.to_dict(), "rung": self.rung, "step_time": self.step.to_dict()}


def default_global_batch_size(
    seq_length: int, micro_batch_size: int = 1, dp: int = 1, tokens: int = DEFAULT_TOKENS_PER_STEP
) -> int:
    """Sequences per step for ``tokens`` tokens, rounded up to a multiple of ``micro_batch_size * dp``."""
    unit = micro_batch_size * dp
    sequences = max(1, -(-tokens // seq_length))
    return -(-sequences // unit) * unit


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def search_layouts(
    model: ModelShape,
    seq_length: int,
    num_devices: int,
    device_memory: int,
    *,
    micro_batch_size: int = 1,
    global_batch_size: Optional[int] = None,
    tp_choices: Optional[Iterable[int]] = None,
    pp_choices: Optional[Iterable[int]] = None,
    cp_choices: Optional[Iterable[int]] = None,
    vp_choices: Sequence[int] = (1,),
    recompute_choices: Sequence[str] = SEARCH_RECOMPUTE_MODES,
    max_tp: int = 8,
    sequence_parallel: bool = True,
    distributed_optimizer: bool = True,
    include_non_fitting: bool = False,
    partial_recompute: bool = True,
    safety_margin: float = 0.05,
    fsdp_choices: Sequence[str] = PLANNED_STRATEGIES,
    climb: str = "needed",
    hardware: HardwareProfile = HARDWARE_PROFILES[DEFAULT_HARDWARE],
    step_options: Optional[dict] = None,
    **plan_kwargs,
) -> list[Candidate]:
    """All layouts of ``num_devices`` devices that fit ``device_memory`` (bytes), best first.

    TP defaults to the divisors of the query-group count up to ``max_tp`` (one node),
    PP to the divisors of the layer count, CP to powers of two; DP takes the remaining
    devices. ``global_batch_size`` defaults to about 4M tokens per step.
    Layouts leaving less than ``safety_margin`` of the memory free are ranked after the
    others. With ``partial_recompute`` a selective mode that does not fit is retried with
    the fewest layers per pipeline chunk recomputed whole that make it fit
    (``Layout.recompute_num_layers``: recompute just enough); one that still does not fit is
    retried with each Megatron-FSDP strategy of ``fsdp_choices`` (when ``dp * cp > 1``; empty:
    never), again with just enough partial recompute if needed: with ``climb="needed"`` (the
    ladder) only when no layout fits without ZeRO-3, with ``climb="each"`` for every layout
    that does not fit without it. ``hardware`` and ``step_options``
    (keywords of :func:`predict_step_time`: ``tp_comm_overlap`` ...) drive the step time;
    ``plan_kwargs`` go to :func:`plan_memory` (``profile``, ``runtime_reserve``,
    ``mean_document_length`` ...).
    """
    step_kwargs = {
        "mean_document_length": plan_kwargs.get("mean_document_length"),
        **(step_options or {}),
    }
    tps = (
        list(tp_choices)
        if tp_choices
        else [
            t
            for t in _divisors(model.num_query_groups)
            if t <= max_tp and model.num_attention_heads % t == 0
        ]
    )
    pps = (
        list(pp_choices)
        if pp_choices
        else [p for p in _divisors(model.num_layers) if p <= num_devices]
    )
    cps = (
        list(cp_choices)
        if cp_choices
        else [c for c in _powers_of_two(num_devices) if seq_length % (2 * c) == 0 or c == 1]
    )

    def run(choices: Sequence[str]) -> list[Candidate]:
        """Every layout, climbing to the FSDP strategies ``choices`` where needed."""
        found = []
        for tp in tps:
            for pp in pps:
                for cp in cps:
                    if num_devices % (tp * pp * cp):
                        continue
                    dp = num_devices // (tp * pp * cp)
                    if cp > 1 and seq_length % (2 * cp):
                        continue
                    if sequence_parallel and tp > 1 and (seq_length // cp) % tp:
                        continue
                    gbs = global_batch_size or default_global_batch_size(
                        seq_length, micro_batch_size, dp
                    )
                    if gbs % (micro_batch_size * dp):
                        continue
                    for vp in vp_choices:
                        if vp > 1 and (
                            pp == 1
                            or model.num_layers % (pp * vp)
                            or (gbs // (micro_batch_size * dp)) % pp
                        ):
                            continue
                        for recompute in recompute_choices:
                            layout = Layout(
                                tp=tp,
                                pp=pp,
                                cp=cp,
                                dp=dp,
                                vp=vp,
                                sequence_parallel=sequence_parallel,
                                recompute=recompute,
                                micro_batch_size=micro_batch_size,
                                global_batch_size=gbs,
                                distributed_optimizer=distributed_optimizer,
                            )
                            for plan in _climb(
                                model,
                                seq_length,
                                layout,
                                device_memory,
                                partial_recompute,
                                choices,
                                plan_kwargs,
                            ):
                                if plan.fits and plan.headroom < safety_margin * device_memory:
                                    plan.notes.append(
                                        f"tight: less than {safety_margin:.0%} of the device memory left free"
                                    )
                                if plan.fits or include_non_fitting:
                                    step = predict_step_time(
                                        model,
                                        seq_length,
                                        plan.layout,
                                        hardware,
                                        dtype_bytes=plan.dtype_bytes,
                                        **step_kwargs,
                                    )
                                    found.append(Candidate(plan, step))
        return found

    found = run(() if climb == "needed" else fsdp_choices)
    exhausted = "full" in recompute_choices  # the recompute rung's last step was tried
    if climb == "needed" and fsdp_choices and exhausted and not any(c.plan.fits for c in found):
        found = run(fsdp_choices)  # nothing fits below ZeRO-3: climb
    found.sort(key=lambda candidate: rank_key(candidate, safety_margin))
    return found


def _fitting(plan: MemoryPlan, partial_recompute: bool, plan_kwargs: dict) -> MemoryPlan:
    """``plan``, or when it does not fit and may, its least partial recompute that fits."""
    if not plan.fits and partial_recompute and plan.layout.recompute != "full":
        return _least_partial_recompute(plan, plan_kwargs) or plan
    return plan


def _climb(
    model: ModelShape,
    seq_length: int,
    layout: Layout,
    device_memory: int,
    partial_recompute: bool,
    fsdp_choices: Sequence[str],
    plan_kwargs: dict,
) -> list[MemoryPlan]:
    """The plans of ``layout`` up the ladder: itself (with just enough partial recompute);
    if that does not fit, one plan per FSDP strategy of ``fsdp_choices`` (dp x cp > 1),
    each with just enough partial recompute, keeping the non-fitting first plan only when
    no strategy fits either."""
    plan = _fitting(
        plan_memory(model, seq_length, layout, device_memory=device_memory, **plan_kwargs),
        partial_recompute,
        plan_kwargs,
    )
    if (
        plan.fits
        or layout.sharding_ranks == 1
        or layout.fsdp is not None
        or not layout.distributed_optimizer
    ):
        return [plan]
    sharded = [
        _fitting(
            plan_memory(
                model,
                seq_length,
                replace(layout, fsdp=strategy),
                device_memory=device_memory,
                **plan_kwargs,
            ),
            partial_recompute,
            plan_kwargs,
        )
        for strategy in fsdp_choices
    ]
    fitting = [p for p in sharded if p.fits]
    return fitting or [plan]


def _least_partial_recompute(plan: MemoryPlan, plan_kwargs: dict) -> Optional[MemoryPlan]:
    """The fitting plan with the fewest layers per chunk recomputed whole (bytes fall as
    that number grows: bisection), or None if even all but one do not fit."""
    lay = plan.layout
    best, low, high = None, 1, lay.chunk_layers(plan.model.num_layers) - 1
    while low <= high:
        mid = (low + high) // 2
        candidate = plan_memory(
            plan.model,
            plan.seq_length,
            replace(lay, recompute_num_layers=mid),
            device_memory=plan.device_memory,
            **plan_kwargs,
        )
        if candidate.fits:
            best, high = candidate, mid - 1
        else:
            low = mid + 1
    return best


def rank_key(candidate: Candidate, safety_margin: float = 0.05):
    """Sort key: tight?, predicted step time (ms), cp, pp, tp, -headroom."""
    plan, lay = candidate.plan, candidate.plan.layout
    tight = (
        plan.device_memory is not None and (plan.headroom or 0) < safety_margin * plan.device_memory
    )
    return (
        tight,
        round(candidate.step.step_time_s, 3),
        lay.cp,
        lay.pp,
        lay.tp,
        -(plan.headroom or 0),
    )
