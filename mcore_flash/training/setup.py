"""The trainer's setup builders, shared by :class:`~mcore_flash.training.loop.PretrainRecipe`
and the dry run (:mod:`.dry_run`): this rank's model chunks in megatron's DDP (or FSDP)
wrapper, megatron's optimizer and learning-rate scheduler, the model config's hooks for
megatron's schedules, and the batch splitter (context parallelism, packed documents)."""

from __future__ import annotations

import functools

from mcore_flash import platform
from mcore_flash.checkpoint import checkpointer
from mcore_flash.runtime.config import TrainingConfig
from mcore_flash.runtime.model import build_model_chunks
from mcore_flash.training import fsdp, fsdp2, offload
from mcore_flash.transformer.context_parallel import get_batch_on_this_cp_rank
from mcore_flash.transformer.packed_sequences import pack_documents


def data_parallel_model_chunks(
    config: TrainingConfig, model_config, padded_vocab_size: int, model_args: dict
) -> list:
    """This rank's GPTModel chunks on the device, each in megatron's ``DistributedDataParallel``
    (fp32 gradient buffers, bf16 with ``--grad-reduce-in-bf16``; reduce-scattered with the
    distributed optimizer; the chunks after the first in one bucket each, as Megatron-LM:
    their gradients are ready only at the end of the pipeline's backward), or with
    ``--use-megatron-fsdp`` in its ``FullyShardedDataParallel`` (:mod:`.fsdp`), or with
    ``--use-torch-fsdp2`` in torch FSDP2 (:mod:`.fsdp2`). Weights of a
    checkpoint written without FSDP (``--finetune`` / ``--no-load-optim``: a converted Hugging
    Face checkpoint, say) go into the bare model first: FSDP copies them into its shards."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    device = platform.torch_device()
    if config.fsdp2:  # one chunk; offloaded, it goes to the device one layer at a time
        (model,) = build_model_chunks(config, model_config, padded_vocab_size)
        if not config.fsdp2.offload_to_cpu:
            model = model.to(device)
        return [fsdp2.torch_fully_sharded(config, model_config, model, device)]
    chunks = [
        chunk.to(device) for chunk in build_model_chunks(config, model_config, padded_vocab_size)
    ]
    if config.use_megatron_fsdp:  # one chunk: FSDP runs at --pipeline-model-parallel-size 1
        if config.finetune or config.no_load_optim:
            checkpointer.load_weights_before_sharding(
                config.load, chunks[0], padded_vocab_size, model_args
            )
        return [fsdp.fully_sharded(config, model_config, chunks[0], device)]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not config.grad_reduce_in_bf16,
        overlap_grad_reduce=config.overlap_grad_reduce,
        overlap_param_gather=config.overlap_param_gather,
        use_distributed_optimizer=config.use_distributed_optimizer,
    )
    return [
        DistributedDataParallel(model_config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]


def megatron_optimizer(config: TrainingConfig, model_config, model_chunks: list):
    """megatron's Adam (distributed with ``--use-distributed-optimizer``) over the chunks.
    Under FSDP2 the parameters it steps are the fp32 shards (FSDP2 casts what it gathers):
    megatron's fp32 optimizer, whatever the run's precision."""
    from megatron.core.optimizer import OptimizerConfig

    mixed = not config.fsdp2
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        min_lr=config.min_lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        clip_grad=config.clip_grad,
        bf16=config.bf16 and mixed,
        fp16=config.fp16 and mixed,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=config.use_distributed_optimizer,
        **offload.optimizer_settings(config),
    )
    return offload.build_optimizer(config, optimizer_config, model_chunks)


def lr_scheduler(config: TrainingConfig, optimizer):
    """Linear warm-up over ``--lr-warmup-iters``, then ``--lr-decay-style`` down to ``--min-lr``
    at ``--train-iters``; megatron counts its steps in samples (sequences)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    samples = config.train_iters * config.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_iters * config.global_batch_size,
        lr_decay_steps=samples,
        lr_decay_style=config.lr_decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=samples,
        wd_incr_style="constant",
    )


def connect_model_config(
    config: TrainingConfig, model_config, model_chunks: list, optimizer
) -> None:
    """Give megatron's schedule what it calls through the ``TransformerConfig``, as Megatron-LM's
    ``setup_model_and_optimizer`` does: the gradient finalisation, loss scaling, each chunk's
    no-sync context and, with ``--overlap-grad-reduce``, each chunk's gradient reduction
    (the interleaved schedule starts a chunk's as soon as its last backward is done)."""
    from megatron.core.distributed import finalize_model_grads

    from mcore_flash.platform.megatron_finalize_host_grads import finalize_fsdp2_grads

    def per_chunk(functions: list):
        return functions[0] if len(functions) == 1 else functions

    model_config.finalize_model_grads_func = (
        finalize_fsdp2_grads if config.fsdp2 else finalize_model_grads
    )
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.no_sync_func = per_chunk([chunk.no_sync for chunk in model_chunks])
    if config.overlap_grad_reduce:
        model_config.grad_sync_func = per_chunk([chunk.start_grad_sync for chunk in model_chunks])


def batch_splitter(config: TrainingConfig, tokenizer):
    """``batch -> (this rank's batch, packed_seq_params or None)``.

    Plain: chunks r and 2cp-1-r of every sample (a no-op at CP=1). ``--reset-attention-mask``:
    the micro-batch becomes one pack of documents cut after every EOD token, each document
    split over the CP ranks (:mod:`mcore_flash.transformer.packed_sequences`).
    """
    if not config.reset_attention_mask:
        return lambda batch: (get_batch_on_this_cp_rank(batch), None)
    eod = getattr(tokenizer, "eod", None)
    if eod is None or eod < 0:
        raise ValueError(
            f"--reset-attention-mask cuts documents at the tokenizer's EOD token, and {type(tokenizer).__name__} "
            "has none: use a tokenizer with an end-of-document id (and data preprocessed with --append-eod)"
        )
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return functools.partial(pack_documents, eod=eod, pad_to_multiple_of=multiple)
