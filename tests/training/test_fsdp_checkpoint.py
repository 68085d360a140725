"""``--use-megatron-fsdp`` checkpoints (``--ckpt-format fsdp_dtensor``): saved, resumed exactly
(also at another data x context parallel size), verified, and crossed with torch_dist checkpoints.

Oracles: the uninterrupted run (a resume must give its per-iteration loss and grad norm
exactly, fp32; after a change of data x context parallel size to 1e-5 relative, only the
reductions' order differing); for weights crossing kinds, the saving run's own full weights,
gathered here with megatron-FSDP's ``gather_and_compute_chunk_metadata``
(``tests/_support/recipe_runs.py``'s ``full_weights``), not by the code under test; for
resharded optimizer state, the saving run's fp32 weights and Adam moments gathered the same
way, bit for bit; for damaged and forged files, the byte this test flipped and a side effect
that must not happen. One launch per world size loops over the configurations (process
start-up dominates; the reshard test needs a second DP2 launch, after DP4's save).
"""

from __future__ import annotations

import os

import pytest
import torch

from _support.dist_utils import retried_after_a_lost_rank, run_distributed
from _support.exports import assert_exports
from _support.recipe_runs import TINY, full_weights

STEPS, SAVED = 4, 2
STRATEGIES = {
    "zero3": ["--use-megatron-fsdp"],  # optim_grads_params
    "zero2": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
}


def _tiny():
    return [*TINY, "--train-iters", str(STEPS)]


def _recipe(flags, save, load=None):
    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training import loop

    argv = [*_tiny(), *flags, "--save", save] + (["--load", load] if load else [])
    config = parse_config(argv)
    distributed.init_distributed(config)
    return loop.PretrainRecipe(config)


def _steps(recipe, count):
    """``count`` iterations: ``[(loss, grad norm)]``."""
    return [recipe.train_step()[:2] for _ in range(count)]


def _w_resume(rank, world_size, runs, root):
    """Per ``(name, flags)``: the uninterrupted run's STEPS iterations, and a run saved after
    SAVED iterations then resumed in a new recipe for the rest."""
    from megatron.core import parallel_state

    results = {}
    for name, flags in runs:
        save = os.path.join(root, name)
        outcome = {}
        for phase in ("straight", "first", "resumed"):
            recipe = _recipe(
                flags,
                save if phase != "straight" else save + "-straight",
                load=save if phase == "resumed" else None,
            )
            try:
                count = SAVED if phase == "first" else STEPS - recipe.iteration
                outcome[phase] = _steps(recipe, count)
                if phase == "first":
                    recipe.save()
                outcome[f"{phase}-iteration"] = recipe.iteration
            finally:
                recipe.cleanup()
                parallel_state.destroy_model_parallel()
        results[name] = outcome
    return results


def _assert_exact_resume(per_rank):
    for name, outcome in per_rank[0].items():
        straight = outcome["straight"]
        assert outcome["first"] == straight[:SAVED], name
        assert outcome["resumed"] == straight[SAVED:], (name, outcome, straight)
        assert outcome["resumed-iteration"] == STEPS


def test_fsdp_resume_is_exact_for_each_strategy(tmp_path):
    """optim_grads_params and optim_grads at DP2 on the CPU: saved after 2 iterations and
    resumed, iterations 3 and 4 give the uninterrupted run's loss and grad norm exactly."""
    per_rank, root = retried_after_a_lost_rank(
        lambda root: run_distributed(_w_resume, 2, list(STRATEGIES.items()), root, timeout=600),
        str(tmp_path),
    )
    _assert_exact_resume(per_rank)
    saved = os.path.join(root, "zero3", "iter_0000002")
    assert {"common.pt", ".metadata", "manifest.json"} <= set(os.listdir(saved))


def test_fsdp_resume_is_exact_on_the_emulated_npu(tmp_path):
    """The same on the emulated NPU (npu tensors, HCCL-strict groups): DCP writes npu
    DTensors (``per_thread_copy_ahead=0``) and the one metadata gather runs on HCCL."""
    per_rank, _ = retried_after_a_lost_rank(
        lambda root: run_distributed(
            _w_resume, 2, list(STRATEGIES.items()), root, timeout=600, emulate_npu=True
        ),
        str(tmp_path),
    )
    _assert_exact_resume(per_rank)


