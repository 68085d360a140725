"""``mcore-flash pretrain --dry-run``: check a cluster launch on one CPU, allocating next to nothing.

Provides :func:`dry_run` (its result is what ``pretrain --dry-run`` prints before the planner's
verdict) and :func:`shrunk_config`. The flags are validated for ``WORLD_SIZE`` ranks; then, in
a fake process group of that size (this process is rank 0: megatron sees the real TP/PP/CP/DP
layout, collectives are no-ops), for every pipeline stage: step 1 builds its model chunks on
the meta device at the full shape and counts their parameters (:func:`_count_parameters`);
step 2 builds them again as the trainer does for training, by its own functions
(:mod:`mcore_flash.training.setup`), at a shrunk shape (:func:`_build_for_training`), so a
flag that only those constructors read is checked by them. The shrunk shape keeps the layers,
heads, query groups and every other flag, with a hidden and FFN size of ``SHRUNK_HEAD_DIM``
per head and ``SHRUNK_VOCAB_PER_TP_RANK`` vocabulary rows per TP rank: a few MB a stage.
Parameter counts are the full shape's; whether its bytes fit is the planner's verdict. With
``--optimizer-cpu-offload`` it runs on the emulated NPU (:mod:`mcore_flash.emulation`), else
on the CPU. Left out: the results of collectives (megatron's optimizer gets fake gloo groups;
Megatron-FSDP's shard check keeps its local half: :func:`_fsdp_checks_of_this_rank_only`).
The manual: docs/pretrain.md, section "Checking a launch: ``--dry-run``".
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch

from mcore_flash.checkpoint.model_args import model_args
from mcore_flash.runtime.config import TrainingConfig, preset_shape
from mcore_flash.runtime.model import build_model_chunks, transformer_config
from mcore_flash.runtime.tokenizer import tokenizer_and_vocab

# the shrunk shape of step 2: hidden size per attention head, vocabulary rows per TP rank
SHRUNK_HEAD_DIM = 2
SHRUNK_VOCAB_PER_TP_RANK = 16


def dry_run(config: TrainingConfig) -> dict:
    """Returns ``{"per_stage": [params per rank of each stage], "total": unique parameters,
    "padded_vocab_size": embedding rows, "built": [what step 2 built, per stage],
    "shrunk": the shrunk shape's {flag: value}, "device": "cpu" or "npu (emulated)"}``. A flag
    that megatron's constructors refuse raises their error (ValueError, or what megatron
    raises). The fake world is torn down before it returns."""
    from mcore_flash.runtime.distributed import destroy_distributed

    device = _init_world(config)
    try:
        return {**_count_parameters(config), **_build_for_training(config), "device": device}
    finally:
        destroy_distributed()


def _init_world(config: TrainingConfig) -> str:
    """The fake world of ``config.world_size`` ranks, on the CPU or, with
    ``--optimizer-cpu-offload`` or ``--fsdp2-offload-to-cpu`` (which need a device apart from
    the host), on the emulated NPU; returns the device in words."""
    from mcore_flash.runtime import distributed

    streams = config.fsdp2 is not None and config.fsdp2.offload_to_cpu
    if not (config.optimizer_cpu_offload or streams):
        distributed.init_fake_world(config)
        _fake_gloo_groups()
        return "cpu"
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mcore_flash import emulation, platform

    _meta_device_context_sees_wrapped_factories()
    emulation.install()
    platform.setup("npu")
    with torch.device("meta"):  # step 1 must allocate nothing: 17 GB per 70B TP8 rank else
        if torch.empty(1).device.type != "meta":
            raise RuntimeError(
                "the emulated NPU was set up before the dry run: torch's meta device context no longer "
                "reaches torch's factories; run the dry run in a fresh process"
            )
    # init_fake_world's group, on the NPU platform (init_fake_world sets up the CPU one)
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=config.world_size, store=FakeStore())
    distributed._init_parallel_state(config, create_gloo_process_groups=False)
    _fake_gloo_groups()
    return "npu (emulated)"


def _meta_device_context_sees_wrapped_factories() -> None:
    """The emulated ``transfer_to_npu`` wraps torch's tensor factories (``torch.empty`` ...), and
    ``with torch.device("meta")`` redirects only the factories it knows by identity (the set
    ``torch.utils._device._device_constructors()`` caches on first use): computed after the
    wrapping, it holds the wrappers, whose calls of the real factories then allocate on the CPU.
    Computed here, before the emulation is installed, it holds the real ones."""
    from torch.utils._device import _device_constructors

    _device_constructors()


def _fake_gloo_groups() -> None:
    """megatron's optimizer takes the data-parallel gloo groups (for its checkpoints, which a
    dry run never writes); a fake world has none (gloo would wait for the other ranks): each
    ``*_GLOO`` group of megatron's parallel state becomes its fake group of the same ranks.
    ``destroy_model_parallel`` resets them with the rest."""
    from megatron.core import parallel_state

    for name in dir(parallel_state):
        base = name.removesuffix("_GLOO")
        if name.endswith("_GLOO") and getattr(parallel_state, name) is None:
            setattr(parallel_state, name, getattr(parallel_state, base, None))


def _count_parameters(config: TrainingConfig) -> dict:
    """Step 1: every stage's model chunks (several with the interleaved schedule) on the meta
    device at the full shape, counted."""
    from megatron.core import parallel_state

    _, vocab = tokenizer_and_vocab(config)
    if config.tokenizer_type is None and config.tokenizer_model is None:
        vocab = preset_shape(config.model).vocab_size  # the preset's own (e.g. Llama-2's 32000)
    model_config = transformer_config(config)
    per_stage, total = [], 0
    tp = config.tensor_model_parallel_size
    for stage in range(config.pipeline_model_parallel_size):
        parallel_state.set_pipeline_model_parallel_rank(stage)
        with torch.device("meta"):
            parameters = [
                p
                for chunk in build_model_chunks(config, model_config, vocab)
                for p in chunk.parameters()
            ]
        per_stage.append(sum(p.numel() for p in parameters))
        total += sum(
            p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
            for p in parameters
        )
    parallel_state.set_pipeline_model_parallel_rank(0)
    return {"per_stage": per_stage, "total": total, "padded_vocab_size": vocab}


def shrunk_config(config: TrainingConfig) -> TrainingConfig:
    """``config`` with the shrunk shape of step 2: hidden and FFN size 2 per attention head
    (the heads, query groups and layers as given); every other flag as given.

    Step 2 cannot run on the meta device: megatron allocates its gradient and parameter
    buffers with an explicit device (``torch.cuda.current_device()``, which
    :mod:`mcore_flash.platform` maps to the CPU; Megatron-FSDP's buffers alike), so a 70B
    model's would take tens of GB. The layer count is kept so that the flags that count layers
    (``--activation-offload-layers``, ``--recompute-num-layers``,
    ``--num-layers-per-virtual-pipeline-stage``) mean what they mean at the full shape."""
    hidden = SHRUNK_HEAD_DIM * config.num_attention_heads
    return dataclasses.replace(config, hidden_size=hidden, ffn_hidden_size=hidden)


def _build_for_training(config: TrainingConfig) -> dict:
    """Step 2: each stage of the shrunk shape as the trainer sets it up for training
    (:class:`~mcore_flash.training.loop.PretrainRecipe` up to the checkpoint and the data): the
    model chunks in megatron's ``DistributedDataParallel`` (or Megatron-FSDP), megatron's
    optimizer over them (distributed, precision-aware, offloaded: as the flags say), the
    learning-rate scheduler, the model config's hooks and the batch splitter; returns
    ``{"built": [{"model": wrapper class, "chunks": n, "optimizer": class}, per stage],
    "shrunk": {flag: value}}``."""
    from megatron.core import parallel_state

    from mcore_flash.training import setup

    shrunk = shrunk_config(config)
    tokenizer, _ = tokenizer_and_vocab(config)
    vocab = SHRUNK_VOCAB_PER_TP_RANK * config.tensor_model_parallel_size
    setup.batch_splitter(shrunk, tokenizer)  # --reset-attention-mask needs the tokenizer's EOD
    built = []
    for stage in range(config.pipeline_model_parallel_size):
        parallel_state.set_pipeline_model_parallel_rank(stage)
        model_config = transformer_config(shrunk)
        with _fsdp_checks_of_this_rank_only(shrunk):
            chunks = setup.data_parallel_model_chunks(
                shrunk, model_config, vocab, model_args(shrunk, vocab)
            )
        optimizer = setup.megatron_optimizer(shrunk, model_config, chunks)
        setup.lr_scheduler(shrunk, optimizer)
        setup.connect_model_config(shrunk, model_config, chunks, optimizer)
        built.append(
            {
                "model": type(chunks[0]).__name__,
                "chunks": len(chunks),
                "optimizer": _optimizer_name(optimizer),
            }
        )
        del chunks, optimizer
    parallel_state.set_pipeline_model_parallel_rank(0)
    return {
        "built": built,
        "shrunk": {
            "num_layers": shrunk.num_layers,
            "hidden_size": shrunk.hidden_size,
            "ffn_hidden_size": shrunk.ffn_hidden_size,
            "num_attention_heads": shrunk.num_attention_heads,
            "num_query_groups": shrunk.num_query_groups,
            "padded_vocab_size": vocab,
        },
    }


@contextlib.contextmanager
def _fsdp_checks_of_this_rank_only(config: TrainingConfig):
    """With ``--use-megatron-fsdp``: Megatron-FSDP's constructor checks every sharded
    parameter's shards (``validate_uneven_dtensor``, ``megatron_fsdp/uneven_dtensor.py``) by an
    all-reduce of every rank's "my shard touches the start / end" flags; in a fake world the
    all-reduce does nothing, so rank 0's shard alone would fail the end check. Inside this
    context that check keeps its local half (this rank's shard lies within the tensor)."""
    if not config.use_megatron_fsdp:
        yield
        return
    from megatron.core.distributed.fsdp.src.megatron_fsdp import (
        param_and_grad_buffer,
        uneven_dtensor,
    )

    def within_bounds(dtensor) -> None:
        chunk = uneven_dtensor.gather_and_compute_chunk_metadata(dtensor)
        for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
            if not 0 <= offset <= offset + size <= dtensor.shape[dim]:
                raise AssertionError(
                    f"[Megatron-FSDP] shard at {chunk.offsets} of {chunk.sizes} outside {tuple(dtensor.shape)}"
                )

    with mock.patch.object(param_and_grad_buffer, "validate_uneven_dtensor", within_bounds):
        yield


def _optimizer_name(optimizer) -> str:
    """megatron's optimizer class, with the classes it chains (one per model chunk / dtype)
    and the inner torch optimizer (``HybridDeviceOptimizer`` when offloaded)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    names = sorted(
        {f"{type(o).__name__}({type(getattr(o, 'optimizer', None)).__name__})" for o in inner}
    )
    return f"{type(optimizer).__name__}[{', '.join(names)}]"
