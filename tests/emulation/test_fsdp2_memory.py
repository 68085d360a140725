"""Weight streaming's device and host bytes on the emulated NPU equal the planner's
(:mod:`mcore_flash.planning.streaming`), per rank, exactly.

The trainer's ``PretrainRecipe`` runs the tests' tiny model (``TINY_TEST``, untied, its
vocabulary the byte tokenizer's padded to 384 rows) with ``--use-torch-fsdp2
--fsdp2-offload-to-cpu`` at DP2: torch FSDP2 on the embedding, each layer and the root,
``CPUOffloadPolicy(pin_memory=True)``, ``param_dtype`` bf16 (``--bf16``, what the planner
plans) and fp32 (the run without ``--bf16``, through the planner's ``param_bytes``), the
reduction in fp32, megatron's fp32 Adam on the host shards. A first run (bf16) also takes
what the process keeps: the npu backend's compressed causal mask.

Per rank, measured (the emulated device counts every byte, ``torch.npu.memory_allocated``):

* after setup and after a first step: megatron's 4-byte ``_scale_one`` and (after the step)
  RoPE's cached fp32 embedding and ``inv_freq``, nothing of the model: the planner's
  ``optimizer_state`` 0 and its weights and gradients transient (FSDP2 frees every unit's
  device tensors in its reshard and post-backward);
* FSDP2's own device bytes in a second step, by storage: those first allocated inside
  ``FSDPParamGroup``'s methods (the fp32 shard copies and casts, the all-gather outputs, the
  unsharded parameters, the reduce-scatter buffers) and autograd's unsharded gradients
  (tagged by a post-accumulate-grad hook on FSDP2's unsharded parameters), each counted
  until it dies. Their largest equals :func:`stream_device_bytes`' ``weights + gradients``
  (the largest of :func:`stream_backward_moments`), the split too: gradients are the hooked
  ones and what ``post_backward`` allocates (bf16 443648 = 172416 + 271232 B, fp32 739328 =
  344832 + 394496 B: the end of layer 0's backward with the root's parameters and gradients,
  layer 0's, the prefetched embedding's flat all-gather output and layer 1's reduce-scatter
  input, which FSDP2 keeps until layer 0's reduce-scatter);
* at the step's peak (layer 1's attention backward), FSDP2's bytes there equal the planner's
  moment ``decoder.layers.1`` ``computed`` less the gradients not made yet (linear_qkv's and
  input_layernorm's: bf16 304000 = 320512 - 16512 B, fp32 608000); the rest of the peak's
  rise above the step's start (bf16 1147236 B, fp32 1335652 B) equals the rise of the same
  step without streaming (``--use-distributed-optimizer``, all model state resident: the
  activations and the kernels' scratch), as the planner's plans of the two layouts differ in
  the model state's terms only;
* the host (after the steps): the fp32 parameter shards, Adam's m, v and step and the
  gradient shards, each asserted on the host, equal :func:`stream_host_bytes` exactly
  (739260 and 246400 B per rank).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mcore_flash.planning import Layout, plan_memory
from mcore_flash.planning.parameters import layer_parameters
from mcore_flash.planning.streaming import (
    stream_backward_moments,
    stream_device_bytes,
    stream_host_bytes,
)
from mcore_flash.planning.units import BF16_BYTES, FP32_BYTES

from _support.device_bytes import allocated, set_up_and_stepped
from _support.dist_utils import run_distributed
from _support.models import TINY_TEST

MODEL = replace(TINY_TEST, vocab_size=384)
SEQ = 64
DP = 2
FLAGS = [
    *("--num-layers", str(MODEL.num_layers), "--hidden-size", str(MODEL.hidden_size)),
    *("--ffn-hidden-size", str(MODEL.ffn_hidden_size)),
    *("--num-attention-heads", str(MODEL.num_attention_heads)),
    *("--num-query-groups", str(MODEL.num_query_groups)),
    *("--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ)),
    *("--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3"),
    *("--lr-warmup-iters", "1", "--train-iters", "2", "--log-interval", "1"),
    *("--make-vocab-size-divisible-by", "128", "--untie-embeddings-and-output-weights"),
]
STREAM = ["--use-torch-fsdp2", "--fsdp2-offload-to-cpu"]
RESIDENT = ["--use-distributed-optimizer"]  # the oracle of the step's activations and scratch
RUNS = {  # the first takes the mask
    "warm-up": [*STREAM, "--bf16"],
    "bf16": [*STREAM, "--bf16"],
    "fp32": STREAM,
    "resident-bf16": [*RESIDENT, "--bf16"],
    "resident-fp32": RESIDENT,
}
STREAMED = ("warm-up", "bf16", "fp32")
PARAM_BYTES = {"warm-up": BF16_BYTES, "bf16": BF16_BYTES, "fp32": FP32_BYTES}
LATER_GRADIENTS = ("input_layernorm", "self_attention.linear_qkv")  # after the attention's
LAYOUT = Layout(dp=DP, distributed_optimizer=False, stream_weights=True)
SCALE_ONE = 4  # megatron's FP32Optimizer._scale_one, fp32 [1], on the device
HEAD_DIM = MODEL.hidden_size // MODEL.num_attention_heads
ROTARY = SEQ * HEAD_DIM * 4 + HEAD_DIM // 2 * 4  # RoPE's cached embedding and inv_freq, fp32
MASK = 2048 * 2048  # the npu backend's compressed causal mask, bool (the first run's)


class _Held:
    """FSDP2's own device bytes on this rank, by storage (``tagged``: key -> [kind, bytes]),
    while ``on`` (step 2): ``top`` (their largest, by kind, at the moment of the largest sum)
    and ``at_peak`` (theirs at the device's peak)."""

    depth = 0  # inside FSDPParamGroup's methods
    kind = "weights"  # "gradients" inside post_backward
    on = False
    tagged: dict = {}
    now = {"weights": 0, "gradients": 0}
    top = {"weights": 0, "gradients": 0}
    at_peak = 0

    @classmethod
    def reset(cls):
        cls.top, cls.at_peak = {"weights": 0, "gradients": 0}, 0


def _instrument():
    """Count FSDP2's device storages in :class:`_Held` (this process only), through the
    emulated device's storage registry (``emulation.tensor._memory``)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    from mcore_flash.emulation import tensor as emulated
    from mcore_flash.emulation.runtime import runtime

    memory, device = emulated._memory, runtime()
    track, release, resized = memory.track, memory._release, memory.resized
    record = device._record_allocation

    def note():
        if not _Held.on:
            return
        if sum(_Held.now.values()) > sum(_Held.top.values()):
            _Held.top = dict(_Held.now)
        if device._allocated == device._peak:
            _Held.at_peak = sum(_Held.now.values())

    def add(key, kind):
        nbytes = memory._live[key][1]
        _Held.tagged[key] = [kind, nbytes]
        _Held.now[kind] += nbytes

    def track_tagged(tensor, elem):
        key = id(elem.untyped_storage())
        new = key not in memory._live
        track(tensor, elem)
        if new and _Held.depth:
            add(key, _Held.kind)
        note()

    def release_tagged(key):
        release(key)
        if key in _Held.tagged and key not in memory._live:
            kind, nbytes = _Held.tagged.pop(key)
            _Held.now[kind] -= nbytes

    def resized_tagged(storage):
        resized(storage)
        entry = _Held.tagged.get(id(storage))
        if entry is not None and id(storage) in memory._live:
            nbytes = memory._live[id(storage)][1]
            _Held.now[entry[0]] += nbytes - entry[1]
            entry[1] = nbytes
        note()

    def record_noted(nbytes):
        record(nbytes)
        note()

    memory.track, memory._release, memory.resized = track_tagged, release_tagged, resized_tagged
    device._record_allocation = record_noted
    hooked = {}  # id -> FSDP2's unsharded parameter (kept: the ids stay unique)

    def accumulated(param):  # autograd made (or added to) an unsharded gradient
        key = id(param.grad.untyped_storage())
        if key in memory._live and key not in _Held.tagged:
            add(key, "gradients")
        note()

    def wrapped(name):
        original = getattr(group_module.FSDPParamGroup, name)

        def method(self, *args, **kwargs):
            outer = _Held.kind
            _Held.depth += 1
            _Held.kind = "gradients" if name == "post_backward" else outer
            try:
                return original(self, *args, **kwargs)
            finally:
                _Held.depth -= 1
                _Held.kind = outer
                for fsdp_param in self.fsdp_params if name == "wait_for_unshard" else ():
                    param = fsdp_param.unsharded_param
                    if id(param) not in hooked:
                        hooked[id(param)] = param
                        param.register_post_accumulate_grad_hook(accumulated)

        setattr(group_module.FSDPParamGroup, name, method)

    for name in (
        *("unshard", "wait_for_unshard", "reshard", "pre_forward", "post_forward"),
        *("pre_backward", "post_backward", "finalize_backward"),
    ):
        wrapped(name)


def _local_bytes(tensor) -> int:
    """Bytes of ``tensor``'s local part (a DTensor's shard on this rank), asserted on the host."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    assert local.device.type == "cpu", local.device
    return local.numel() * local.element_size()


