"""Weight streaming's host<->device copies on the emulated NPU, per rank, micro-batch, unit
and phase, exactly: the trainer's fp32 host shards against two in-test bf16 prototypes.

The trainer's ``PretrainRecipe`` runs the tests' tiny model (``TINY_TEST``, untied, 384
vocabulary rows) with ``--use-torch-fsdp2 --fsdp2-offload-to-cpu --bf16`` at DP2, 2
micro-batches a step (global batch 4, micro-batch 1), :data:`STEPS` steps, three ways
(:data:`RUNS`; the prototypes patch torch or the trainer inside the worker only):

* ``fp32 shards``: the trainer as it is (fp32 host shards, ``param_dtype`` bf16, fp32
  reduction, megatron's fp32 Adam on the host shards);
* ``bf16 upload``: the same, with FSDP2's ``FSDPParam.all_gather_inputs`` casting each fp32
  shard to bf16 on the host *before* its copy to the device (torch 2.13 casts after it):
  the bytes a bf16 pinned host copy of the shards (or an ``fsdp_pre_all_gather`` that casts)
  would send, with the same math;
* ``bf16 shards``: the model cast to bf16 before ``fully_shard``: the host shards, their
  gradients (reduced in fp32, then accumulated in bf16 over the micro-batches) and Adam's
  state are bf16, the master too (megatron's fp32 optimizer steps the bf16 shards).

Counted (each rank, step :data:`MEASURED_STEP`): every copy between the host and the
emulated device, seen by ``NpuTensor.__torch_dispatch__`` (``aten._to_copy`` across devices,
``aten.copy_`` between a host and a device tensor, ``.item()``; a ``_copy_from`` would fail
the run), its bytes the destination's. FSDP2's are those made inside ``FSDPParamGroup``'s
methods, each attributed to the unit whose method runs (``_module_fqn``; the root's ``""``
is ``"root"``) and to the outermost method's phase (``forward``: pre-forward; ``backward``:
pre-backward, the unit's own or the next unit's prefetch; ``gradient``: post-backward), the
micro-batch counted at the root's pre-forward. Not counted: the emulated ``torch_npu``
kernels' own argument checks (they copy the causal mask to the host to check it; a real
kernel reads it on the device).

**Oracle**: the model's parameters, counted in the worker (:func:`_shards`) from their
global shapes with FSDP2's dim-0 rule, not from FSDP2's copies or the planner. On a rank a
unit's shard is ``S = sum(ceil(rows / D) * columns)`` over its parameters (padded: what
goes up) and its gradient shard ``G`` the rank's own rows (what comes down; here ``G = S``,
every dim 0 is even). Per micro-batch and unit, with ``u`` and ``g`` the bytes per element
up and down: ``forward = backward = u * S`` (the root's too: it is gathered for the forward
and again for the backward), ``gradient = g * G``; ``(u, g)`` = (4, 4) fp32 shards, (2, 4)
bf16 upload, (2, 2) bf16 shards (:data:`BYTES`). Every FSDP2 copy keeps its dtype (cast
before or after, never in it); the ups are non-blocking; the gradients come down
non-blocking in the first micro-batch and blocking in the second (FSDP2 then adds them to
the host gradient on the CPU). Besides FSDP2: each micro-batch's tokens, labels, positions
and loss mask go up (:data:`BATCH_BYTES`), and a few scalars cross (the token count, the
loss, the gradient norm). On the host: parameter shards, gradients and Adam's m and v in the shards'
dtype. Accuracy: the bf16 upload's losses and gradient norms equal the fp32 run's bit for
bit; the bf16 shards' differ from the third step on (printed).

The planner's copy model (:func:`stream_copy_seconds` at 1 byte/s: its seconds are bytes)
counts ``4 * 3 * (sum(S_units) + S_root)`` bytes a micro-batch, the root's shard up twice
as FSDP2 sends it: the fp32 run's bytes exactly.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import NamedTuple

import pytest

from mcore_flash.planning import Layout
from mcore_flash.planning.streaming import stream_copy_seconds, stream_units
from mcore_flash.planning.units import BF16_BYTES, FP32_BYTES

from _support.dist_utils import run_distributed
from _support.models import TINY_TEST

MODEL = replace(TINY_TEST, vocab_size=384)
SEQ = 64
DP = 2
MICRO_BATCHES = 2
STEPS = 5  # the first at lr 0 (warm-up), so 4 updates
MEASURED_STEP = 2  # not the first, which builds FSDP2's lazy state
FLAGS = [
    *("--num-layers", str(MODEL.num_layers), "--hidden-size", str(MODEL.hidden_size)),
    *("--ffn-hidden-size", str(MODEL.ffn_hidden_size)),
    *("--num-attention-heads", str(MODEL.num_attention_heads)),
    *("--num-query-groups", str(MODEL.num_query_groups)),
    *("--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ)),
    *("--micro-batch-size", "1", "--global-batch-size", str(DP * MICRO_BATCHES)),
    *("--lr", "1e-3", "--lr-warmup-iters", "1", "--train-iters", str(STEPS)),
    *("--log-interval", "1", "--make-vocab-size-divisible-by", "128"),
    *("--untie-embeddings-and-output-weights", "--bf16"),
    *("--use-torch-fsdp2", "--fsdp2-offload-to-cpu"),
]
LAYOUT = Layout(dp=DP, distributed_optimizer=False, stream_weights=True)
# bytes per shard element: (up, gradient down)
BYTES = {"fp32 shards": (4, 4), "bf16 upload": (2, 4), "bf16 shards": (2, 2)}
PHASES = ("forward", "backward", "gradient")
PHASE_OF = {"pre_forward": "forward", "pre_backward": "backward", "post_backward": "gradient"}
# the micro-batch's int64 tokens, labels and positions and fp32 loss mask, [1, SEQ] each
BATCH_BYTES = (3 * 8 + 4) * SEQ


@contextlib.contextmanager
def _fp32_shards():
    """The trainer as it is."""
    yield


@contextlib.contextmanager
def _bf16_upload():
    """FSDP2 casts each offloaded fp32 shard to ``param_dtype`` on the host, then copies it
    (``FSDPParam.all_gather_inputs``, torch 2.13's offload branch, the cast moved before the
    ``.to(device)``); its other branches unchanged."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

    original = FSDPParam.all_gather_inputs

    def all_gather_inputs(self):
        if (
            self.offload_to_cpu
            and self.param_dtype is not None
            and self.sharded_state == ShardedState.SHARDED
            and not hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather")
        ):
            cast = self._sharded_param_data.to(self.param_dtype)
            return [cast.to(self.device, non_blocking=True)]
        return original.fget(self)

    FSDPParam.all_gather_inputs = property(all_gather_inputs)
    try:
        yield
    finally:
        FSDPParam.all_gather_inputs = original


