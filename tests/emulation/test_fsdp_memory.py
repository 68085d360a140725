"""Megatron-FSDP's device bytes on the emulated NPU equal the planner's (issue 30).

The trainer's ``PretrainRecipe`` runs the tests' tiny model (``TINY_TEST``, its vocabulary the
byte tokenizer's padded to 384 rows) in bf16, as the planner assumes: bf16 weights, fp32
main gradients, fp32 main parameters and Adam (the planner's DDP side counts 12 B of
optimizer state per parameter, which only mixed precision has). Per rank the emulated
device counts every byte (``torch.npu.memory_allocated``), measured (a) after setup (model
built, wrapped, optimizer constructed), (b) after a first step (Adam's m and v exist) and
(c) the peak of a second step, for ``--use-distributed-optimizer`` (DDP) and each FSDP
strategy, at DP2 and DP4 (slow).

Every byte after setup and after a step is accounted for: the model state from the
planner (:func:`~mcore_flash.planning.fsdp.fsdp_bytes`, and
:func:`~mcore_flash.planning.fsdp.prefetched_after_step`: under ``optim_grads_params``
megatron all-gathers the next forward's first units right after the optimizer step, and from
megatron-core 0.18 on keeps the non-unit group, final norm + output layer, gathered between
steps: ``AllGatherPipeline.reset(preserve_non_fsdp_units=True)``; the installed release is
passed), plus
these extras, the same with and without FSDP: megatron's 4-byte ``_scale_one`` (no grad
scaler under bf16), RoPE's cached fp32 ``[s, 1, 1, head_dim]`` embedding and ``inv_freq``
(first forward) and the npu backend's 2048 x 2048 bool compressed causal mask (cached once
per process: the first run's first step). The DDP side is megatron's buffer layout derived
by hand (the bucket padded to a multiple of ``lcm(dp, 128)``: 123200 -> 123264 elements),
which the planner's DDP rows leave out (it counts parameters, not padded buffers): the
differences FSDP - DDP equal the planner's differences less that padding, exactly.

Megatron-FSDP's own transient buffers are measured exactly, in this worker only: the
unsharded parameter buckets (``StorageResizeBasedBucketAllocator.allocate`` / ``free``:
storage regrown and resized to 0), the unsharded gradient buckets
(``TemporaryBucketAllocator.allocate`` / ``free``), the parameter-dtype gradient that
megatron's post-accumulate-grad hook copies into a bucket (from the hook until the tensor
dies) and, on megatron-core 0.16 only, the reduce-scatter's new output shard
(``torch.empty_like(grad_shard)``; 0.17 on reduce into the bucket). During step 2, the planner's
replay of megatron's backward (:func:`~mcore_flash.planning.fsdp.backward_moments`) predicts
them exactly, the same on 0.16.1 and 0.19.2 unless said:

* each kind at its largest (:func:`~mcore_flash.planning.fsdp.gathered_parameter_bytes`,
  :func:`~mcore_flash.planning.fsdp.gradient_transient_bytes`): at DP2 197888 and 543232 B
  under optim_grads_params, 0 and 543232 under optim_grads; at DP4 199168 and 545792, 0 and
  545792. By hand at DP2: the gradient buckets complete in reverse order (final norm + output
  layer 24704 elements, the layers 37120 each, the embedding 24576); queued ones are freed only
  when a bucket completes, and only while they hold more than the communication unit
  (2 x 36992; 61824 when the first layer's bucket was issued), so all four are alive when the
  embedding's gradient (384 x 64, bf16) is copied into its new bucket: 123520 x 4 + 49152;
* both at once at their worst moment, the planner's ``fsdp_gathered_parameters +
  fsdp_gradient_buckets``: DP2 642816 on 0.16.1 (layer 0's reduce-scatter with its new shard,
  layer 0, the prefetched embedding and the non-unit group gathered), 641792 on 0.19.2 (the
  embedding's gradient copied); DP4 644608;
* at the step's peak. Each run's peak lies in an attention backward (the emulated
  ``npu_fusion_attention_grad`` computes in fp32 scratch; the worker measures the peak inside
  every call). There FSDP holds the planner's ``BackwardMoment.held_bytes`` of that layer
  (its unit, the prefetched one and the non-unit group gathered, the queued gradient buckets
  and its own: at DP2 445184 B in layer 1's, 568576 in layer 0's under optim_grads_params),
  so the FSDP run's rise in each attention backward is the DDP run's there plus that, less
  what was gathered already when the step began (``prefetched_after_step``); the step's
  peak is the largest of these, exactly. The shard of 0.16 is a local of megatron's
  ``_bucket_group_gradient_reduce`` and dies when it returns, as on a device (the
  emulation's collective used to keep its tensors in a reference cycle until the garbage
  collector ran: ``emulation/tensor.py``'s ``_collective`` now empties it; 691712 B instead of
  543232 at DP2 on 0.16.1 before). The table is in docs/planner.md.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import replace
from importlib.metadata import version

import pytest

from mcore_flash.planning import Layout, plan_memory
from mcore_flash.planning.fsdp import (
    backward_moments,
    fsdp_bytes,
    gathered_parameter_bytes,
    gradient_transient_bytes,
    prefetched_after_step,
    stage_groups,
)
from mcore_flash.planning.parameters import layer_parameters, total_parameters

from _support.device_bytes import allocated
from _support.dist_utils import run_distributed
from _support.models import TINY_TEST

MODEL = replace(TINY_TEST, vocab_size=384)
SEQ = 64
GLOBAL_BATCH = 4  # micro-batches of 1: 2 a step at DP2, 1 at DP4
FLAGS = [
    *("--num-layers", str(MODEL.num_layers), "--hidden-size", str(MODEL.hidden_size)),
    *("--ffn-hidden-size", str(MODEL.ffn_hidden_size)),
    *("--num-attention-heads", str(MODEL.num_attention_heads)),
    *("--num-query-groups", str(MODEL.num_query_groups)),
    *("--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ)),
    *("--micro-batch-size", "1", "--global-batch-size", str(GLOBAL_BATCH), "--lr", "1e-3"),
    *("--lr-warmup-iters", "1", "--train-iters", "2", "--log-interval", "1"),
    *("--make-vocab-size-divisible-by", "128", "--bf16"),
]
STRATEGIES = ("optim_grads_params", "optim_grads")
RUNS = {  # DDP first: its first step creates the process's compressed mask
    "ddp": ["--use-distributed-optimizer"],
    **{s: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", s] for s in STRATEGIES},
}
SCALE_ONE = 4  # megatron's MixedPrecisionOptimizer._scale_one, fp32 [1]
HEAD_DIM = MODEL.hidden_size // MODEL.num_attention_heads
ROTARY = SEQ * HEAD_DIM * 4 + HEAD_DIM // 2 * 4  # RoPE's cached embedding and inv_freq, fp32
MASK = 2048 * 2048  # the npu backend's compressed causal mask, bool (COMPRESSED_MASK_SIZE)
RELEASE = tuple(int(x) for x in version("megatron-core").split(".")[:2])  # the installed one


class _Transients:
    """Megatron-FSDP's own transient buffers on this rank, bytes alive at once: ``parameters``
    (the unsharded parameter buckets, ``StorageResizeBasedBucketAllocator``: its storage
    regrown by ``allocate``, resized to 0 by ``free``), ``gradients`` (the unsharded gradient
    buckets, ``TemporaryBucketAllocator``: created by ``allocate``, storage freed by ``free``;
    up to megatron-core 0.16 the reduce-scatter's new output shard; and the parameter-dtype
    gradient that megatron's post-accumulate-grad hook copies into a bucket, from the hook's
    start until the tensor dies). Each bucket counts at its storage's current size; the
    shard and the gradient until their tensors are freed (``weakref.finalize``, as the
    emulated device counts them). ``peak``: each kind's largest and their sum's
    largest while ``on`` (step 2)."""

    active = None  # the run being measured

    def __init__(self):
        self.buckets = {}  # (id(allocator), bucket id) -> (kind, bytes)
        self.loose = {"gradients": 0}  # shards and parameter-dtype gradients alive
        self.on = False
        self.peak = {"parameters": 0, "gradients": 0, "together": 0}
        self.phases = []  # per attention backward: (its peak, FSDP's buffers at its start)
        self.outside = 0  # the peak outside them

    def now(self) -> dict:
        now = {"parameters": 0, "gradients": self.loose["gradients"]}
        for kind, nbytes in self.buckets.values():
            now[kind] += nbytes
        now["together"] = now["parameters"] + now["gradients"]
        return now

    def _record(self):
        if not self.on:
            return
        for key, value in self.now().items():
            self.peak[key] = max(self.peak[key], value)

    def bucket(self, allocator, bucket_id, kind):
        held = allocator.buckets.get(bucket_id)
        self.buckets[(id(allocator), bucket_id)] = (
            kind,
            0 if held is None else held.data.untyped_storage().nbytes(),
        )
        self._record()

    def tensor(self, tensor):
        nbytes = tensor.untyped_storage().nbytes()
        self.loose["gradients"] += nbytes
        self._record()
        return weakref.finalize(tensor, self._release, nbytes)

    def _release(self, nbytes):
        self.loose["gradients"] -= nbytes


def _instrument():
    """Count Megatron-FSDP's transient buffers in :class:`_Transients` (this process only)."""
    import torch
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    def counted(cls, name, kind):
        original = cls.__dict__[name]

        def method(self, bucket_id, *args, **kwargs):
            result = original(self, bucket_id, *args, **kwargs)
            if _Transients.active is not None:
                _Transients.active.bucket(self, bucket_id, kind)
            return result

        setattr(cls, name, method)

    for name in ("allocate", "free"):  # the trainer leaves fsdp_double_buffer off
        counted(pgb.StorageResizeBasedBucketAllocator, name, "parameters")
        counted(pgb.TemporaryBucketAllocator, name, "gradients")

    register = torch.Tensor.register_post_accumulate_grad_hook

    def register_counted(param, hook):  # megatron's _process_post_backward_gradients
        def run(p):
            if _Transients.active is not None and _Transients.active.on and p.grad is not None:
                _Transients.active.tensor(p.grad)
            return hook(p)

        return register(param, run)

    torch.Tensor.register_post_accumulate_grad_hook = register_counted
    reduce_scatter = torch.distributed.reduce_scatter_tensor

    def reduce_scatter_counted(output, input, *args, **kwargs):
        # 0.16: torch.empty_like(grad_shard); 0.17 on: a view of the bucket, counted with it
        shares = output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
        if _Transients.active is not None and _Transients.active.on and not shares:
            _Transients.active.tensor(output)
        return reduce_scatter(output, input, *args, **kwargs)

    torch.distributed.reduce_scatter_tensor = reduce_scatter_counted
    import torch_npu

    attention_grad = torch_npu.npu_fusion_attention_grad

    def attention_grad_phased(*args, **kwargs):
        active = _Transients.active
        if active is None or not active.on:
            return attention_grad(*args, **kwargs)
        active.outside = max(active.outside, torch.npu.max_memory_allocated())
        torch.npu.reset_peak_memory_stats()
        held = active.now()["together"]
        result = attention_grad(*args, **kwargs)
        active.phases.append((torch.npu.max_memory_allocated(), held))
        torch.npu.reset_peak_memory_stats()
        return result

    torch_npu.npu_fusion_attention_grad = attention_grad_phased