def _w_crossing(rank, world_size, root):
    """FSDP and torch_dist checkpoints at DP2: each kind's weights loaded into the other kind's
    model (``full_weights`` of both sides returned), and the optimizer state of the other
    kind refused (the messages returned)."""
    from megatron.core import parallel_state

    fsdp_dir, dist_dir = os.path.join(root, "fsdp"), os.path.join(root, "dist")
    out = {}

    def run(flags, save, load=None, steps=0, body=None):
        recipe = _recipe(flags, save, load)
        try:
            _steps(recipe, steps)
            if steps:
                recipe.save()
            return body(recipe) if body else None
        finally:
            recipe.cleanup()
            parallel_state.destroy_model_parallel()

    out["fsdp saved"] = run(
        STRATEGIES["zero3"], fsdp_dir, steps=SAVED, body=lambda r: full_weights(r.model_chunks[0])
    )
    distopt = ["--use-distributed-optimizer"]
    out["fsdp -> ddp"] = run(
        [*distopt, "--no-load-optim"],
        os.path.join(root, "a"),
        fsdp_dir,
        body=lambda r: (r.iteration, full_weights(r.model_chunks[0])),
    )
    out["dist saved"] = run(
        distopt, dist_dir, steps=SAVED, body=lambda r: full_weights(r.model_chunks[0])
    )

    out["dist -> fsdp"] = run(  # loaded into the bare model before FSDP shards it
        [*STRATEGIES["zero3"], "--finetune"],
        os.path.join(root, "b"),
        dist_dir,
        body=lambda r: ((r.iteration, r.consumed_samples), full_weights(r.model_chunks[0])),
    )

    refusals = {}
    for name, flags, load in (
        ("fsdp state into ddp", distopt, fsdp_dir),
        ("dist state into fsdp", STRATEGIES["zero3"], dist_dir),
        ("fsdp weights alone into fsdp", [*STRATEGIES["zero3"], "--no-load-optim"], fsdp_dir),
    ):
        try:
            run(flags, os.path.join(root, name.replace(" ", "_")), load)
        except ValueError as error:
            refusals[name] = str(error)
    out["refusals"] = refusals
    return out


def test_weights_cross_between_fsdp_and_torch_dist_and_optimizer_state_is_refused(tmp_path):
    """An FSDP checkpoint's weights load into a run without FSDP (``--no-load-optim``: its
    iteration kept), a torch_dist checkpoint's into an FSDP model (loaded before sharding),
    each equal to the saving run's full weights; the other kind's optimizer state is refused
    naming --no-load-optim and --finetune; ``convert mcore-to-hf`` exports the FSDP checkpoint."""
    per_rank, root = retried_after_a_lost_rank(
        lambda root: run_distributed(_w_crossing, 2, root, timeout=600), str(tmp_path)
    )
    result = per_rank[0]
    iteration, into_ddp = result["fsdp -> ddp"]
    assert iteration == SAVED
    _assert_same_weights(into_ddp, result["fsdp saved"])
    counters, into_fsdp = result["dist -> fsdp"]
    assert counters == (0, 0)  # --finetune: iteration 0
    _assert_same_weights(into_fsdp, result["dist saved"])
    refusals = result["refusals"]
    assert set(refusals) == {
        "fsdp state into ddp",
        "dist state into fsdp",
        "fsdp weights alone into fsdp",  # Megatron-FSDP has no model-to-main update
    }, refusals
    for message in refusals.values():
        assert "--no-load-optim" in message and "--finetune" in message, message
        assert "--use-megatron-fsdp" in message, message
    assert_exports(
        os.path.join(root, "fsdp"), os.path.join(root, "hf"), result["fsdp saved"], SAVED
    )


