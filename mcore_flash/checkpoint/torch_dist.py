"""Megatron's ``dist_checkpointing`` (``--ckpt-format torch_dist``): the model chunks'
sharded state dicts (any TP/PP/DP layout loads any other), the distributed optimizer's
``dp_reshardable`` state and the scheduler. ``model_chunks``: this rank's chunks in megatron's
``DistributedDataParallel`` (or bare GPTModels, for the weights alone); every function is
collective."""

from __future__ import annotations

import inspect
import sys

import torch


def save(path: str, model_chunks: list, optimizer, scheduler, common: dict) -> None:
    """The model, optimizer and scheduler with the ``common`` counters into ``path``."""
    from megatron.core import dist_checkpointing

    from mcore_flash.platform.megatron_sync_save_queue import in_process_write_results

    with in_process_write_results():
        dist_checkpointing.save(
            _interned(
                {**_sharded_state(model_chunks, optimizer, scheduler, is_loading=False), **common}
            ),
            path,
        )


def async_request(path: str, model_chunks: list, optimizer, scheduler, common: dict):
    """megatron's ``AsyncRequest`` writing the torch_dist checkpoint into ``path``: the common
    state is written now, the shards (staged to host memory first) by the forked writer.
    megatron-core's own writer (``async_strategy="mcore"``): 0.19 defaults to NVIDIA's
    ``nvidia-resiliency-ext`` package instead (CUDA-only, not a dependency here) and logs that
    its own is deprecated; 0.16 has only its own."""
    from megatron.core import dist_checkpointing

    strategy = {}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        strategy = {"async_strategy": "mcore"}
    return dist_checkpointing.save(
        _interned(
            {**_sharded_state(model_chunks, optimizer, scheduler, is_loading=False), **common}
        ),
        path,
        async_sharded_save=True,
        **strategy,
    )


def load(path: str, model_chunks: list, optimizer, scheduler) -> None:
    """Weights, optimizer state and scheduler of the checkpoint at ``path``."""
    from megatron.core import dist_checkpointing

    _materialise_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(
        _sharded_state(model_chunks, optimizer, scheduler, is_loading=True), path
    )
    _load_chunk_states(model_chunks, loaded)
    with torch.no_grad():  # the distributed optimizer copies into views of fp32 parameters
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer, loaded["optimizer"])
    _restore_sharded_state(optimizer)
    scheduler.load_state_dict(loaded["scheduler"])


def load_model(path: str, model_chunks: list) -> None:
    """The weights alone of the checkpoint at ``path`` into ``model_chunks``."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(
        _sharded_state(model_chunks, None, None, is_loading=True), path
    )
    _load_chunk_states(model_chunks, loaded)


def _model_keys(model_chunks: list) -> list[str]:
    """Megatron-LM's keys of the chunks' states: ``model``, or ``model0``, ``model1``, ... with
    the interleaved schedule (the tensors inside carry global layer numbers either way)."""
    if len(model_chunks) == 1:
        return ["model"]
    return [f"model{index}" for index in range(len(model_chunks))]


def _load_chunk_states(model_chunks: list, loaded: dict) -> None:
    """Each chunk's weights from ``loaded``; a torch FSDP2 chunk has them already:
    ``dist_checkpointing.load`` wrote into its shards, the tensors its state dict holds
    (megatron's ``TorchFullyShardedDataParallel.load_state_dict`` is a no-op for that reason)."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
    )

    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        if not isinstance(chunk, TorchFullyShardedDataParallel):
            _unwrap(chunk).load_state_dict(loaded[key])


def _sharded_state(model_chunks: list, optimizer, scheduler, is_loading: bool) -> dict:
    """The sharded part: the model chunks, and optimizer + scheduler unless ``optimizer`` is None."""
    model_state = {
        key: _unwrap(chunk).sharded_state_dict()
        for key, chunk in zip(_model_keys(model_chunks), model_chunks)
    }
    if optimizer is None:
        return model_state
    return {
        **model_state,
        # The distributed optimizer's 'dp_reshardable' format: megatron 0.16's default format is
        # refused by its own dist_checkpointing, and 'fully_reshardable' cannot load without
        # apex/TE (it drops torch Adam's per-parameter 'step'). So a distributed-optimizer
        # run resumes with any DP size but the same TP/PP; the plain optimizer reshards freely.
        "optimizer": optimizer.sharded_state_dict(
            model_state,
            is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "dp_reshardable"},
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
        groups = (
            state.get("optimizer", {}).get("param_groups", []) if isinstance(state, dict) else []
        )
        steps = {group["step"] for group in groups if "step" in group}
        if not hasattr(inner, "_init_optimizer_states_with_dummy_values") or len(steps) != 1:
            continue  # the plain optimizer restores torch's own state dict, steps included
        step = float(steps.pop())
        for param_state in inner.optimizer.state.values():
            param_state["step"] = torch.tensor(step)


def _interned(state):
    """``state``'s dicts, lists and tuples rebuilt with every string interned, so that equal
    state pickles into equal bytes (``common.pt``): pickle writes a string it has seen as a
    reference to the same object, and a resumed run's strings (a loaded optimizer's
    ``param_groups`` keys) are other objects than an uninterrupted run's (the code's
    constants)."""
    if isinstance(state, str):
        return sys.intern(state)
    if type(state) is dict:
        return {_interned(key): _interned(value) for key, value in state.items()}
    if type(state) in (list, tuple):
        return type(state)(_interned(item) for item in state)
    return state


def _restore_sharded_state(optimizer) -> None:
    """Make the loaded Adam state of each torch FSDP2 parameter (a DTensor) a DTensor sharded as
    the parameter, its local shard where the parameter's is (the host, with FSDP2's offload):
    megatron's optimizer checkpoint holds, and so loads, the local shards, which torch's
    ``load_state_dict`` moves to the parameter's mesh device; torch's Adam refuses to mix plain
    tensors and DTensors, or host and device shards."""
    from torch.distributed.tensor import DTensor

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param, state in inner.optimizer.state.items():
            if not isinstance(param, DTensor):
                continue
            home = param.to_local().device
            for key, value in state.items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    continue
                local = value.to_local() if isinstance(value, DTensor) else value
                if isinstance(value, DTensor) and local.device == home:
                    continue
                # as FSDP2 makes its host shards (``_fsdp_common._from_local_no_grad``):
                # ``DTensor.from_local`` would move the shard to the mesh's device
                state[key] = DTensor(local.to(home), param._spec, requires_grad=False)


def _unwrap(model):
    return getattr(model, "module", model)