def _measure(config) -> dict:
    """Bytes after setup, after step 1, the rise of step 2's peak over its start, and the
    largest of Megatron-FSDP's transient buffers in step 2."""
    import torch

    from mcore_flash.training import loop

    start = allocated()  # earlier runs' leftovers (megatron-FSDP's are never freed)
    recipe = loop.PretrainRecipe(config)
    try:
        assert recipe.padded_vocab_size == MODEL.vocab_size
        setup = allocated() - start
        recipe.train_step()
        step = allocated() - start
        torch.npu.reset_peak_memory_stats()
        rest = torch.npu.memory_allocated()
        _Transients.active.on = True
        recipe.train_step()
        _Transients.active.on = False
        active = _Transients.active
        outside = max(active.outside, torch.npu.max_memory_allocated()) - rest
        phases = [(top - rest, held) for top, held in active.phases]
        peak = max(outside, *(top for top, _ in phases))
        return dict(
            setup=setup, step=step, peak=peak, outside=outside, phases=phases, **active.peak
        )
    finally:
        recipe.cleanup()


def _w_measure(rank, world_size, root):
    from megatron.core import parallel_state

    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config

    out = {}
    _instrument()
    for name, flags in RUNS.items():
        _Transients.active = _Transients()
        config = parse_config([*FLAGS, *flags, "--save", f"{root}/{name}"], world_size=world_size)
        distributed.init_distributed(config)
        try:
            out[name] = _measure(config)
        finally:
            parallel_state.destroy_model_parallel()
    return out


