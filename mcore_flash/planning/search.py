"""Layout search: every TP x PP x CP (x interleaving) x recompute choice that fits, ranked.

:func:`search_layouts` returns a :class:`Candidate` (a memory plan and its predicted step
time, :mod:`.step_time`) per fitting layout, best first (:func:`rank_key`: the predicted
step time, then less communication: smaller CP, PP, TP, then more free memory). A layout
fits when the device holds its worst stage with ``min_free_memory`` left free (a
:func:`plan_memory` keyword; the CLI's ``--min-free-memory``, default 5% of the capacity)
and, with host offload, the host its fullest node. A layout that does not fit climbs the
memory ladder (:data:`LADDER`: flash attention and recompute, ZeRO-3, sequence tiling,
host offload and its narrower state, weight streaming, each without and then with the
tiles), by default each
rung only when no layout of the device count fits below it (the climb:
:func:`search_layouts`, :mod:`.fitting`; docs/planner.md, "The ladder in ``--search``");
``Candidate.rung`` names the rung it needed. When nothing fits,
:func:`closest_offload` says by how much and what closes the gap; :func:`sensitivity` how
the prediction moves with each figure the hardware profile marks an assumption.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace
from typing import Callable, Iterable, Iterator, Optional, Sequence

from .activation_bytes import RECOMPUTE_MODES
from .fitting import climb_layout, knows_host, replanned
from .fsdp import PLANNED_STRATEGIES
from .hardware import DEFAULT_HARDWARE, HARDWARE_PROFILES, HardwareProfile
from .memory import plan_memory
from .models import ModelShape
from .parallel_layout import Layout
from .plans import MemoryPlan, launch_command
from .step_time import StepTime, predict_step_time
from .timeouts import RunTimeouts, run_timeouts
from .units import MiB

__all__ = [
    "Candidate",
    "search_layouts",
    "LADDER",
    "Rung",
    "default_global_batch_size",
    "SEARCH_RECOMPUTE_MODES",
    "LOSS_TILE_TOKENS",
    "tile_choices",
    "closest_offload",
    "sensitivity",
]

DEFAULT_TOKENS_PER_STEP = 4 * 2**20  # Llama-2's 4M-token batches
# what --search tries (and --recompute accepts): our modes; Megatron's stock core_attention
# recompute saves nothing with a fused kernel (README "Recompute")
SEARCH_RECOMPUTE_MODES = tuple(mode for mode in RECOMPUTE_MODES if mode != "core_attention")
# the tiled loss's tile on the ladder's tiling rungs (tokens): 32 tiles of a 128K sequence,
# GEMMs of [4096, h] x [h, V/tp]; the trainer's default (1024) saves 3/4 of a few hundred MiB
# more for four times the tiles and their collectives (docs/planner.md, "Sequence tiling")
LOSS_TILE_TOKENS = 4096


@dataclass
class Candidate:
    """A layout the search found: its memory plan and its predicted step time."""

    plan: MemoryPlan
    step: StepTime

    @property
    def rung(self) -> str:
        """The memory-ladder rung the layout needed (:attr:`.parallel_layout.Layout.rung`)."""
        return self.plan.layout.rung

    @property
    def timeouts(self) -> RunTimeouts:
        """The limits the layout launches with (:func:`.timeouts.run_timeouts`)."""
        return run_timeouts(self.step)

    @property
    def launch_command(self) -> str:
        """The plan's ``mcore-flash pretrain`` line with its ``--distributed-timeout-minutes``."""
        return launch_command(
            self.plan, distributed_timeout_minutes=self.timeouts.distributed_timeout_minutes
        )

    @property
    def launch_env(self) -> dict[str, str]:
        """The environment the launch exports: on HCCL, ``HCCL_BUFFSIZE`` (MB, what the plan's
        communicator buffers assume) and ``HCCL_EXEC_TIMEOUT`` (s)."""
        hardware = self.step.hardware
        if hardware.collective_library != "hccl":
            return {}
        return {
            "HCCL_BUFFSIZE": str(hardware.communicator_buffer_bytes // 2 // MiB),
            "HCCL_EXEC_TIMEOUT": str(self.timeouts.hccl_exec_timeout_s),
        }

    def to_dict(self) -> dict:
        return {
            **self.plan.to_dict(),
            "rung": self.rung,
            "step_time": self.step.to_dict(),
            "timeouts": asdict(self.timeouts),
            "launch_command": self.launch_command,
            "launch_env": self.launch_env,
        }


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
    overlap_grad_reduce: bool = True,
    include_non_fitting: bool = False,
    partial_recompute: bool = True,
    fsdp_choices: Sequence[str] = PLANNED_STRATEGIES,
    climb: str = "needed",
    offload: bool = True,
    bf16_gradients: bool = True,
    grad_reduce_in_bf16: bool = False,
    bf16_moments: bool = True,
    host_moment_dtype: str = "fp32",
    sequence_tiling: bool = True,
    streaming: bool = True,
    loss_chunk_size: Optional[int] = None,
    mlp_chunk_size: Optional[int] = None,
    hardware: HardwareProfile = HARDWARE_PROFILES[DEFAULT_HARDWARE],
    step_options: Optional[dict] = None,
    **plan_kwargs,
) -> list[Candidate]:
    """All layouts of ``num_devices`` devices that fit ``device_memory`` (bytes), best first.

    TP defaults to the divisors of the query-group count up to ``max_tp`` (one node),
    PP to the divisors of the layer count, CP to powers of two; DP takes the remaining
    devices. ``global_batch_size`` defaults to about 4M tokens per step.
    With ``partial_recompute`` a selective mode that does not fit is retried with
    the fewest layers per pipeline chunk recomputed whole that make it fit
    (``Layout.recompute_num_layers``: recompute just enough); one that still does not fit is
    retried with each Megatron-FSDP strategy of ``fsdp_choices`` (when ``dp * cp > 1``; empty:
    never), again with just enough partial recompute if needed: with ``climb="needed"`` (the
    ladder) only when no layout fits without ZeRO-3, with ``climb="each"`` for every layout
    that does not fit without it; when nothing fits on ZeRO-3 either and ``offload``, every
    layout is retried with host offload (just enough), and when that fails too and
    ``bf16_gradients`` (with bf16 parameters and activations), with bf16 main gradients and
    host offload (just enough), and when that fails too and ``bf16_moments``, with bf16 host
    moments as well; with ``sequence_tiling`` the ladder tries the tiled loss and MLP
    (:func:`tile_choices`) once nothing fits on ZeRO-3, alone (with ZeRO-3 where needed) and
    then after each offload step has failed without them; when nothing fits there either and
    ``streaming``, every PP1 layout with its weights, gradients and optimizer state streamed
    from the host (``Layout.stream_weights``, fewest activation-offloaded layers first),
    untiled and then tiled; ``grad_reduce_in_bf16`` plans every
    layout with bf16 main gradients, ``host_moment_dtype`` every offloaded one with those
    moments, ``loss_chunk_size`` / ``mlp_chunk_size`` every layout with those tiles (tokens;
    layouts whose TP does not divide them under sequence parallelism are left out, and the
    tiling rungs are not climbed), ``overlap_grad_reduce`` (``Layout.overlap_grad_reduce``)
    every layout. ``hardware`` and ``step_options``
    (keywords of :func:`predict_step_time`: ``tp_comm_overlap`` ...) drive the step time;
    ``plan_kwargs`` go to :func:`plan_memory` (``profile``, ``runtime_reserve``,
    ``mean_document_length`` ...). The rungs are :data:`LADDER`'s.
    """
    step_kwargs = {
        "mean_document_length": plan_kwargs.get("mean_document_length"),
        "activation_profile": plan_kwargs.get("profile", "npu"),
        **(step_options or {}),
    }
    tps, pps, cps = _parallel_sizes(
        model, seq_length, num_devices, tp_choices, pp_choices, cp_choices, max_tp
    )
    search = _Search(
        model=model,
        seq_length=seq_length,
        num_devices=num_devices,
        device_memory=device_memory,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        tps=tps,
        pps=pps,
        cps=cps,
        vp_choices=vp_choices,
        recompute_choices=recompute_choices,
        sequence_parallel=sequence_parallel,
        distributed_optimizer=distributed_optimizer,
        overlap_grad_reduce=overlap_grad_reduce,
        include_non_fitting=include_non_fitting,
        partial_recompute=partial_recompute,
        fsdp_choices=fsdp_choices,
        climb=climb,
        offload=offload,
        bf16_gradients=bf16_gradients,
        grad_reduce_in_bf16=grad_reduce_in_bf16,
        bf16_moments=bf16_moments,
        host_moment_dtype=host_moment_dtype,
        sequence_tiling=sequence_tiling,
        streaming=streaming,
        tiles=(loss_chunk_size, mlp_chunk_size),
        hardware=hardware,
        step_kwargs=step_kwargs,
        plan_kwargs={**plan_kwargs, "hardware": hardware},
    )
    found: list[Candidate] = []
    for step, rung in enumerate(LADDER):
        if step and any(c.plan.fits for c in found):
            break  # a lower rung fits: the ladder climbs no higher
        if not rung.climbable(search):
            if rung.optional:
                continue
            break
        found = _rung_candidates(search, rung)
    found.sort(key=rank_key)
    return found


