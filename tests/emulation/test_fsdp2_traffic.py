"""Weight streaming's host<->device copies on the emulated NPU, per rank and micro-batch,
exactly: fp32 host shards (the trainer) against bf16 copies (two in-test prototypes).

The trainer's ``PretrainRecipe`` runs the tests' tiny model (``TINY_TEST``, untied, 384
vocabulary rows) with ``--use-torch-fsdp2 --fsdp2-offload-to-cpu --bf16`` at DP2, 2
micro-batches a step (global batch 4, micro-batch 1), three ways (:data:`RUNS`):

* ``fp32 shards``: the trainer as it is (fp32 host shards, ``param_dtype`` bf16, fp32
  reduction, megatron's fp32 Adam on the host shards);
* ``bf16 upload``: the same, with FSDP2's ``FSDPParam.all_gather_inputs`` casting each fp32
  shard to bf16 on the host *before* its copy to the device (torch casts after it): the
  bytes a bf16 pinned host copy (or an ``fsdp_pre_all_gather`` cast) would send, the same
  math (its losses and gradient norms equal the fp32 run's bit for bit);
* ``bf16 shards``: the model cast to bf16 before ``fully_shard``: the host shards, their
  gradients (accumulated in bf16 over the micro-batches) and Adam's state are bf16, the
  master too (megatron's fp32 optimizer steps the bf16 shards): a change of the math, its
  losses and gradient norms recorded beside the fp32 run's.

Counted (this process's ranks, step :data:`MEASURED_STEP`): every copy between the host and
the emulated device, seen by ``NpuTensor.__torch_dispatch__`` (``aten._to_copy`` across
devices, ``aten.copy_`` between a host and a device tensor, ``.item()``), its bytes those of
the copy's destination; FSDP2's are those made inside ``FSDPParamGroup``'s methods, each
attributed to the unit whose method runs and to its phase (``forward``: the unit's gather in
its pre-forward; ``backward``: its gather for the backward, in its or the next unit's
pre-backward; ``gradient``: its gradient shard in its post-backward), the micro-batch
counted from the root's pre-forward. Not counted: the emulated ``torch_npu`` kernels' own
argument checks (they read the causal mask on the host; a real kernel reads it on the
device).

**Oracle**: the bytes follow from the model's parameters alone, counted in the worker from
their (global) shapes with FSDP2's dim-0 sharding rule, not from FSDP2 or the planner. A
unit's shard on a rank is ``S = sum(ceil(rows / D) * columns)`` (padded, what goes up) and
its gradient shard the rank's own rows (what comes down; no padding here: every dim 0 is
even). Per micro-batch and unit, with ``u`` the bytes that go up per element and ``g`` the
gradient's: ``forward = backward = u * S``, ``gradient = g * S``: the root's too (it is
gathered for the forward and again for the backward); ``u, g`` = 4, 4 (fp32 shards), 2, 4
(bf16 upload), 2, 2 (bf16 shards). Every FSDP2 copy keeps its dtype (a cast before or after
it, never in it). Per step: twice a micro-batch. The first micro-batch's gradient copies are
non-blocking (no gradient to add to yet), the second's blocking (FSDP2 adds them to the host
gradient on the CPU). Besides FSDP2: the micro-batch's tokens, labels, loss mask and
positions up (:data:`BATCH_BYTES`) and a few scalars (loss, token count, gradient norm).

The planner's copy model (:func:`stream_copy_seconds` at 1 byte/s: its seconds are bytes)
counts per micro-batch ``4 * (3 * sum(S_units) + 2 * S_root)`` bytes, the root's shard up
once: the fp32 run moves exactly ``4 * S_root`` bytes more (the root's backward gather,
the known gap in its docstring).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest

from mcore_flash.planning import Layout
from mcore_flash.planning.streaming import stream_copy_seconds, stream_units

from _support.dist_utils import run_distributed
from _support.models import TINY_TEST

MODEL = replace(TINY_TEST, vocab_size=384)
SEQ = 64
DP = 2
MICRO_BATCHES = 2
STEPS = 3
MEASURED_STEP = 2  # the first builds FSDP2's lazy state; the copies are the same after
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


class _Copies:
    """This process's host<->device copies while ``on``: ``events``, one tuple each,
    ``(micro-batch, phase, unit, direction, source dtype, destination dtype, bytes,
    non_blocking)``; ``stack``: the ``FSDPParamGroup`` methods running, outermost first;
    ``kernel``: inside an emulated ``torch_npu`` op."""

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
        up = target is not None and torch.device(target).type == "npu"
        if target is None or isinstance(source, device_type) == up:
            return None
        dtype = kwargs.get("dtype") or source.dtype
        blocking = kwargs.get("non_blocking", False)
        return ("up" if up else "down", source.dtype, dtype, source.numel() * dtype.itemsize, blocking)
    if func is aten.copy_.default:
        target, source = args[0], args[1]
        up = isinstance(target, device_type)
        if not isinstance(source, torch.Tensor) or isinstance(source, device_type) != up:
            nbytes = target.numel() * target.element_size()
            non_blocking = bool(args[2]) if len(args) > 2 else kwargs.get("non_blocking", False)
            if isinstance(source, torch.Tensor):
                return ("up" if up else "down", source.dtype, target.dtype, nbytes, non_blocking)
        return None
    if func is aten._local_scalar_dense.default:
        return ("down", args[0].dtype, args[0].dtype, args[0].element_size(), False)
    assert not func.__name__.startswith("_copy_from"), f"a copy not counted: {func}"
    return None


def _instrument():
    """Count this process's host<->device copies into :class:`_Copies`."""
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
                    phase = {"pre_forward": "forward", "pre_backward": "backward"}.get(
                        _Copies.stack[0][0], "gradient" if _Copies.stack[0][0] == "post_backward" else _Copies.stack[0][0]
                    )
                    unit = _Copies.stack[-1][1]._module_fqn or "root"
                else:
                    phase, unit = "other", func.__name__
                _Copies.events.append((_Copies.micro, phase, unit, *copy))
        return dispatch(cls, func, types, args, kwargs)

    device_type.__torch_dispatch__ = classmethod(counted)

    def method_of(name):
        original = getattr(group_module.FSDPParamGroup, name)

        def method(self, *args, **kwargs):
            if name == "pre_forward" and self._module_fqn == "":
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


def _w_measure(rank, world_size, root):
    """``{run: {"shards", "steps": [(loss, grad norm)], "events"}}`` of this rank."""
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
                out[name] = dict(shards=shards, steps=steps, events=events)
            finally:
                recipe.cleanup()
                parallel_state.destroy_model_parallel()
                del recipe
    return out


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp2-traffic"))
    return run_distributed(_w_measure, DP, root, timeout=600, emulate_npu=True)


def test_draft(per_rank):
    for rank, result in enumerate(per_rank):
        for name, r in result.items():
            print(rank, name, r["steps"], r["shards"])
            for e in r["events"]:
                if e[1] == "other" or rank == 0 and name != "fp32 shards":
                    print(rank, name, e)