def _fsdp_model_state(strategy, dp):
    """The planner's Megatron-FSDP bytes of the worst rank (the one holding the most real
    elements), and what stays gathered after a step on the installed megatron-core."""
    groups = stage_groups(MODEL, 1, 1, 0, strategy)
    layer = sum(layer_parameters(MODEL, 1).values())
    nbytes = fsdp_bytes(groups, strategy, dp, layer, megatron_release=RELEASE)
    return nbytes, prefetched_after_step(groups, strategy, dp, layer, megatron_release=RELEASE)


def _fsdp_transients(strategy, dp):
    """The planner's largest gathered parameters and gradient transients, each alone, and
    ``{layer: bytes}`` held through each layer's backward (:class:`BackwardMoment`)."""
    groups = stage_groups(MODEL, 1, 1, 0, strategy)
    unit = 2 * sum(layer_parameters(MODEL, 1).values())
    held = {
        int(m.unit.rsplit(".", 1)[1]): m.held_bytes()
        for m in backward_moments(groups, strategy, dp, unit)
        if m.unit and m.unit.startswith("decoder.layers.")
    }
    return (
        gathered_parameter_bytes(groups, strategy, dp, unit),
        gradient_transient_bytes(groups, strategy, dp, unit, megatron_release=RELEASE),
        held,
    )