@dataclass(frozen=True)
class _Search:
    """One search's choices: :func:`search_layouts`' arguments with the TP, PP and CP sizes
    it tries (``tps``, ``pps``, ``cps``), the keywords of its step-time predictions
    (``step_kwargs``) and of its plans (``plan_kwargs``, the hardware profile included)."""

    model: ModelShape
    seq_length: int
    num_devices: int
    device_memory: int
    micro_batch_size: int
    global_batch_size: Optional[int]
    tps: list[int]
    pps: list[int]
    cps: list[int]
    vp_choices: Sequence[int]
    recompute_choices: Sequence[str]
    sequence_parallel: bool
    distributed_optimizer: bool
    overlap_grad_reduce: bool
    include_non_fitting: bool
    partial_recompute: bool
    fsdp_choices: Sequence[str]
    climb: str
    offload: bool
    bf16_gradients: bool
    grad_reduce_in_bf16: bool
    bf16_moments: bool
    host_moment_dtype: str
    sequence_tiling: bool
    streaming: bool
    tiles: tuple[Optional[int], Optional[int]]  # the given (loss, MLP) tiles: every layout's
    hardware: HardwareProfile
    step_kwargs: dict
    plan_kwargs: dict

    @property
    def narrow(self) -> bool:
        """bf16 activations and parameters, which the narrower state (bf16 main gradients,
        bf16 host moments) needs."""
        return (
            self.plan_kwargs.get("dtype_bytes", 2) == 2
            and self.plan_kwargs.get("param_bytes", 2) == 2
        )

    @property
    def tiling_rungs(self) -> bool:
        """Whether the ladder's tiling rungs are climbed: asked for, and no tiles given."""
        return self.sequence_tiling and self.tiles == (None, None)


