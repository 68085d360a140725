"""Layout search: every TP x PP x CP (x interleaving) x recompute choice that fits, ranked.

Ranking (best first): layouts whose ring context parallelism can hide its communication
(>= 8K tokens per CP rank) before those that cannot; layouts that leave at least
``safety_margin`` (default 5%) of the device free before tight ones (the transient buffers
and the runtime reserve are estimates); then the estimated relative step
time ``(1 + recompute FLOPs) * (1 + pipeline bubble)`` (:mod:`.flops`); then less
communication (smaller CP, PP, TP), then more free memory.
"""

from __future__ import annotations

import shlex
from typing import Iterable, Optional, Sequence

from .models import get_model
from .planner import RECOMPUTE_FLAGS, Layout, MemoryPlan, plan_memory
from .units import parse_bytes

__all__ = ["search_layouts", "launch_command", "default_global_batch_size", "CP_MIN_TOKENS"]

CP_MIN_TOKENS = 8192
DEFAULT_TOKENS_PER_STEP = 4 * 2**20  # Llama-2's 4M-token batches


def default_global_batch_size(seq_length: int, micro_batch_size: int = 1, dp: int = 1, tokens: int = DEFAULT_TOKENS_PER_STEP) -> int:
    """Sequences per step for ``tokens`` tokens, rounded up to a multiple of ``micro_batch_size * dp``."""
    unit = micro_batch_size * dp
    sequences = max(1, -(-tokens // seq_length))
    return -(-sequences // unit) * unit


def launch_command(plan: MemoryPlan, program: str = "mcore-flash pretrain") -> str:
    """The ``mcore-flash pretrain`` command line (Megatron-LM flag names) for ``plan``'s layout."""
    lay = plan.layout
    args = [
        "--model",
        plan.model.name,
        "--seq-length",
        str(plan.seq_length),
        "--micro-batch-size",
        str(lay.micro_batch_size),
    ]
    if lay.global_batch_size is not None:
        args += ["--global-batch-size", str(lay.global_batch_size)]
    args += [
        "--tensor-model-parallel-size",
        str(lay.tp),
        "--pipeline-model-parallel-size",
        str(lay.pp),
        "--context-parallel-size",
        str(lay.cp),
    ]
    if lay.vp > 1:
        args += ["--num-layers-per-virtual-pipeline-stage", str(plan.model.num_layers // (lay.pp * lay.vp))]
    if lay.sp:
        args.append("--sequence-parallel")
    if lay.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if plan.mean_document_length is not None:  # the plan assumes document masking
        args += ["--reset-attention-mask", "--reset-position-ids"]
    if lay.recompute == "core_attention":
        args += ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    else:
        args += RECOMPUTE_FLAGS[lay.recompute]
    args.append("--bf16" if plan.dtype_bytes == 2 else "--fp32")
    return " ".join([program] + [shlex.quote(a) for a in args])


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def search_layouts(
    model,
    seq_length: int,
    num_devices: int,
    device_memory,
    *,
    micro_batch_size: int = 1,
    global_batch_size: Optional[int] = None,
    tp_choices: Optional[Iterable[int]] = None,
    pp_choices: Optional[Iterable[int]] = None,
    cp_choices: Optional[Iterable[int]] = None,
    vp_choices: Sequence[int] = (1,),
    recompute_choices: Sequence[str] = ("none", "attention", "full"),
    max_tp: int = 8,
    sequence_parallel: bool = True,
    distributed_optimizer: bool = True,
    include_non_fitting: bool = False,
    safety_margin: float = 0.05,
    **plan_kwargs,
) -> list[MemoryPlan]:
    """All layouts of ``num_devices`` devices that fit ``device_memory``, best first.

    TP defaults to the divisors of the query-group count up to ``max_tp`` (one node),
    PP to the divisors of the layer count, CP to powers of two; DP takes the remaining
    devices. ``global_batch_size`` defaults to about 4M tokens per step.
    Layouts leaving less than ``safety_margin`` of the memory free are ranked after the
    others. ``plan_kwargs`` go to :func:`plan_memory` (``profile``, ``runtime_reserve`` ...).
    """
    m = get_model(model)
    capacity = parse_bytes(device_memory)
    tps = list(tp_choices) if tp_choices else [t for t in _divisors(m.num_query_groups) if t <= max_tp and m.num_attention_heads % t == 0]
    pps = list(pp_choices) if pp_choices else [p for p in _divisors(m.num_layers) if p <= num_devices]
    cps = list(cp_choices) if cp_choices else [c for c in _powers_of_two(num_devices) if seq_length % (2 * c) == 0 or c == 1]
    plans = []
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
                gbs = global_batch_size or default_global_batch_size(seq_length, micro_batch_size, dp)
                if gbs % (micro_batch_size * dp):
                    continue
                for vp in vp_choices:
                    if vp > 1 and (pp == 1 or m.num_layers % (pp * vp) or (gbs // (micro_batch_size * dp)) % pp):
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
                        plan = plan_memory(m, seq_length, layout, device_memory=capacity, **plan_kwargs)
                        if plan.fits and plan.headroom < safety_margin * capacity:
                            plan.notes.append(
                                f"tight: less than {safety_margin:.0%} of the device memory left free"
                            )
                        if plan.fits or include_non_fitting:
                            plans.append(plan)
    plans.sort(key=lambda plan: rank_key(plan, safety_margin))
    return plans


def rank_key(plan: MemoryPlan, safety_margin: float = 0.05):
    """Sort key: CP exposed?, tight?, relative step time, cp, pp, tp, -headroom."""
    lay = plan.layout
    cp_exposed = lay.cp > 1 and plan.seq_length // lay.cp < CP_MIN_TOKENS
    tight = plan.device_memory is not None and (plan.headroom or 0) < safety_margin * plan.device_memory
    return (
        cp_exposed,
        tight,
        round(plan.relative_step_time, 6),
        lay.cp,
        lay.pp,
        lay.tp,
        -(plan.headroom or 0),
    )
