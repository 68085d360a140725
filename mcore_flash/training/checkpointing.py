"""Atomic, exactly-resumable checkpoints with megatron's ``dist_checkpointing``.

Layout under ``--save`` (Megatron-LM's names)::

    iter_0000100/                       model + optimizer (sharded), scheduler, counters
        rng_rank00000.pt                each rank's RNG states (CPU, device, TP tracker)
    latest_checkpointed_iteration.txt   "100"

A checkpoint is written into ``iter_XXXXXXX.tmp/`` by all ranks, renamed to its final
name by rank 0 once every rank has finished, and only then is the marker replaced (itself
through a temporary file and ``os.replace``). A save killed at any point therefore leaves
the previous checkpoint and marker untouched; stale ``.tmp`` directories are removed by
the next save.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
from typing import Optional

import numpy
import torch
import torch.distributed as dist

MARKER = "latest_checkpointed_iteration.txt"
# Where the weights came from (a converted Hugging Face checkpoint's original config.json and
# directory): read on load and written into every later checkpoint, so an export after
# continued pretraining keeps the original token ids and metadata.
PROVENANCE_KEYS = ("hf_config", "converted_from")


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> Optional[int]:
    """The iteration the marker names, or None when ``root`` holds no finished checkpoint."""
    marker = os.path.join(root, MARKER)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        text = f.read().strip()
    if not text.isdigit() or not os.path.isdir(checkpoint_dir(root, int(text))):
        raise ValueError(f"--load {root}: {MARKER} says {text!r} but that checkpoint is missing or unreadable")
    return int(text)


def save_checkpoint(
    root: str, iteration: int, model, optimizer, scheduler, consumed_samples: int, padded_vocab_size: int,
    model_args: dict, provenance: Optional[dict] = None,
) -> str:  # fmt: skip
    """Write checkpoint ``iteration`` under ``root`` atomically (collective over all ranks)."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    if rank == 0:
        for stale in glob.glob(os.path.join(root, "iter_*.tmp")):
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    state = _sharded_state(model, optimizer, scheduler, is_loading=False)
    state.update(iteration=iteration, consumed_samples=consumed_samples, padded_vocab_size=padded_vocab_size,
                 model_args=model_args, **(provenance or {}))  # fmt: skip
    dist_checkpointing.save(state, tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank:05d}.pt"))
    dist.barrier()
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_marker(root, iteration)
    dist.barrier()
    return final


def load_checkpoint(
    root: str, model, optimizer, scheduler, padded_vocab_size: int, model_args: dict,
    finetune: bool = False, load_optim: bool = True, load_rng: bool = True,
) -> tuple[int, int, dict]:  # fmt: skip
    """Load the latest checkpoint under ``root``; returns ``(iteration, consumed_samples,
    provenance)`` (``PROVENANCE_KEYS`` of the checkpoint, for :func:`save_checkpoint`).

    Megatron-LM's modes: ``finetune`` loads the weights only and starts at iteration 0;
    ``load_optim=False`` (``--no-load-optim``) keeps the checkpoint's iteration and sample
    count but starts the optimizer afresh (the lr schedule is advanced to that point);
    ``load_rng=False`` keeps this run's seeds. Any TP/PP/DP layout loads any other
    (dist_checkpointing reshards), as long as the model and the padded vocabulary agree.
    """
    from megatron.core import dist_checkpointing

    path, common = _open_checkpoint(root, padded_vocab_size, model_args)
    load_optim = load_optim and not finetune
    if common.get("model_only") and load_optim:
        raise ValueError(
            f"--load {root} holds model weights only (converted from {common.get('converted_from')}): add --finetune "
            "to train from them starting at iteration 0 (or --no-load-optim to keep the checkpoint's iteration)"
        )
    if load_optim:
        _materialise_optimizer_state(optimizer)
        loaded = dist_checkpointing.load(_sharded_state(model, optimizer, scheduler, is_loading=True), path)
        _unwrap(model).load_state_dict(loaded["model"])
        with torch.no_grad():  # the distributed optimizer copies into views of fp32 parameters
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer, loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])
    else:
        _load_model(path, model)
        optimizer.reload_model_params()  # fp32 main parameters from the loaded weights
    provenance = {key: common[key] for key in PROVENANCE_KEYS if key in common}
    if finetune:
        return 0, 0, provenance
    consumed = int(common["consumed_samples"])
    if not load_optim:
        scheduler.step(increment=consumed)
    rng_file = os.path.join(path, f"rng_rank{dist.get_rank():05d}.pt")
    if load_rng and os.path.exists(rng_file):  # a run resumed on another world size draws fresh RNG streams
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return int(common["iteration"]), consumed, provenance


def load_weights(root: str, model, padded_vocab_size: int, model_args: dict) -> dict:
    """Load only the model weights of the latest checkpoint under ``root`` (for inference);
    returns the checkpoint's common state (iteration, ``model_args``, ...)."""
    path, common = _open_checkpoint(root, padded_vocab_size, model_args)
    _load_model(path, model)
    return common