@dataclass(frozen=True)
class Rung:
    """One rung of the memory ladder: how the search plans every layout on it. A layout
    that does not fit is retried with each Megatron-FSDP strategy of the search's
    ``fsdp_choices`` (``fsdp``; on every rung with ``climb="each"``) or with its least host
    offload that fits (``host_offload``); ``bf16_gradients``: with bf16 main gradients where
    the search allows them, ``bf16_moments``: with bf16 host moments; ``tiling``: every
    layout with each of its :func:`tile_choices`; ``streaming``: every PP1 layout that does
    not fit with its weights streamed from the host (:func:`.fitting.least_streaming`).
    ``climbable``: whether a search may climb
    to it; ``optional``: when it may not, the next rung is still tried, else the climb ends
    there."""

    name: str
    climbable: Callable[[_Search], bool]
    fsdp: bool = False
    host_offload: bool = False
    bf16_gradients: bool = False
    bf16_moments: bool = False
    optional: bool = False
    tiling: bool = False
    streaming: bool = False


def _tiled(rung: Rung) -> Rung:
    """``rung`` with sequence tiling: climbed after it, where the search climbs tiling rungs."""
    return replace(
        rung,
        name=f"{rung.name}, sequence tiling",
        climbable=lambda search: rung.climbable(search) and search.tiling_rungs,
        optional=True,
        tiling=True,
    )