@contextlib.contextmanager
def _bf16_shards():
    """The trainer's fp32 model cast to bf16 before ``fully_shard``: FSDP2's shards, their
    gradients and megatron's fp32 optimizer's parameters (so Adam's state) are bf16."""
    from unittest import mock

    import torch

    from mcore_flash.training import fsdp2

    original = fsdp2.torch_fully_sharded

    def in_bf16(config, model_config, model, device):
        return original(config, model_config, model.to(torch.bfloat16), device)

    with mock.patch.object(fsdp2, "torch_fully_sharded", in_bf16):
        yield


RUNS = {"fp32 shards": _fp32_shards, "bf16 upload": _bf16_upload, "bf16 shards": _bf16_shards}


class Copy(NamedTuple):
    """One host<->device copy: ``micro`` (the micro-batch, from 1; 0 before the first
    forward), ``phase`` (:data:`PHASES`, or ``"other"`` outside FSDP2), ``unit`` (FSDP2's,
    or the op), ``direction`` ("up": host to device), ``source`` / ``target`` dtypes,
    ``bytes`` (the destination's) and ``non_blocking``."""

    micro: int
    phase: str
    unit: str
    direction: str
    source: object
    target: object
    bytes: int
    non_blocking: bool


class _Copies:
    """This process's host<->device copies while ``on``: ``events``, one tuple each with
    :class:`Copy`'s fields; ``micro``: the micro-batch; ``stack``: the ``FSDPParamGroup``
    methods running, outermost first; ``kernel``: inside an emulated ``torch_npu`` op."""

    on = False
    kernel = 0
    micro = 0
    stack: list = []
    events: list = []


