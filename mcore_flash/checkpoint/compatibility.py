"""Whether a checkpoint loads into this run: the same model, and optimizer state saved in a
layout this run's optimizer reads. Each refusal is a ValueError naming the flag to change."""

from __future__ import annotations

import torch

from mcore_flash.checkpoint.directory import FSDP_DTENSOR, TORCH_DIST
from mcore_flash.checkpoint.model_args import SHAPE_ARGS
from mcore_flash.optim.host_adam import MOMENT_DTYPES


def check_same_model(root: str, common: dict, padded_vocab_size: int, model_args: dict) -> None:
    """The checkpoint's model is this run's: same shape flags and vocabulary (errors name the flag)."""
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


def optimizer_layout(optimizer, checkpoint_format: str) -> dict:
    """What decides whether optimizer state reloads: its format (``checkpoint_format``, the
    run's: ``fsdp_dtensor`` with Megatron-FSDP), distributed or not, the TP, PP, virtual
    pipeline (1: no interleaving) and data x context parallel sizes, and the storage dtypes of
    Adam's moments."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    names = {dtype: name for name, dtype in MOMENT_DTYPES.items()}
    groups = [group for inner in inners for group in inner.optimizer.param_groups]
    return {
        "format": checkpoint_format,
        "distributed": any(isinstance(inner, DistributedOptimizer) for inner in inners),
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": (
            parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
        ),
        "data_context_parallel_size": parallel_state.get_data_parallel_world_size(
            with_context_parallel=True
        ),
        # Adam's moments (the host step's bf16 ones: mcore_flash.optim.host_adam)
        **{
            key: names[groups[0].get(key, torch.float32)] if groups else "fp32"
            for key in ("exp_avg_dtype", "exp_avg_sq_dtype")
        },
    }


def check_optimizer_layout(root: str, common: dict, now: dict) -> None:
    """Refuse optimizer state that would not load into this run's optimizer, whose
    :func:`optimizer_layout` is ``now`` (errors name the flag).

    The distributed optimizer's ``dp_reshardable`` state is cut into the DP ranks' flat
    buffers of each TP/PP shard and model chunk: it reloads under any data-parallel size, but
    only with the TP, PP and virtual pipeline sizes it was saved with. The plain optimizer's
    state is per parameter and reshards like the weights. Megatron-FSDP's reloads at any data x
    context parallel size but only at its TP size (:func:`check_fsdp_optimizer_layout`). The
    two formats do not load into each other.
    """
    saved = common.get("optimizer_layout")
    check_moment_dtypes(root, saved or {}, now)
    if saved is None:  # written before the layout was recorded
        return
    fresh = (
        "or pass --no-load-optim to load the weights, iteration and schedule with a fresh optimizer"
    )
    if saved.get("format", TORCH_DIST) != now["format"]:
        which = "with" if now["format"] == TORCH_DIST else "without"
        raise ValueError(
            f"--load {root}: its optimizer state is {saved.get('format', TORCH_DIST)}, saved {which} "
            f"--use-megatron-fsdp, and does not load into this run's {now['format']} optimizer: resume "
            f"{which} --use-megatron-fsdp, or pass --no-load-optim (or --finetune) to load its weights only"
        )
    if now["format"] == FSDP_DTENSOR:
        check_fsdp_optimizer_layout(root, saved, now)
        return
    if saved["distributed"] != now["distributed"]:
        which = "with" if saved["distributed"] else "without"
        raise ValueError(
            f"--load {root}: its optimizer state was saved {which} --use-distributed-optimizer; "
            f"resume {which} it, {fresh}"
        )
    if now["distributed"]:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
        ):
            was = saved.get(name, 1)  # checkpoints before the interleaved schedule: 1
            if was != now[name]:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"--load {root}: its distributed-optimizer state was saved at {flag} {was} and reloads "
                    f"under any data-parallel size but only at that {flag} (this run: {now[name]}); "
                    f"pass {flag} {was}, {fresh}"
                )


def check_fsdp_optimizer_layout(root: str, saved: dict, now: dict) -> None:
    """Megatron-FSDP's optimizer state reloads at any data x context parallel size but only at
    the TP size it was saved with.

    Each DTensor (weight, Adam's moments) is stored whole, its rows cut unevenly over the
    saving ranks with the offsets :func:`mcore_flash.checkpoint.fsdp_dtensor.attach_chunks` records, so DCP reads
    any other cut from them: DP2 -> DP4, DP4 -> DP2, DP2 -> DP1 x CP2 (and DP1 on megatron-core
    0.19) resume with the saved state bit for bit and the uninterrupted run's loss and grad
    norm (``tests/training/test_fsdp_checkpoint.py``). Another TP size is refused: the same
    key holds the TP shards side by side (``make_fsdp_dtensor``; SwiGLU's fc1 is each TP
    rank's gate and up halves in turn), so DCP loads it without an error into rows that mean
    something else (TP1 x DP2 -> TP2 x DP1 by hand on 0.19.2: iteration 3's loss 6.1653, the
    uninterrupted run's 6.1513)."""
    was, tp = saved.get("tensor_model_parallel_size"), now["tensor_model_parallel_size"]
    if was != tp:
        raise ValueError(
            f"--load {root}: FSDP optimizer state reloads at any data x context parallel size but only at "
            f"--tensor-model-parallel-size {was} (this run: {tp}): resume at that TP size; to change it, "
            "start a fresh optimizer from its weights: load them into a run without --use-megatron-fsdp at "
            f"--tensor-model-parallel-size {was} with --no-load-optim, whose save (torch_dist) a "
            "--use-megatron-fsdp run at any TP size loads with --finetune or --no-load-optim"
        )


def check_fsdp_weights_layout(root: str, common: dict) -> None:
    """An FSDP checkpoint's weights load without FSDP at its tensor-parallel size only: each
    DTensor is the concatenation of the TP shards (SwiGLU's fc1 interleaves gate and up per
    TP rank), which a run at another TP size would cut differently; and without pipelining:
    its keys are the whole model's (FSDP runs at PP 1), read by each stage's local names."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            f"--load {root}: its weights were saved with --use-megatron-fsdp and load without FSDP only at "
            "--pipeline-model-parallel-size 1; convert them once through a run at PP 1 (its save is "
            "torch_dist, which any layout loads), or resume with --use-megatron-fsdp"
        )
    saved = (common.get("optimizer_layout") or {}).get("tensor_model_parallel_size", 1)
    now = parallel_state.get_tensor_model_parallel_world_size()
    if saved != now:
        raise ValueError(
            f"--load {root}: its weights were saved with --use-megatron-fsdp at --tensor-model-parallel-size "
            f"{saved} and load without FSDP only at that size (this run: {now}); pass "
            f"--tensor-model-parallel-size {saved}, or --use-megatron-fsdp"
        )


def check_moment_dtypes(root: str, saved: dict, now: dict) -> None:
    """Refuse Adam moments stored in another dtype than this run's (``--exp-avg-dtype`` /
    ``--exp-avg-sq-dtype``: the offloaded host step's narrower state), naming the flag;
    ``saved`` / ``now``: the checkpoint's and this run's :func:`optimizer_layout`."""
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        was = saved.get(key, "fp32")  # checkpoints before the flags: fp32
        if was != now[key]:
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"--load {root}: its Adam moments were saved as {flag} {was}, and this run stores them as "
                f"{now[key]}; pass {flag} {was}, or --no-load-optim to load the weights, iteration and "
                "schedule with a fresh optimizer"
            )
