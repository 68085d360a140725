"""The training loop, assembled from megatron-core's own parts.

GPTModel (flash spec) -> ``DistributedDataParallel`` -> ``get_megatron_optimizer``
(distributed optimizer with ``--use-distributed-optimizer``) + ``OptimizerParamScheduler``;
each iteration runs ``get_forward_backward_func()`` (no pipelining, or 1F1B across
pipeline stages) over ``global_batch / (micro_batch x dp)`` micro-batches, with per-token
loss (``calculate_per_token_loss``) so any data-parallel size gives the same update.
"""

from __future__ import annotations

import functools
import math
import signal
import time

import torch
import torch.distributed as dist

from mcore_flash import platform
from mcore_flash.training import checkpointing, faults
from mcore_flash.training.data import build_train_dataset, micro_batches, tokenizer_and_vocab
from mcore_flash.training.metrics import MetricsLogger
from mcore_flash.training.model import build_model, count_parameters, model_args, transformer_config
from mcore_flash.transformer.context_parallel import get_batch_on_this_cp_rank
from mcore_flash.transformer.packed_sequences import pack_documents


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


def train(args) -> dict:
    """Run ``args.train_iters`` iterations (resuming from ``--load``); returns a summary."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokenizer, vocab = tokenizer_and_vocab(args)
    split_batch = _batch_splitter(args, tokenizer)
    config = transformer_config(args)
    model = build_model(args, config, vocab).to(platform.torch_device())
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=args.overlap_grad_reduce,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            clip_grad=args.clip_grad,
            bf16=args.bf16,
            fp16=args.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        [model],
    )
    samples = args.train_iters * args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * args.global_batch_size,
        lr_decay_steps=samples,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=samples,
        wd_incr_style="constant",
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    faults.install(model, config)

    logger = MetricsLogger(args, count_parameters(model), vocab)
    iteration, consumed = 0, 0
    described, provenance = model_args(args, tokenizer.vocab_size), {}
    if args.load and checkpointing.latest_iteration(args.load) is not None:
        iteration, consumed, provenance = checkpointing.load_checkpoint(
            args.load, model, optimizer, scheduler, vocab, described,
            finetune=args.finetune, load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
        )  # fmt: skip
        how = "fine-tuning from" if args.finetune else "resumed from"
        logger.note(f"{how} {args.load} at iteration {iteration} ({consumed} samples consumed)")
    elif args.load:
        logger.note(f"no checkpoint in --load {args.load} yet: starting from scratch")
    for stale in checkpointing.unfinished_saves(args.load):
        logger.note(f"ignoring {stale}: a save that did not finish (the next save removes it)")
    dataset = build_train_dataset(args, tokenizer)
    data = micro_batches(
        dataset,
        args,
        consumed,
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )
    forward_backward = get_forward_backward_func()
    num_micro = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    stop = _StopSignal()
    first_loss = last_loss = None
    while iteration < args.train_iters:
        start = time.perf_counter()
        faults.begin_iteration(iteration + 1)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=functools.partial(_forward_step, split_batch),
            data_iterator=data,
            model=[model],
            num_microbatches=num_micro,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.seq_length,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        scheduler.step(increment=args.global_batch_size)
        iteration += 1
        faults.point("optimizer-step", iteration)
        consumed += args.global_batch_size
        loss = _reduce_loss(losses)
        if loss is not None and not math.isfinite(loss):
            raise TrainingDiverged(
                f"loss is {loss} at iteration {iteration}: training diverged. Lower --lr (now {args.lr}) "
                f"or --clip-grad, or resume from the last checkpoint in {args.save}"
            )
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss if loss is not None else last_loss
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            logger.log(iteration, loss, optimizer.param_groups[0]["lr"], grad_norm, time.perf_counter() - start)
        interrupted = stop.requested()
        exiting = bool(args.exit_interval) and iteration % args.exit_interval == 0
        if iteration % args.save_interval == 0 or iteration == args.train_iters or interrupted or exiting:
            path = checkpointing.save_checkpoint(
                args.save, iteration, model, optimizer, scheduler, consumed, vocab, described, provenance
            )
            logger.note(f"saved checkpoint {path}")
        if interrupted or exiting:
            reason = "a signal" if interrupted else "--exit-interval"
            logger.note(f"stopped by {reason} after iteration {iteration}; resume with --load {args.save}")
            break
    stop.restore()
    logger.close()
    return {"iteration": iteration, "first_loss": first_loss, "last_loss": last_loss, "save": args.save}


def _batch_splitter(args, tokenizer):
    """``batch -> (this rank's batch, packed_seq_params or None)``.

    Plain: chunks r and 2cp-1-r of every sample (a no-op at CP=1). ``--reset-attention-mask``:
    the micro-batch becomes one pack of documents cut after every EOD token, each document
    split over the CP ranks (:mod:`mcore_flash.transformer.packed_sequences`).
    """
    if not args.reset_attention_mask:
        return lambda batch: (get_batch_on_this_cp_rank(batch), None)
    eod = getattr(tokenizer, "eod", None)
    if eod is None or eod < 0:
        raise ValueError(
            f"--reset-attention-mask cuts documents at the tokenizer's EOD token, and {type(tokenizer).__name__} "
            "has none: use a tokenizer with an end-of-document id (and data preprocessed with --append-eod)"
        )
    multiple = args.tensor_model_parallel_size if args.sequence_parallel else 1
    return functools.partial(pack_documents, eod=eod, pad_to_multiple_of=multiple)


def _forward_step(split_batch, data_iterator, model):
    device = platform.torch_device()
    batch = {key: value.to(device) for key, value in next(data_iterator).items()}
    batch, packed_seq_params = split_batch(batch)
    output = model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=packed_seq_params
    )
    return output, functools.partial(_loss_func, batch["loss_mask"])


def _loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Sum of masked token losses and the token count of this rank's tokens (megatron
    all-reduces the count over data x context parallel ranks and divides by the total)."""
    mask = loss_mask.reshape(-1).float()
    loss = (per_token_loss.float().reshape(-1) * mask).sum()
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), mask.sum()])}


def _reduce_loss(losses: list) -> float | None:
    """Mean token loss of the iteration over all data-parallel ranks (last pipeline stage);
    None on other stages."""
    from megatron.core import parallel_state

    if not losses:
        return None
    total = torch.stack([item["lm loss"] for item in losses]).sum(dim=0)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return (total[0] / total[1]).item()


class _StopSignal:
    """Turns SIGTERM into a clean stop after the current iteration, agreed by all ranks."""

    def __init__(self):
        self._flag = False
        self._previous = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame):
        self._flag = True

    def requested(self) -> bool:
        # on the device: NCCL and HCCL groups serve device tensors only
        flag = torch.tensor([int(self._flag)], device=platform.torch_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