def _expected(dp):
    """``{run: {setup, step}}`` bytes of the worst rank, and the planner's DDP rows."""
    padded = math.ceil(total_parameters(MODEL) / math.lcm(dp, 128)) * math.lcm(dp, 128)
    shard = padded // dp  # rank 0's shard of megatron's DDP buffer: all real elements
    ddp_setup = padded * (2 + 4) + shard * 4 + SCALE_ONE  # bf16 params, fp32 grads, main params
    expected = {"ddp": {"setup": ddp_setup, "step": ddp_setup + shard * 8 + ROTARY + MASK}}
    for strategy in STRATEGIES:
        state, prefetched = _fsdp_model_state(strategy, dp)
        # main params: the same fp32 shard as the gradients under both strategies
        setup = state["weights"] + 2 * state["gradients"] + SCALE_ONE
        adam = state["optimizer_state"] - state["gradients"]
        expected[strategy] = {"setup": setup, "step": setup + adam + prefetched + ROTARY}
    plan = plan_memory(MODEL, SEQ, Layout(dp=dp)).per_device
    planner_ddp = {
        "setup": plan["weights"] + plan["gradients"] + plan["optimizer_state"] // 3,
        "step": plan["weights"] + plan["gradients"] + plan["optimizer_state"],
    }
    ddp_padding = {
        "setup": expected["ddp"]["setup"] - SCALE_ONE - planner_ddp["setup"],
        "step": expected["ddp"]["step"] - SCALE_ONE - ROTARY - MASK - planner_ddp["step"],
    }
    return expected, planner_ddp, ddp_padding