def _open_checkpoint(root: str, padded_vocab_size: int, model_args: dict) -> tuple[str, dict]:
    path, common = read_latest(root)
    _check_same_model(root, common, padded_vocab_size, model_args)
    return path, common


def read_latest(root: str) -> tuple[str, dict]:
    """The latest checkpoint under ``root``: its directory and its common (non-tensor) state
    (iteration, ``model_args``, padded vocabulary, ...)."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(root)
    if iteration is None:
        raise ValueError(f"--load {root}: no {MARKER} there; point --load at a --save directory of an earlier run")
    path = checkpoint_dir(root, iteration)
    return path, dist_checkpointing.load_common_state_dict(path)


def _load_model(path: str, model) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_sharded_state(model, None, None, is_loading=True), path)
    _unwrap(model).load_state_dict(loaded["model"])


def read_model_args(root: str) -> dict:
    """The ``model_args`` stored with the latest checkpoint under ``root`` (``--use-checkpoint-args``)."""
    saved = read_latest(root)[1].get("model_args")
    if saved is None:
        raise ValueError(f"--use-checkpoint-args: the checkpoint in --load {root} predates stored model flags; pass them")
    return saved


def _check_same_model(root: str, common: dict, padded_vocab_size: int, model_args: dict) -> None:
    """The checkpoint's model is this run's: same shape flags and vocabulary (errors name the flag)."""
    from mcore_flash.training.model import SHAPE_ARGS

    saved = common.get("model_args") or {}
    for name in SHAPE_ARGS:
        if name in saved and saved[name] != model_args[name]:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"--load {root}: the checkpoint's model has {flag}={saved[name]}, this run {model_args[name]}; "
                f"pass {flag} as the checkpoint has it (or --use-checkpoint-args)"
            )
    if "vocab_size" in saved and saved["vocab_size"] != model_args["vocab_size"]:
        raise ValueError(
            f"--load {root}: the checkpoint's vocabulary has {saved['vocab_size']} tokens, this run's tokenizer "
            f"{model_args['vocab_size']}; train with the checkpoint's tokenizer (--tokenizer-type / --tokenizer-model)"
        )
    saved_vocab = common.get("padded_vocab_size")
    if saved_vocab != padded_vocab_size:
        raise ValueError(
            f"--load {root}: the checkpoint's embedding has {saved_vocab} rows, this run pads the vocabulary "
            f"to {padded_vocab_size} (padding is a multiple of --make-vocab-size-divisible-by x TP); choose "
            "--make-vocab-size-divisible-by so both layouts pad alike"
        )


def _sharded_state(model, optimizer, scheduler, is_loading: bool) -> dict:
    """The sharded part: model, and optimizer + scheduler unless ``optimizer`` is None."""
    model_state = _unwrap(model).sharded_state_dict()
    if optimizer is None:
        return {"model": model_state}
    return {
        "model": model_state,
        # The distributed optimizer's 'dp_reshardable' format: megatron 0.16's default format is
        # refused by its own dist_checkpointing, and 'fully_reshardable' cannot load without
        # apex/TE (it drops torch Adam's per-parameter 'step'). So a distributed-optimizer
        # run resumes with any DP size but the same TP/PP; the plain optimizer reshards freely.
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        ),
        "scheduler": scheduler.state_dict(),
    }


def _materialise_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its Adam state before loading into it.

    Its state dict needs the per-parameter state (and its ``step``), which torch's Adam only
    creates at the first step; megatron's own helper takes one zero-gradient step, whose
    values the load then overwrites in place (the scheduler's lr is 0 before warm-up, so
    the parameters do not move).
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(inner, "_init_optimizer_states_with_dummy_values") and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer, loaded_state: dict) -> None:
    """Set each parameter's torch-Adam ``step`` from the checkpoint, as its own tensor.

    Without apex/TE, megatron 0.16's distributed optimizer saves the step count in its param
    groups but does not put it back into torch Adam's per-parameter state on load (and where
    it does, one tensor is shared by every parameter, which torch then advances once per
    parameter): either way Adam's bias correction after a resume would be wrong.
    """
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [loaded_state] if len(inners) == 1 else [loaded_state[i] for i in range(len(inners))]
    for inner, state in zip(inners, states):
        groups = state.get("optimizer", {}).get("param_groups", []) if isinstance(state, dict) else []
        steps = {group["step"] for group in groups if "step" in group}
        if not hasattr(inner, "_init_optimizer_states_with_dummy_values") or len(steps) != 1:
            continue  # the plain optimizer restores torch's own state dict, steps included
        step = float(steps.pop())
        for param_state in inner.optimizer.state.values():
            param_state["step"] = torch.tensor(step)


def _unwrap(model):
    return getattr(model, "module", model)


def write_marker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, MARKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MARKER))


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    from mcore_flash import platform

    state = {
        "python": random.getstate(),
        "numpy": numpy.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if platform.device_type() != "cpu":
        state["device"] = getattr(torch, platform.device_type()).get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    from mcore_flash import platform

    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "device" in state:
        getattr(torch, platform.device_type()).set_rng_state(state["device"])