_OFFLOAD = Rung("offload", climbable=lambda search: search.offload, host_offload=True)
# the offload rung's narrower state: bf16 main gradients, then bf16 host moments as well
_BF16_GRADIENTS = Rung(
    "offload, bf16 main gradients",
    climbable=lambda search: (
        search.bf16_gradients and search.narrow and not search.grad_reduce_in_bf16
    ),
    host_offload=True,
    bf16_gradients=True,
    optional=True,
)
_BF16_MOMENTS = Rung(
    "offload, bf16 main gradients and host moments",
    climbable=lambda search: (
        search.bf16_moments and search.narrow and search.host_moment_dtype == "fp32"
    ),
    host_offload=True,
    bf16_gradients=True,
    bf16_moments=True,
    optional=True,
)
# weights, gradients and optimizer state on the host (Layout.stream_weights)
_STREAMING = Rung(
    "streaming",
    climbable=lambda search: search.offload and search.streaming,
    streaming=True,
    optional=True,
)

# the memory ladder, lowest first: the search climbs a rung only while no layout of the
# device count fits on the rung below (climb="needed")
LADDER = (
    # every search: flash attention alone, then each recompute mode (with just enough
    # partial recompute); with climb="each" a layout that does not fit also tries ZeRO-3
    Rung("flash attention, recompute", climbable=lambda search: True),
    # only with climb="needed", once the recompute rung has tried its last step (full)
    Rung(
        "ZeRO-3",
        climbable=lambda search: (
            search.climb == "needed"
            and bool(search.fsdp_choices)
            and "full" in search.recompute_choices
        ),
        fsdp=True,
    ),
    # the tiled loss and MLP before any host offload (with ZeRO-3 where a layout needs it)
    Rung(
        "sequence tiling",
        climbable=lambda search: search.tiling_rungs,
        fsdp=True,
        optional=True,
        tiling=True,
    ),
    # each offload step alone, then with the tiles: the tiles are the cheapest addition
    _OFFLOAD,
    _tiled(_OFFLOAD),
    _BF16_GRADIENTS,
    _tiled(_BF16_GRADIENTS),
    _BF16_MOMENTS,
    _tiled(_BF16_MOMENTS),
    # the model's state on the host, streamed unit by unit (PP1: FSDP2 + CPUOffloadPolicy)
    _STREAMING,
    _tiled(_STREAMING),
)


def _parallel_sizes(
    model: ModelShape,
    seq_length: int,
    num_devices: int,
    tp_choices: Optional[Iterable[int]],
    pp_choices: Optional[Iterable[int]],
    cp_choices: Optional[Iterable[int]],
    max_tp: int,
) -> tuple[list[int], list[int], list[int]]:
    """The TP, PP and CP sizes a search tries: the choices given, else TP the divisors of
    the query-group count up to ``max_tp`` that divide the heads, PP the divisors of the
    layer count up to ``num_devices``, CP the powers of two up to ``num_devices`` that split
    the sequence into ``2 * cp`` ring chunks."""
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
    return tps, pps, cps


