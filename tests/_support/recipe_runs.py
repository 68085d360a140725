"""Several short training runs in one launch (process start-up dominates on 2 cores).

    per_rank = run_distributed(w_recipe_runs, 2, [("name", flags), ...], str(tmp_path), measure)

Each run: ``mcore-flash pretrain``'s config of :data:`TINY` + its flags, :data:`STEPS`
iterations of the trainer's ``PretrainRecipe`` (no checkpoint), then
``measure(recipe, baseline)`` (top-level functions, so spawn can pickle them) gives what the
worker returns for that run, with the ``(loss, grad norm)`` of every step under ``"steps"``;
``baseline`` is what ``before()`` returned just before the run was set up (None without
``before``): e.g. the device's bytes, which earlier runs of the launch leave above zero.
"""

from __future__ import annotations

import pytest
import torch

from _support.pretrain_flags import tiny_flags

STEPS = 3
TINY = tiny_flags(micro_batch_size=1, train_iters=STEPS)


def w_recipe_runs(rank, world_size, runs, save_root, measure, before=None):
    """Worker: ``{name: {"steps": [(loss, grad norm)], **measure(recipe, baseline)}}`` of this rank."""
    from megatron.core import parallel_state

    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training import loop

    results = {}
    for name, flags in runs:
        baseline = before() if before else None
        config = parse_config([*TINY, *flags, "--save", f"{save_root}/{name}"])
        distributed.init_distributed(config)
        recipe = loop.PretrainRecipe(config)
        try:
            steps = [recipe.train_step()[:2] for _ in range(STEPS)]  # (loss, grad norm)
            results[name] = {"steps": steps, **measure(recipe, baseline)}
        finally:
            recipe.cleanup()
            parallel_state.destroy_model_parallel()
            del recipe  # before the next run's baseline
    return results


def w_stops(rank, world_size, save_root, flags):
    """Worker: two runs of :data:`TINY` + ``flags``: ``"sigterm"`` (SIGTERM raised on rank 1
    before the first iteration ends) -> ``(iteration it stopped after, latest checkpoint)``,
    and ``"diverged"`` (a lr that makes the loss infinite) -> the ``TrainingDiverged``
    message; ``"phases"``: the watchdog's progress marks of the first run's first iteration,
    in order, repeats dropped."""
    import os
    import signal

    from megatron.core import parallel_state

    from mcore_flash.checkpoint.directory import latest_iteration
    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training import loop

    outcomes = {}
    for name, extra in (
        ("sigterm", ["--train-iters", "100"]),
        ("diverged", ["--lr", "1e30", "--clip-grad", "0", "--lr-warmup-iters", "0"]),
    ):
        save = os.path.join(save_root, name)
        config = parse_config([*TINY, *flags, *extra, "--save", save])
        distributed.init_distributed(config)
        recipe = loop.PretrainRecipe(config)
        if name == "sigterm":
            outcomes["phases"] = phases = []
            mark = recipe.watchdog.phase

            def marked(phase, phases=phases, mark=mark):
                if phases[-1:] != [phase]:
                    phases.append(phase)
                mark(phase)

            recipe.watchdog.phase = marked  # the hooks look the method up at each call
            if rank == 1:
                signal.raise_signal(signal.SIGTERM)  # the handler only sets a flag
        try:
            outcomes[name] = recipe.train()["iteration"], latest_iteration(save)
        except loop.TrainingDiverged as error:
            outcomes[name] = str(error)
        finally:
            recipe.cleanup()
            parallel_state.destroy_model_parallel()
    return outcomes


def assert_stopped_as_without_a_wrapper(outcome) -> None:
    """What :func:`w_stops` returned on a rank: every rank stopped after iteration 1 and saved
    it, the divergence named ``--lr``, and the watchdog saw each phase of an iteration."""
    assert outcome["sigterm"] == (1, 1)
    assert "training diverged" in outcome["diverged"] and "--lr" in outcome["diverged"]
    phases = iter(outcome["phases"])  # each in turn, after the one before
    for phase in ("forward", "backward", "gradient reduction", "optimizer", "after the update"):
        assert any(seen.startswith(phase) for seen in phases), (phase, outcome["phases"])


def full_weights(model) -> dict[str, torch.Tensor]:
    """``{name: the full weight}`` of ``model``: megatron's DDP (the tensor-parallel shards
    concatenated along their partition dim) or FullyShardedDataParallel (its parameters are
    DTensors, unevenly sharded over data x context and tensor parallel ranks: every rank's
    shard placed at its offset (megatron-FSDP's ``gather_and_compute_chunk_metadata``), read from
    its ``state_dict()``: between steps its modules' own parameters are views of the freed
    all-gather buffers)."""
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        gather_and_compute_chunk_metadata,
    )
    from torch.distributed.tensor import DTensor

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if isinstance(model, FullyShardedDataParallel):
        named = [(k, v) for k, v in model.state_dict().items() if isinstance(v, DTensor)]
    else:
        named = list(model.named_parameters())
    weights = {}
    megatron_fsdp = isinstance(model, FullyShardedDataParallel)
    for name, param in named:
        # megatron-FSDP's DTensors span the tensor-parallel ranks too; torch FSDP2's shard
        # this rank's tensor-parallel part over the data-parallel mesh alone
        tp_dim = getattr(param, "partition_dim", 0)
        tp_split = tp > 1 and getattr(param, "tensor_model_parallel", False) and not megatron_fsdp
        if isinstance(param, DTensor):
            group = None if megatron_fsdp else param.device_mesh.get_group()
            offsets = gather_and_compute_chunk_metadata(param).offsets
            shards = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(
                shards, (offsets, param.to_local().cpu()), group=group
            )
            full = torch.zeros(param.shape, dtype=param.dtype)
            for offset, shard in shards:
                full[tuple(slice(o, o + n) for o, n in zip(offset, shard.shape))] = shard
            param = full
        if tp_split:
            parts = [None] * tp
            torch.distributed.all_gather_object(
                parts, param.detach().cpu(), group=parallel_state.get_tensor_model_parallel_group()
            )
            param = torch.cat(parts, dim=tp_dim)
        while name.startswith("module."):
            name = name.removeprefix("module.")
        weights[name] = param.detach().cpu().clone()
    return weights


def assert_same_training(result, oracle, label: str) -> None:
    """``result`` trained as ``oracle`` did (fp32): the loss and grad norm of every iteration
    (1e-5 relative; a grad norm catches a doubled gradient a loss hides) and every final
    weight (``"weights"``, :func:`full_weights`)."""
    for step, ((loss, norm), (want_loss, want_norm)) in enumerate(
        zip(result["steps"], oracle["steps"]), start=1
    ):
        assert loss == pytest.approx(want_loss, rel=1e-5), f"{label}: loss at iteration {step}"
        assert norm == pytest.approx(want_norm, rel=1e-5), f"{label}: grad norm at iteration {step}"
    assert result["weights"].keys() == oracle["weights"].keys(), label
    for name, want in oracle["weights"].items():
        torch.testing.assert_close(
            result["weights"][name],
            want,
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, name=name: f"{label} {name}: {m}",
        )


def refusal(argv, world_size: int = 2) -> str:
    """The ValueError message of the trainer's config for :data:`TINY` + ``argv``."""
    from mcore_flash.runtime.arguments import parse_config

    with pytest.raises(ValueError) as error:
        parse_config([*TINY, *argv], world_size=world_size)
    return str(error.value)