def _copy_of(func, args, kwargs, device_type):
    """``(direction, source dtype, destination dtype, bytes, non_blocking)`` of ``func``
    (an aten op on ``args``) if it copies between the host and the device, else None."""
    import torch

    aten = torch.ops.aten
    if func is aten._to_copy.default:
        source, target = args[0], kwargs.get("device")
        if target is None or isinstance(source, device_type) == (
            torch.device(target).type == "npu"
        ):
            return None
        dtype = kwargs.get("dtype") or source.dtype
        direction = "down" if isinstance(source, device_type) else "up"
        nbytes = source.numel() * dtype.itemsize
        return direction, source.dtype, dtype, nbytes, kwargs.get("non_blocking", False)
    if func is aten.copy_.default:
        target, source = args[0], args[1]
        if not torch.is_tensor(source) or (
            isinstance(target, device_type) == isinstance(source, device_type)
        ):
            return None
        direction = "up" if isinstance(target, device_type) else "down"
        nbytes = target.numel() * target.element_size()
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return direction, source.dtype, target.dtype, nbytes, non_blocking
    if func is aten._local_scalar_dense.default:  # .item()
        return "down", args[0].dtype, args[0].dtype, args[0].element_size(), False
    assert not func.__name__.startswith("_copy_from"), f"a copy not counted: {func}"
    return None


def _instrument():
    """Count this process's host<->device copies into :class:`_Copies` (the emulated
    device's dispatch, FSDP2's group methods and the emulated ``torch_npu`` ops wrapped)."""
    import torch_npu
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    from mcore_flash.emulation import tensor as emulated

    device_type = emulated.NpuTensor
    dispatch = device_type.__dict__["__torch_dispatch__"].__func__

    def counted(cls, func, types, args=(), kwargs=None):
        if _Copies.on and not _Copies.kernel:
            copy = _copy_of(func, args, kwargs or {}, device_type)
            if copy is not None:
                if _Copies.stack:
                    outermost, group = _Copies.stack[0][0], _Copies.stack[-1][1]
                    phase = PHASE_OF.get(outermost, outermost)
                    unit = group._module_fqn or "root"
                else:
                    phase, unit = "other", func.__name__
                _Copies.events.append((_Copies.micro, phase, unit, *copy))
        return dispatch(cls, func, types, args, kwargs)

    device_type.__torch_dispatch__ = classmethod(counted)

    def method_of(name):
        original = getattr(group_module.FSDPParamGroup, name)

        def method(self, *args, **kwargs):
            if name == "pre_forward" and self._module_fqn == "":  # the root: a micro-batch
                _Copies.micro += 1
            _Copies.stack.append((name, self))
            try:
                return original(self, *args, **kwargs)
            finally:
                _Copies.stack.pop()

        return method

    for name in ("unshard", "pre_forward", "pre_backward", "post_backward", "finalize_backward"):
        setattr(group_module.FSDPParamGroup, name, method_of(name))

    def kernel_of(op):
        def kernel(*args, **kwargs):
            _Copies.kernel += 1
            try:
                return op(*args, **kwargs)
            finally:
                _Copies.kernel -= 1

        return kernel

    for name in ("npu_fusion_attention", "npu_fusion_attention_grad", "npu_rms_norm", "npu_swiglu"):
        setattr(torch_npu, name, kernel_of(getattr(torch_npu, name)))


