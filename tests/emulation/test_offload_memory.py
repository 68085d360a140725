"""The optimizer offload's and bf16 gradients' device bytes (after setup, after a step, at a
step's peak) and host bytes on the emulated NPU equal the planner's, per rank, exactly (issue 31).

The trainer's ``PretrainRecipe`` runs the tests' tiny model (``TINY_TEST``, its vocabulary the
byte tokenizer's padded to 384 rows) in bf16 with the distributed optimizer at DP2, as the
planner assumes: once resident (fp32 main gradients, Adam on the device), then with
``--optimizer-cpu-offload --optimizer-offload-fraction F --use-precision-aware-optimizer``
(megatron-core's ``HybridDeviceOptimizer``) at F = 1 and 0.5, with ``--grad-reduce-in-bf16``
alone, and with both (F = 1, and F = 0.5, where the optimizer's kept part gets fp32
gradients). Per rank the emulated device counts every byte (``torch.npu.memory_allocated``),
measured after setup (model built, wrapped, optimizer constructed) and after a first step
(Adam's m and v, the step counters, the fp32 gradients exist). The oracle is that
measurement: what each run takes less than the resident run, per rank, equals the planner's
prediction exactly, :func:`~mcore_flash.planning.ddp_state.ddp_state_bytes` of the resident
layout less that of the run's layout. The planner reads no tensor of the trainer: it mirrors
megatron's DDP buffer (parameters in reverse order, each starting at a multiple of 64
elements, the bucket padded to a multiple of ``lcm(dp, 128)`` and split evenly over the
ranks), the optimizer's order (the weight-decay group, then the 1-D and ``.bias``
parameters, each in buffer order) and the hybrid optimizer's split (whole parameters to the
host in that order while the offloaded elements are below F x the rank's shard).

The same at the peak of a second step (it falls in the backward, the state as after a step):
each offload run's drop equals its after-step drop, exactly; bf16 gradients without offload
drop 4 B x shard more there (246528 / 246528), as the distributed optimizer's fp32 gradients of
its shard live from its step to the next ``zero_grad`` only (the planner counts them: 4 B x
shard high at that peak). The host: the offloaded state (fp32 master, m, v, step counters) and
the pinned gradient copies of each rank equal the planner's ``ddp_host_bytes`` exactly, bf16
host moments (2 B each) included.

Measured on megatron-core 0.16.1 (and 0.19.2: the same), bytes less than resident, rank 0 /
rank 1, after a step: offload 1.0 739584 / 738816, 0.5 393192 / 393200, 1.0 + bf16 gradients
986112 / 985344, bf16 gradients alone 0 / 256, 0.5 + bf16 gradients 524264 / 524528; after
setup 246528 / 246272, 131072 / 131072, 493056 / 492800, 246528 / 246528, 377600 / 377600;
offload 1.0 + bf16 host moments as offload 1.0 on the device.
The plan of each layout (:func:`~mcore_flash.planning.plan_memory`) holds the worst rank's
weights, gradients and optimizer state.
"""

from __future__ import annotations

from dataclasses import replace

from mcore_flash.planning import Layout, plan_memory
from mcore_flash.planning.ddp_state import ddp_host_bytes, ddp_state_bytes, rank_shards