def tile_choices(
    model: ModelShape, seq_length: int, tp: int, cp: int
) -> list[tuple[int, Optional[int]]]:
    """The ``(loss, MLP)`` tiles (tokens) the tiling rungs try for a layout of ``tp`` x
    ``cp``: the loss in tiles of :data:`LOSS_TILE_TOKENS`, then the loss and every MLP, the
    MLP in tiles of the hidden size (ALST's TiledMLP: ``ceil(s / h)`` tiles), each rounded up
    to a multiple of ``tp``; the MLP's only where its tile is shorter than the CP rank's
    ``seq_length / cp`` tokens (else it runs untiled)."""
    loss, mlp = (-(-tokens // tp) * tp for tokens in (LOSS_TILE_TOKENS, model.hidden_size))
    return [(loss, None)] + ([(loss, mlp)] if mlp < seq_length // cp else [])


def _candidate_layouts(
    search: _Search, grad_reduce_in_bf16: bool, tiling: bool = False
) -> Iterator[Layout]:
    """Every layout the search tries, in its order (TP, PP, CP, interleaving, recompute, the
    tiles; DP takes the remaining devices), with ``grad_reduce_in_bf16``: those whose sizes
    divide the devices, the sequence (``2 * cp`` ring chunks, TP ranks under sequence
    parallelism), the global batch and the search's given tiles (TP ranks under sequence
    parallelism), interleaved only over more than one stage that splits the layers and the
    micro-batches; with ``tiling`` each with every one of its :func:`tile_choices`."""
    s = search
    for tp, pp, cp in itertools.product(s.tps, s.pps, s.cps):
        if s.num_devices % (tp * pp * cp):
            continue
        dp = s.num_devices // (tp * pp * cp)
        if cp > 1 and s.seq_length % (2 * cp):
            continue
        if s.sequence_parallel and tp > 1 and (s.seq_length // cp) % tp:
            continue
        if s.sequence_parallel and any(tile % tp for tile in s.tiles if tile is not None):
            continue
        gbs = s.global_batch_size or default_global_batch_size(s.seq_length, s.micro_batch_size, dp)
        if gbs % (s.micro_batch_size * dp):
            continue
        tiles = tile_choices(s.model, s.seq_length, tp, cp) if tiling else [s.tiles]
        for vp, recompute, (loss, mlp) in itertools.product(
            s.vp_choices, s.recompute_choices, tiles
        ):
            if vp > 1 and (
                pp == 1 or s.model.num_layers % (pp * vp) or (gbs // (s.micro_batch_size * dp)) % pp
            ):
                continue
            yield Layout(
                tp=tp,
                pp=pp,
                cp=cp,
                dp=dp,
                vp=vp,
                sequence_parallel=s.sequence_parallel,
                recompute=recompute,
                micro_batch_size=s.micro_batch_size,
                global_batch_size=gbs,
                distributed_optimizer=s.distributed_optimizer,
                grad_reduce_in_bf16=grad_reduce_in_bf16,
                overlap_grad_reduce=s.overlap_grad_reduce,
                loss_chunk_size=loss,
                mlp_chunk_size=mlp,
            )


def _rung_candidates(search: _Search, rung: Rung) -> list[Candidate]:
    """Every layout of ``search`` planned on ``rung`` (:func:`.fitting.climb_layout`) with its predicted
    step time: the plans that fit (all of them with ``include_non_fitting``)."""
    s = search
    fsdp_choices = s.fsdp_choices if rung.fsdp or s.climb == "each" else ()
    bf16 = s.grad_reduce_in_bf16 or (rung.bf16_gradients and s.bf16_gradients)
    moments = "bf16" if rung.bf16_moments else s.host_moment_dtype
    found = []
    for layout in _candidate_layouts(s, bf16, rung.tiling):
        for plan in climb_layout(
            s.model,
            s.seq_length,
            layout,
            s.device_memory,
            s.partial_recompute,
            fsdp_choices,
            s.plan_kwargs,
            rung.host_offload,
            moments,
            rung.streaming,
        ):
            if plan.fits or s.include_non_fitting:
                step = predict_step_time(
                    s.model,
                    s.seq_length,
                    plan.layout,
                    s.hardware,
                    dtype_bytes=plan.dtype_bytes,
                    **s.step_kwargs,
                )
                found.append(Candidate(plan, step))
    return found


def rank_key(candidate: Candidate):
    """Sort key: predicted step time (ms), cp, pp, tp, -headroom."""
    plan, lay = candidate.plan, candidate.plan.layout
    return (
        round(candidate.step.step_time_s, 3),
        lay.cp,
        lay.pp,
        lay.tp,
        -(plan.headroom or 0),
    )


@dataclass
class OffloadGap:
    """Why nothing fits on ``num_devices`` even with all host offload: ``plan``, the layout
    closest to fitting with the whole optimizer and every layer's activations on the host;
    its device bytes over the device memory (``device_over``, bytes; <= 0: fits) and the
    host bytes over the node's (``host_over``); ``bf16_gradients``, the same plan with bf16
    main gradients (``Layout.grad_reduce_in_bf16``, Megatron-LM's ``--grad-reduce-in-bf16``:
    2 B per parameter instead of 4 with the whole optimizer offloaded); ``narrow_state``, with
    bf16 host moments as well (``Layout.host_moment_dtype``: 8 B of host optimizer state per
    parameter instead of 12)."""

    plan: MemoryPlan
    bf16_gradients: MemoryPlan
    narrow_state: MemoryPlan

    @property
    def device_over(self) -> int:
        return -self.plan.headroom

    @property
    def host_over(self) -> int:
        return -self.plan.host.headroom

    def to_dict(self) -> dict:
        return {
            "closest_layout": self.plan.layout.to_dict(),
            "device_bytes": self.plan.total,
            "device_over_bytes": self.device_over,
            "host_bytes_per_node": self.plan.host.per_node,
            "host_over_bytes": self.host_over,
            "with_bf16_gradients": {
                "device_bytes": self.bf16_gradients.total,
                "device_fits": self.bf16_gradients.device_fits,
                "host_fits": self.bf16_gradients.host.fits,
            },
            "with_bf16_gradients_and_host_moments": {
                "host_bytes_per_node": self.narrow_state.host.per_node,
                "device_fits": self.narrow_state.device_fits,
                "host_fits": self.narrow_state.host.fits,
            },
        }


def closest_offload(
    model: ModelShape,
    seq_length: int,
    num_devices: int,
    device_memory: int,
    *,
    hardware: HardwareProfile = HARDWARE_PROFILES[DEFAULT_HARDWARE],
    search_options: Optional[dict] = None,
    **plan_kwargs,
) -> Optional[OffloadGap]:
    """The gap of ``num_devices`` devices at the top of the ladder: every layout the search
    enumerates (``search_options``: its keywords), planned with all host offload (fraction
    1, every layer of each stage), the one with the least device overshoot (None when the
    profile has no host figures)."""
    if not knows_host(hardware):
        return None
    base = search_layouts(
        model,
        seq_length,
        num_devices,
        device_memory,
        include_non_fitting=True,
        partial_recompute=False,
        fsdp_choices=(),
        offload=False,
        hardware=hardware,
        **(search_options or {}),
        **plan_kwargs,
    )
    kwargs = {**plan_kwargs, "hardware": hardware}
    offloaded = [
        replanned(
            c.plan,
            kwargs,
            optimizer_offload_fraction=1.0,
            activation_offload_layers=model.num_layers // c.plan.layout.pp,
        )
        for c in base
        if c.plan.layout.distributed_optimizer
    ]
    if not offloaded:
        return None
    closest = min(offloaded, key=lambda p: (p.total, p.host.per_node))
    bf16 = replanned(closest, kwargs, grad_reduce_in_bf16=True)
    return OffloadGap(closest, bf16, replanned(bf16, kwargs, host_moment_dtype="bf16"))


def sensitivity(
    candidate: Candidate,
    factors: Sequence[float] = (0.5, 2.0),
    plan_kwargs: Optional[dict] = None,
    step_options: Optional[dict] = None,
) -> list[dict]:
    """How the candidate's prediction moves when each figure its hardware profile marks an
    assumption (:meth:`.hardware.HardwareProfile.assumptions`) is scaled by each of
    ``factors``: per (field, factor) the predicted step time's and tokens/s' relative change,
    and whether the plan still fits (the host figures change the host verdict). A tiled
    layout also gets the step-time model's ``tile_efficiency`` (an assumption, at most 1;
    the bytes do not change)."""
    plan, step = candidate.plan, candidate.step
    hardware = step.hardware
    rows = []

    def row(name: str, factor: float, value, changed, fits, **options) -> dict:
        new_step = predict_step_time(
            plan.model,
            plan.seq_length,
            plan.layout,
            changed,
            dtype_bytes=plan.dtype_bytes,
            mean_document_length=plan.mean_document_length,
            **{**(step_options or {}), **options},
        )
        return {
            "field": name,
            "factor": factor,
            "value": value,
            "step_time_change": new_step.step_time_s / step.step_time_s - 1,
            "tokens_per_s_change": new_step.tokens_per_s_per_device / step.tokens_per_s_per_device
            - 1,
            "fits": fits,
        }

    for name in hardware.assumptions():
        for factor in factors:
            value = getattr(hardware, name) * factor
            if name == "achievable_fraction":
                value = min(value, 1.0)
            if name.endswith("_bytes") or name.endswith("bytes_per_rank"):
                value = int(value)
            changed = hardware.with_(**{name: value})
            new_plan = plan_memory(
                plan.model,
                plan.seq_length,
                plan.layout,
                device_memory=plan.device_memory,
                **{**(plan_kwargs or {}), "hardware": changed},
            )
            rows.append(row(name, factor, value, changed, new_plan.fits))
    if "tile_efficiency" in step.details:
        for factor in factors:
            value = min(step.details["tile_efficiency"] * factor, 1.0)
            rows.append(
                row("tile_efficiency", factor, value, hardware, plan.fits, tile_efficiency=value)
            )
    return rows