def _assert_same_weights(got: dict, expected: dict) -> None:
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def _full_optimizer_state(recipe) -> dict:
    """``{parameter name: {"param", "exp_avg", "exp_avg_sq": the full fp32 tensor, "step"}}``
    of the FSDP run's optimizer, gathered without the checkpoint code under test: every rank's
    local shard of the optimizer's own DTensor parameters and of torch Adam's state for them,
    placed at the offset megatron-FSDP's ``gather_and_compute_chunk_metadata`` gives. Asserted:
    every element is held by some rank, and ranks holding the same element (TP ranks of a
    replicated weight) agree."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        gather_and_compute_chunk_metadata,
    )

    model, optimizer = recipe.model_chunks[0], recipe.optimizer
    (inner,) = getattr(optimizer, "chained_optimizers", [optimizer])
    names = {id(p): name.removeprefix("module.module.") for name, p in model.named_parameters()}
    mine = {}
    for group in inner.optimizer.param_groups:
        for param in group["params"]:
            offsets = tuple(gather_and_compute_chunk_metadata(param).offsets)  # collective
            state = inner.optimizer.state.get(param, {})
            local = {"param": param.to_local()}
            local |= {k: state[k].to_local() for k in ("exp_avg", "exp_avg_sq") if k in state}
            step = state["step"].item() if "step" in state else None
            mine[names[id(param)]] = (tuple(param.shape), offsets, local, step)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    full = {}
    for name, (shape, _, _, _) in mine.items():
        tensors = {k: torch.zeros(shape) for k in ("param", "exp_avg", "exp_avg_sq")}
        written = {k: torch.zeros(shape, dtype=torch.int64) for k in tensors}
        steps = set()
        for rank_state in gathered:
            _, offsets, local, step = rank_state[name]
            if local["param"].numel() == 0:
                continue
            steps.add(step)
            at = tuple(slice(o, o + n) for o, n in zip(offsets, local["param"].shape))
            for k in tensors:
                before = written[k][at] > 0  # held by another rank too (replicated over TP)
                assert torch.equal(tensors[k][at][before], local[k][before]), (name, k)
                tensors[k][at] = local[k]
                written[k][at] += 1
        for k, count in written.items():
            assert bool((count > 0).all()), (name, k, "not held by any rank")
        assert len(steps) == 1, (name, steps)
        full[name] = {**tensors, "step": steps.pop()}
    return full


def _w_reshard(rank, world_size, root, runs):
    """Per ``(name, flags, load)`` (``optim_grads_params``; ``load`` None or another run's
    name): without ``load``, an uninterrupted run of STEPS iterations that saves after SAVED
    ("steps": its ``(loss, grad norm)``; "saved": :func:`_full_optimizer_state` right after
    the save); with ``load``, that run's checkpoint resumed here ("at": the iteration it
    resumed at, "loaded": the state right after the load, "steps": the remaining iterations)."""
    from megatron.core import parallel_state

    results = {}
    for name, flags, load in runs:
        recipe = _recipe(
            [*STRATEGIES["zero3"], *flags],
            os.path.join(root, name),
            os.path.join(root, load) if load else None,
        )
        try:
            if load is None:
                out = {"steps": _steps(recipe, SAVED)}
                recipe.save()
                out["saved"] = _full_optimizer_state(recipe)
                out["steps"] += _steps(recipe, STEPS - SAVED)
            else:
                out = {"at": recipe.iteration, "loaded": _full_optimizer_state(recipe)}
                out["steps"] = _steps(recipe, STEPS - recipe.iteration)
        finally:
            recipe.cleanup()
            parallel_state.destroy_model_parallel()
        results[name] = out
    return results


def _reshard_launches(root: str, launches: list) -> dict:
    """``{run name: rank 0's outcome}`` of :func:`_w_reshard` over ``[(world size, runs)]``,
    launched in order (a lost gloo rank retries the whole sequence once, in fresh directories)."""

    def launch(root):
        results = {}
        for world_size, runs in launches:
            results |= run_distributed(_w_reshard, world_size, root, runs, timeout=600)[0]
        return results

    return retried_after_a_lost_rank(launch, root)[0]


def _assert_resumes_as_saved(results: dict, resumed: str, saved: str) -> None:
    """The run ``resumed`` holds, right after loading ``saved``'s checkpoint, the optimizer
    state ``saved`` held right after writing it, bit for bit (fp32 weights, Adam's moments,
    its step), and its remaining iterations give the loss and grad norm of ``saved``'s own
    continuation to 1e-5 relative (fp32; only the order of the reductions differs)."""
    got, expected = results[resumed], results[saved]
    assert got["at"] == SAVED, (resumed, got["at"])
    assert expected["saved"], saved  # the saving run held Adam state, no moment all zeros
    assert all(
        state[k].any() for state in expected["saved"].values() for k in ("exp_avg", "exp_avg_sq")
    )
    assert set(got["loaded"]) == set(expected["saved"]), resumed
    for name, state in expected["saved"].items():
        loaded = got["loaded"][name]
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[key], state[key]), (resumed, name, key)
        assert loaded["step"] == state["step"] == SAVED, (resumed, name)
    continued = [value for step in expected["steps"][SAVED:] for value in step]
    assert [value for step in got["steps"] for value in step] == pytest.approx(
        continued, rel=1e-5
    ), (resumed, got["steps"], expected["steps"])


@pytest.mark.slow  # a 4-rank launch
def test_fsdp_optimizer_state_reshards_between_dp2_and_dp4(tmp_path):
    """optim_grads_params saved at DP2 resumes at DP4 and saved at DP4 resumes at DP2 (three
    launches: DP2 saves, DP4 saves and resumes DP2's, DP2 resumes DP4's): each resumed run
    holds the saving run's optimizer state bit for bit and continues as it did."""
    dp2, dp4 = ("dp2", [], None), ("dp4", [], None)
    results = _reshard_launches(
        str(tmp_path),
        [(2, [dp2]), (4, [dp4, ("dp4-from-dp2", [], "dp2")]), (2, [("dp2-from-dp4", [], "dp4")])],
    )
    _assert_resumes_as_saved(results, "dp4-from-dp2", "dp2")
    _assert_resumes_as_saved(results, "dp2-from-dp4", "dp4")


def test_fsdp_optimizer_state_of_dp2_resumes_at_cp2_and_at_dp1(tmp_path):
    """optim_grads_params saved at DP2 resumes at DP1 x CP2 (the same data x context parallel
    size: the same cut) and, on megatron-core 0.19 (FSDP at size 1 doubles the gradients
    before), in one process: the saving run's optimizer state bit for bit, and its loss and
    grad norm. The megatron calls of the DP2 <-> DP4 test, fast enough for CI's 0.19 job."""
    from mcore_flash.runtime import config_checks

    launches = [(2, [("dp2", [], None), ("cp2-from-dp2", ["--context-parallel-size", "2"], "dp2")])]
    at_dp1 = config_checks._megatron_release() >= config_checks.DP1_FIXED_IN
    if at_dp1:
        launches.append((1, [("dp1-from-dp2", [], "dp2")]))
    results = _reshard_launches(str(tmp_path), launches)
    _assert_resumes_as_saved(results, "cp2-from-dp2", "dp2")
    if at_dp1:
        _assert_resumes_as_saved(results, "dp1-from-dp2", "dp2")


FSDP_LAYOUT = {
    "format": "fsdp_dtensor",
    "distributed": True,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "data_context_parallel_size": 2,
    "exp_avg_dtype": "fp32",
    "exp_avg_sq_dtype": "fp32",
}


@pytest.mark.parametrize(
    "now,expected",
    [
        ({"tensor_model_parallel_size": 2}, "only at --tensor-model-parallel-size 1"),
        ({"format": "torch_dist"}, "saved with --use-megatron-fsdp"),
    ],
)
def test_fsdp_optimizer_state_refuses_another_layout_by_name(now, expected):
    """What FSDP optimizer state cannot reload into (another TP size, a run without FSDP) is
    refused before any tensor is read, naming the way out; the saved layout as
    Checkpointer.save records it, this run's given (no process group needed)."""
    from mcore_flash.checkpoint import compatibility

    with pytest.raises(ValueError, match=expected) as error:
        compatibility.check_optimizer_layout(
            "/ckpt", {"optimizer_layout": FSDP_LAYOUT}, {**FSDP_LAYOUT, **now}
        )
    assert "--no-load-optim" in str(error.value), error.value


@pytest.mark.parametrize("size", [1, 4])
def test_fsdp_optimizer_state_is_accepted_at_another_data_context_parallel_size(size):
    """Another data x context parallel size passes the check (DCP reshards the state:
    ``test_fsdp_optimizer_state_reshards_between_dp2_and_dp4``), at the saved TP size."""
    from mcore_flash.checkpoint import compatibility

    layout = {**FSDP_LAYOUT, "data_context_parallel_size": size}
    compatibility.check_optimizer_layout("/ckpt", {"optimizer_layout": FSDP_LAYOUT}, layout)


def test_fsdp_weights_into_a_run_without_fsdp_refuse_another_tp_size_or_pipelining(monkeypatch):
    """An FSDP checkpoint's DTensors are the TP shards side by side (SwiGLU's fc1 interleaved
    per TP rank): a run without FSDP at another TP size is refused naming the flag; so is one
    with pipeline stages (the DTensors carry the whole model's layer numbers, a stage reads
    its own local ones)."""
    from megatron.core import parallel_state

    from mcore_flash.checkpoint import compatibility

    common = {"ckpt_format": "fsdp_dtensor", "optimizer_layout": FSDP_LAYOUT}
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match="pass --tensor-model-parallel-size 1"):
        compatibility.check_fsdp_weights_layout("/ckpt", common)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    compatibility.check_fsdp_weights_layout("/ckpt", common)  # the saved layout: accepted
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match="only at --pipeline-model-parallel-size 1"):
        compatibility.check_fsdp_weights_layout("/ckpt", common)