def _host(recipe) -> dict:
    """This rank's host bytes: the fp32 parameter shards (the optimizer's master) with Adam's
    m, v and step, and the gradient shards, each asserted on the host."""
    import torch

    params = grads = state = 0
    for chunk in recipe.model_chunks:
        for param in chunk.parameters():
            params += _local_bytes(param)
            if param.grad is not None:
                grads += _local_bytes(param.grad)
    for inner in getattr(recipe.optimizer, "chained_optimizers", [recipe.optimizer]):
        for values in inner.optimizer.state.values():
            assert sorted(values) == ["exp_avg", "exp_avg_sq", "step"], sorted(values)
            state += sum(_local_bytes(v) for v in values.values() if torch.is_tensor(v))
    return {"host_optimizer_state": params + state, "host_gradient_copy": grads}


def _w_measure(rank, world_size, root):
    """``{run: bytes}``: after setup, after step 1, the rise of step 2's peak above its start;
    for the streamed runs also FSDP2's largest (by kind) and at the device's peak in step 2,
    and the host's."""
    import torch

    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config

    out = {}
    _instrument()
    for name, flags in RUNS.items():
        config = parse_config([*FLAGS, *flags, "--save", f"{root}/{name}"], world_size=world_size)
        distributed.init_distributed(config)
        with set_up_and_stepped(config, MODEL.vocab_size) as (recipe, _, setup, step):
            before = allocated()
            torch.npu.reset_peak_memory_stats()
            _Held.reset()
            _Held.on = True
            recipe.train_step()
            _Held.on = False
            rise = torch.npu.max_memory_allocated() - before
            out[name] = dict(setup=setup, step=step, rise=rise)
            if name in STREAMED:
                out[name].update(**_Held.top, at_peak=_Held.at_peak, **_host(recipe))
    return out


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fsdp2"))
    return run_distributed(_w_measure, DP, root, timeout=600, emulate_npu=True)