def _worst(per_rank, run, key):
    return max(result[run][key] for result in per_rank)


def _check(per_rank, dp):
    expected, planner_ddp, ddp_padding = _expected(dp)
    assert ddp_padding == {"setup": 64 * 6 + 64 // dp * 4, "step": 64 * 6 + 64 // dp * 12}
    keys = ("setup", "step", "peak", "parameters", "gradients", "together")
    measured = {run: {key: _worst(per_rank, run, key) for key in keys} for run in RUNS}
    assert measured["ddp"]["together"] == 0  # megatron's DDP has no FSDP bucket
    for run in RUNS:
        print(f"DP{dp} {run}: measured {measured[run]}, expected {expected[run]}")
        for key in ("setup", "step"):
            assert measured[run][key] == expected[run][key], (dp, run, key, measured[run])
    for strategy in STRATEGIES:
        state, prefetched = _fsdp_model_state(strategy, dp)
        planner_fsdp = {
            "setup": state["weights"] + 2 * state["gradients"],
            "step": state["weights"] + state["gradients"] + state["optimizer_state"] + prefetched,
        }
        for key, mask in (("setup", 0), ("step", MASK)):
            difference = measured[strategy][key] - measured["ddp"][key]
            want = planner_fsdp[key] - planner_ddp[key] - ddp_padding[key] - mask
            assert difference == want, (dp, strategy, key)
        # Megatron-FSDP's own transient buffers, each at its largest, and both at once
        gathered, gradients, held = _fsdp_transients(strategy, dp)
        assert measured[strategy]["parameters"] == gathered, dp
        assert measured[strategy]["gradients"] == gradients, dp
        together = state["fsdp_gathered_parameters"] + state["fsdp_gradient_buckets"]
        assert measured[strategy]["together"] == together, dp
        for rank, result in enumerate(per_rank):
            _check_peak(result["ddp"], result[strategy], held, prefetched, (dp, strategy, rank))
    return measured


def _check_peak(ddp, fsdp, held, prefetched, where):
    """The step's peak lies in an attention backward, each run's; in each one (micro-batch by
    micro-batch, the layers from the last) FSDP holds the planner's ``held`` bytes, so its rise
    above the bytes at the step's start is DDP's there plus ``held`` less what was gathered
    already at the start (``prefetched``); the step's peak is the largest of these."""
    layers, micro_batches = MODEL.num_layers, GLOBAL_BATCH // where[0]
    assert len(fsdp["phases"]) == len(ddp["phases"]) == layers * micro_batches, where
    predicted = []
    for index, ((top, measured_held), (ddp_top, _)) in enumerate(
        zip(fsdp["phases"], ddp["phases"])
    ):
        layer = layers - 1 - index % layers
        assert measured_held == held[layer], (where, index)
        assert top - ddp_top == held[layer] - prefetched, (where, index)
        predicted.append(ddp_top + held[layer] - prefetched)
    print(
        f"{where}: attention backward rises DDP {[t for t, _ in ddp['phases']]}, FSDP "
        f"{[t for t, _ in fsdp['phases']]}, held {held}, step peak {fsdp['peak']}"
    )
    for run in (ddp, fsdp):
        assert run["outside"] < run["peak"], where
    assert fsdp["peak"] == max(predicted), where


def test_fsdp_device_bytes_equal_the_planners_at_dp2(tmp_path):
    _check(run_distributed(_w_measure, 2, str(tmp_path), timeout=600, emulate_npu=True), 2)


@pytest.mark.slow
def test_fsdp_device_bytes_equal_the_planners_at_dp4(tmp_path):
    _check(run_distributed(_w_measure, 4, str(tmp_path), timeout=900, emulate_npu=True), 4)