def _shards(gpt, rank: int) -> dict:
    """``{unit: (shard elements, gradient shard elements)}`` of this rank: each parameter
    of ``gpt`` in the innermost ``fully_shard`` module holding it (the root ``""`` ->
    ``"root"``), its global shape cut in ``DP`` dim-0 chunks of ``ceil(rows / DP)`` rows."""
    from torch.distributed.fsdp import FSDPModule

    units = [name for name, module in gpt.named_modules() if isinstance(module, FSDPModule)]
    out = {}
    for name, param in gpt.named_parameters():
        unit = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
        rows, columns = param.shape[0], math.prod(param.shape[1:])
        chunk = -(-rows // DP)
        own = max(0, min(rows, (rank + 1) * chunk) - rank * chunk)
        shard, gradient = out.get(unit or "root", (0, 0))
        out[unit or "root"] = (shard + chunk * columns, gradient + own * columns)
    return out


def _host_bytes(recipe) -> dict:
    """This rank's ``{(what, dtype): bytes}`` of the parameter shards, their gradients and
    Adam's m and v (each a local shard asserted on the host)."""
    model = recipe.model_chunks[0]
    tensors = {
        "parameters": list(model.parameters()),
        "gradients": [p.grad for p in model.parameters() if p.grad is not None],
        "adam": [
            state[key]
            for inner in getattr(recipe.optimizer, "chained_optimizers", [recipe.optimizer])
            for state in inner.optimizer.state.values()
            for key in ("exp_avg", "exp_avg_sq")
        ],
    }
    out = {}
    for what, values in tensors.items():
        for value in values:
            local = value.to_local()
            assert local.device.type == "cpu", (what, local.device)
            key = (what, str(local.dtype).removeprefix("torch."))
            out[key] = out.get(key, 0) + local.numel() * local.element_size()
    return out


def _w_measure(rank, world_size, root):
    """``{run: {"shards": _shards, "steps": [(loss, grad norm)], "events": [Copy tuple],
    "host": _host_bytes}}`` of this rank, :data:`MEASURED_STEP`'s copies."""
    from megatron.core import parallel_state

    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training import loop

    _instrument()
    out = {}
    for name, patches in RUNS.items():
        config = parse_config([*FLAGS, "--save", f"{root}/{name}"], world_size=world_size)
        distributed.init_distributed(config)
        with patches():
            recipe = loop.PretrainRecipe(config)
            try:
                steps, events = [], None
                for step in range(1, STEPS + 1):
                    _Copies.events, _Copies.micro, _Copies.on = [], 0, step == MEASURED_STEP
                    steps.append(recipe.train_step()[:2])
                    _Copies.on = False
                    events = list(_Copies.events) if step == MEASURED_STEP else events
                shards = _shards(recipe.model_chunks[0].module, rank)
                out[name] = dict(
                    shards=shards, steps=steps, events=events, host=_host_bytes(recipe)
                )
            finally:
                recipe.cleanup()
                parallel_state.destroy_model_parallel()
                del recipe
    return out


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp2-traffic"))
    return run_distributed(_w_measure, DP, root, timeout=600, emulate_npu=True)


def _sums(events, **where) -> int:
    """The bytes of the ``events`` whose fields equal ``where``'s."""
    return sum(e.bytes for e in events if all(getattr(e, k) == v for k, v in where.items()))


def _fsdp2(events) -> list:
    return [e for e in events if e.phase != "other"]


def _events(result) -> list:
    return [Copy(*e) for e in result["events"]]


def test_fsdp2_copies_each_shard_up_twice_and_its_gradient_down_once(per_rank):
    """Per rank, micro-batch, unit and phase, FSDP2's bytes are the module docstring's
    oracle; every copy keeps its dtype; the gradients come down non-blocking in the first
    micro-batch, blocking (then added on the host) in the second; besides FSDP2 the
    batch goes up and a few scalars come down."""
    for rank, result in enumerate(per_rank):
        for run, (up, down) in BYTES.items():
            events, shards = _events(result[run]), result[run]["shards"]
            fsdp2 = _fsdp2(events)
            assert {e.phase for e in fsdp2} == set(PHASES), (rank, run)
            assert {e.micro for e in fsdp2} == set(range(1, MICRO_BATCHES + 1)), (rank, run)
            for micro in range(1, MICRO_BATCHES + 1):
                for unit, (shard, gradient) in shards.items():
                    at = dict(micro=micro, unit=unit)
                    assert _sums(fsdp2, phase="forward", direction="up", **at) == up * shard
                    assert _sums(fsdp2, phase="backward", direction="up", **at) == up * shard
                    assert _sums(fsdp2, phase="gradient", direction="down", **at) == down * gradient
                moved = {d: _sums(fsdp2, micro=micro, direction=d) for d in ("up", "down")}
                print(f"rank {rank} {run} micro-batch {micro}: {moved}")
                assert moved["up"] == 2 * up * sum(s for s, _ in shards.values()), (rank, run)
                assert moved["down"] == down * sum(g for _, g in shards.values()), (rank, run)
            for e in fsdp2:
                assert e.source == e.target, (rank, run, e)
                assert (e.phase == "gradient") == (e.direction == "down"), (rank, run, e)
                assert e.non_blocking == (e.phase != "gradient" or e.micro == 1), (rank, run, e)
            others = [e for e in events if e.phase == "other"]
            batch = [e for e in others if e.bytes > 8]  # more than one element
            assert {e.direction for e in batch} == {"up"}, (rank, run, others)
            assert _sums(batch) == MICRO_BATCHES * BATCH_BYTES, (rank, run, others)
            assert len(others) - len(batch) <= 8, (rank, run, others)  # the scalars


def test_the_planners_copy_model_counts_fsdp2s_bytes(per_rank):
    """The planner's units have the shards counted from the model, and its copy model's
    bytes a micro-batch are the fp32 run's (the root's shard up twice)."""
    units, root = stream_units(MODEL, LAYOUT.tp, LAYOUT.sharding_ranks)
    planned, _ = stream_copy_seconds(MODEL, LAYOUT, 1.0, 0.0, 0.0)  # at 1 B/s, seconds = bytes
    for rank, result in enumerate(per_rank):
        measured = result["fp32 shards"]
        assert {u.name: (u.shard, u.shard) for u in (*units, root)} == measured["shards"]
        for micro in range(1, MICRO_BATCHES + 1):
            moved = _sums(_fsdp2(_events(measured)), micro=micro)
            print(f"rank {rank} micro-batch {micro}: moved {moved} B, planned {planned:.0f} B")
            assert moved == planned, (rank, micro)


def test_bf16_shards_keep_the_master_and_adam_in_bf16(per_rank):
    """On the host: fp32 parameter shards, gradients and Adam's m and v with fp32 shards
    and the bf16 upload (16 B per shard element), all bf16 with bf16 shards (8 B)."""
    for rank, result in enumerate(per_rank):
        shard = sum(s for s, _ in result["fp32 shards"]["shards"].values())
        gradient = sum(g for _, g in result["fp32 shards"]["shards"].values())
        for run, dtype, size in (
            ("fp32 shards", "float32", FP32_BYTES),
            ("bf16 upload", "float32", FP32_BYTES),
            ("bf16 shards", "bfloat16", BF16_BYTES),
        ):
            host = result[run]["host"]
            print(f"rank {rank} {run}: host {host}")
            assert host == {
                ("parameters", dtype): size * shard,
                ("gradients", dtype): size * gradient,
                ("adam", dtype): 2 * size * shard,
            }, (rank, run)


def test_bf16_upload_changes_nothing_and_bf16_shards_change_the_gradients(per_rank):
    """The bf16 upload's losses and gradient norms are the fp32 run's, bit for bit. With
    bf16 shards the first two losses are the fp32 run's (the same bf16 weights compute them:
    the first update is at lr 0) and the later ones differ (bf16 gradients accumulated over
    the micro-batches, a bf16 master and Adam state; the differences are printed)."""
    for rank, result in enumerate(per_rank):
        fp32, upload, shards = (result[run]["steps"] for run in BYTES)
        assert upload == fp32, rank
        assert [loss for loss, _ in shards[:2]] == [loss for loss, _ in fp32[:2]], rank
        for step, ((loss, norm), (loss16, norm16)) in enumerate(zip(fp32, shards), 1):
            print(
                f"rank {rank} step {step}: fp32 shards loss {loss!r} grad norm {norm!r}; bf16 "
                f"shards {loss16!r} ({loss16 / loss - 1:+.2e}), {norm16!r} ({norm16 / norm - 1:+.2e})"
            )
            assert (loss16 == loss) == (step <= 2), (rank, step)