def test_streamed_model_state_is_on_the_host_and_equals_the_planners(per_rank):
    """After setup and after a step no model state is on the device; the host holds
    :func:`stream_host_bytes` per rank (as the plan does), bf16 and fp32."""
    host = stream_host_bytes(MODEL, LAYOUT)
    plan = plan_memory(MODEL, SEQ, LAYOUT)
    assert {key: plan.stages[0].host_bytes[key] for key in host} == host
    for rank, result in enumerate(per_rank):
        for run in STREAMED:
            measured = result[run]
            print(f"rank {rank} {run}: {measured}")
            state = stream_device_bytes(MODEL, LAYOUT, PARAM_BYTES[run])["optimizer_state"]
            mask = MASK if run == "warm-up" else 0
            assert measured["setup"] == SCALE_ONE + state, (rank, run)
            assert measured["step"] == SCALE_ONE + state + ROTARY + mask, (rank, run)
            for key in host:
                assert measured[key] == host[key], (rank, run, key)


def test_fsdp2_device_bytes_equal_the_planners(per_rank):
    """FSDP2's largest device bytes in a step, by kind, equal :func:`stream_device_bytes`;
    at the step's peak (layer 1's attention backward) FSDP2 holds the planner's ``computed``
    moment of layer 1 less the gradients its attention backward precedes."""
    for run, param_bytes in PARAM_BYTES.items():
        planned = stream_device_bytes(MODEL, LAYOUT, param_bytes)
        moments = stream_backward_moments(MODEL, LAYOUT, param_bytes)
        computed = next(
            m.total for m in moments if (m.unit, m.moment) == ("decoder.layers.1", "computed")
        )
        # the peak is in layer 1's attention backward: its qkv and input norm's gradients
        # are not made yet (the others, linear_proj's included, are)
        layer = layer_parameters(MODEL, 1)
        at_peak = computed - param_bytes * sum(layer[name] for name in LATER_GRADIENTS)
        for rank, result in enumerate(per_rank):
            measured = result[run]
            print(f"rank {rank} {run}: FSDP2 {measured}, planner {planned}, at peak {at_peak}")
            for key in ("weights", "gradients"):
                assert measured[key] == planned[key], (rank, run, key)
            assert measured["at_peak"] == at_peak, (rank, run)
    for param_bytes in (BF16_BYTES, FP32_BYTES):
        plan = plan_memory(MODEL, SEQ, LAYOUT, param_bytes=param_bytes).per_device
        planned = stream_device_bytes(MODEL, LAYOUT, param_bytes)
        assert {key: plan[key] for key in planned} == planned, param_bytes


def test_the_rest_of_the_streamed_peak_is_the_resident_runs_activations(per_rank):
    """Streaming adds FSDP2's bytes to the step's peak and nothing else: the rise of the
    streamed step's peak above its start, less FSDP2's bytes there, equals the rise of the
    resident run's (the distributed optimizer's, whose weights, gradients and Adam state
    stay on the device throughout: its rise is the activations and kernels' scratch), bf16
    and fp32. The planner says the same: its streamed plan differs from the resident one in
    the model state's terms only."""
    streamed, resident = (
        plan_memory(MODEL, SEQ, layout).per_device
        for layout in (LAYOUT, Layout(dp=DP, distributed_optimizer=True))
    )
    state = ("weights", "gradients", "optimizer_state", "allocator_fragmentation")
    for term in streamed.keys() - set(state):
        assert streamed[term] == resident[term], term
    for rank, result in enumerate(per_rank):
        for run in ("bf16", "fp32"):
            streamed, resident = result[run], result[f"resident-{run}"]
            rest = streamed["rise"] - streamed["at_peak"]
            print(
                f"rank {rank} {run}: streamed rise {streamed['rise']} - FSDP2 "
                f"{streamed['at_peak']} = {rest}, resident rise {resident['rise']}"
            )
            assert rest == resident["rise"], (rank, run)