from _support.device_bytes import set_up_and_stepped
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
    *("--make-vocab-size-divisible-by", "128", "--bf16", "--use-distributed-optimizer"),
]
OFFLOAD = ["--use-precision-aware-optimizer", "--optimizer-cpu-offload"]
BF16_GRADS = ["--grad-reduce-in-bf16"]
RESIDENT = Layout(dp=DP)
LAYOUTS = {  # the runs measured against the resident one, and their flags
    "offload 1.0": (Layout(dp=DP, optimizer_offload_fraction=1.0), OFFLOAD),
    "offload 0.5": (
        Layout(dp=DP, optimizer_offload_fraction=0.5),
        [*OFFLOAD, "--optimizer-offload-fraction", "0.5"],
    ),
    "offload 1.0 + bf16 gradients": (
        Layout(dp=DP, optimizer_offload_fraction=1.0, grad_reduce_in_bf16=True),
        [*OFFLOAD, *BF16_GRADS],
    ),
    "bf16 gradients": (Layout(dp=DP, grad_reduce_in_bf16=True), BF16_GRADS),
    "offload 0.5 + bf16 gradients": (
        Layout(dp=DP, optimizer_offload_fraction=0.5, grad_reduce_in_bf16=True),
        [*OFFLOAD, "--optimizer-offload-fraction", "0.5", *BF16_GRADS],
    ),
    "offload 1.0 + bf16 moments": (
        Layout(dp=DP, optimizer_offload_fraction=1.0, host_moment_dtype="bf16"),
        [*OFFLOAD, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
    ),
}
# the first run of a process also allocates what megatron and the npu backend keep for the
# process (the compressed causal mask of the first attention): a warm-up run takes them
RUNS = {"warm-up": [], "resident": [], **{name: flags for name, (_, flags) in LAYOUTS.items()}}


def _w_measure(rank, world_size, root):
    """``{run: {"setup": bytes, "step": bytes, "peak": bytes, host bytes}}`` this rank's device
    took for each run (the peak: the highest during a second step)."""
    import torch

    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config

    out = {}
    for name, flags in RUNS.items():
        save = f"{root}/{name.replace(' ', '_').replace('+', 'and')}"
        config = parse_config([*FLAGS, *flags, "--save", save], world_size=world_size)
        distributed.init_distributed(config)
        with set_up_and_stepped(config, MODEL.vocab_size) as (recipe, start, setup, step):
            torch.npu.reset_peak_memory_stats()
            recipe.train_step()
            peak = torch.npu.max_memory_allocated() - start  # the second step's peak
            out[name] = {"setup": setup, "step": step, "peak": peak, **_host(recipe.optimizer)}
    return out


def _host(optimizer) -> dict[str, int]:
    """The offloaded optimizer's host bytes: its state (fp32 master, m, v, the 0-dim step
    counters) and the pinned gradient copies of its host parameters."""
    import torch

    state = grads = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        hybrid = inner.optimizer
        for values in hybrid.state.values():
            for value in values.values():
                if torch.is_tensor(value) and value.device.type == "cpu":
                    state += value.numel() * value.element_size()
        for copy in getattr(hybrid, "cpu_copy_map_grad", {}).values():
            grads += copy.numel() * copy.element_size()
    return {"host_optimizer_state": state, "host_gradient_copy": grads}


def _shards(layout: Layout):
    """Each rank's shard of the distributed optimizer (and what it offloads), by the planner."""
    return rank_shards(MODEL, 1, 1, 1, 0, DP, float(layout.optimizer_offload_fraction))


def _predicted(layout: Layout, after_step: bool) -> list[int]:
    """The planner's device bytes of weights, gradients and optimizer state, per rank."""
    return [
        sum(ddp_state_bytes(shard, layout, after_step=after_step).values())
        for shard in _shards(layout)
    ]


def test_offload_and_bf16_gradient_device_bytes_equal_the_planners_at_dp2(tmp_path):
    per_rank = run_distributed(_w_measure, DP, str(tmp_path), timeout=600, emulate_npu=True)
    failures = []
    for name, (layout, _) in LAYOUTS.items():
        for key in ("setup", "step", "peak"):
            measured = [r["resident"][key] - r[name][key] for r in per_rank]
            after_step = key != "setup"  # the peak: in a step, the state as after one
            predicted = [
                resident - run
                for resident, run in zip(
                    _predicted(RESIDENT, after_step), _predicted(layout, after_step)
                )
            ]
            if (
                key == "peak"
                and layout.grad_reduce_in_bf16
                and not layout.optimizer_offload_fraction
            ):
                # the distributed optimizer's fp32 gradients of its shard (4 B an element) exist
                # from its step (_copy_model_grads_to_main_grads) to the next zero_grad
                # (set_to_none), not in the backward, where the peak falls: the planner, which
                # counts them, is 4 B x shard high there
                predicted = [p + 4 * shard.elements for p, shard in zip(predicted, _shards(layout))]
            print(f"{name}, after {key}: measured {measured}, planner {predicted}")
            if measured != predicted:
                failures.append((name, key, measured, predicted))
        # the host: the offloaded state and gradient copies of each rank, after the step
        host = [ddp_host_bytes(shard, layout.host_moment_dtype) for shard in _shards(layout)]
        measured = [{k: r[name][k] for k in host[0]} for r in per_rank]
        print(f"{name}, host: measured {measured}, planner {host}")
        if layout.optimizer_offload_fraction and measured != host:
            failures.append((name, "host", measured, host))
        # the plan holds the worst rank's bytes (the offload rung's, not the resident one's)
        plan = plan_memory(MODEL, SEQ, layout).per_device
        worst = max(_predicted(layout, True))
        assert plan["weights"] + plan["gradients"] + plan["optimizer_state"] == worst, name
    assert not failures, failures
