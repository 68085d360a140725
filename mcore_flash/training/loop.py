"""The training loop as a recipe, assembled from megatron-core's own parts.

:class:`PretrainRecipe` sets a run up from a :class:`~mcore_flash.runtime.config.TrainingConfig`
(GPTModel with the flash spec -> ``DistributedDataParallel`` -> ``get_megatron_optimizer``,
distributed with ``--use-distributed-optimizer``, + ``OptimizerParamScheduler``; the
checkpoint in ``--load``; the data), then :meth:`~PretrainRecipe.train` runs one
:meth:`~PretrainRecipe.train_step` per iteration: ``get_forward_backward_func()`` (no
pipelining, or 1F1B across pipeline stages) over ``global_batch / (micro_batch x dp)``
micro-batches (interleaved 1F1B over the rank's model chunks with a virtual pipeline size),
with per-token loss (``calculate_per_token_loss``) so any data-parallel size
gives the same update, then logs, saves and stops on a signal, ``--exit-interval`` or a
non-finite loss.
"""

from __future__ import annotations

import functools
import math
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from mcore_flash import faults, platform
from mcore_flash.checkpoint import checkpointer, directory
from mcore_flash.checkpoint.model_args import model_args
from mcore_flash.runtime.config import TrainingConfig
from mcore_flash.runtime.model import count_parameters, transformer_config
from mcore_flash.runtime.tokenizer import tokenizer_and_vocab
from mcore_flash.training import offload, setup, watchdog
from mcore_flash.training.batches import build_train_valid_datasets, micro_batches
from mcore_flash.training.metrics import MetricsLogger


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


def train(config: TrainingConfig) -> dict:
    """Run ``config.train_iters`` iterations (resuming from ``--load``); call after
    ``init_distributed(config)``. Returns ``{"iteration", "first_loss", "last_loss", "save",
    "optimizer_state", "model_state"}`` (:func:`.offload.state_placement`,
    :func:`.offload.model_state_placement`: where the optimizer state and the weights live)."""
    recipe = PretrainRecipe(config)
    try:
        return recipe.train()
    finally:
        recipe.cleanup()


class PretrainRecipe:
    """One training run: the constructor sets it up, :meth:`train` runs it, :meth:`cleanup`
    releases the signal handler and the metrics files.

    ``iteration`` and ``consumed_samples`` (sequences, all data-parallel ranks) count what
    has been trained, from the resumed checkpoint on; checkpoints store both.
    ``model_chunks``: this rank's model in megatron's DDP (or FSDP) wrapper, one per virtual
    pipeline stage (one without the interleaved schedule), as megatron's schedules take it.
    """

    def __init__(self, config: TrainingConfig):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.config = config
        self.started = time.monotonic()  # --exit-duration-in-mins counts from here
        directory.refuse_overwrite(config.save, config.load)  # before anything is written
        self.tokenizer, self.padded_vocab_size = tokenizer_and_vocab(config)
        self.split_batch = setup.batch_splitter(config, self.tokenizer)
        self.model_config = transformer_config(config)
        self.model_args = model_args(config, self.tokenizer.vocab_size)
        self.model_chunks = setup.data_parallel_model_chunks(
            config, self.model_config, self.padded_vocab_size, self.model_args
        )
        self.optimizer = setup.megatron_optimizer(config, self.model_config, self.model_chunks)
        self.scheduler = setup.lr_scheduler(config, self.optimizer)
        self.checkpointer = checkpointer.Checkpointer(
            self.model_chunks,
            self.optimizer,
            self.scheduler,
            self.padded_vocab_size,
            self.model_args,
            background=config.async_save,
        )
        setup.connect_model_config(config, self.model_config, self.model_chunks, self.optimizer)
        faults.install(self.model_chunks, self.model_config)
        self.logger = MetricsLogger(
            config, count_parameters(self.model_chunks), self.padded_vocab_size
        )
        self.iteration, self.consumed_samples, self.provenance = self._resume()
        self.logger.begin(self.iteration)
        self.data, self.valid_data = self._micro_batches()
        self.forward_backward = get_forward_backward_func()
        self.stop = _StopSignal()
        self.watchdog = watchdog.start(config, self.model_chunks, self.model_config, self.optimizer)

    def _resume(self) -> tuple[int, int, dict]:
        """``(iteration, consumed samples, provenance)`` of the checkpoint in ``--load``, or a
        fresh start; notes what was loaded and which unfinished saves are ignored."""
        config, iteration, consumed, provenance = self.config, 0, 0, {}
        if config.load and directory.latest_iteration(config.load) is not None:
            iteration, consumed, provenance = self.checkpointer.load(
                config.load,
                finetune=config.finetune,
                load_optim=not config.no_load_optim,
                load_rng=not config.no_load_rng,
            )
            _check_built_in_data(config, provenance)
            how = "fine-tuning from" if config.finetune else "resumed from"
            self.logger.note(
                f"{how} {config.load} at iteration {iteration} ({consumed} samples consumed)"
            )
        elif config.load:
            self.logger.note(f"no checkpoint in --load {config.load} yet: starting from scratch")
        for stale in directory.unfinished_saves(config.load):
            self.logger.note(
                f"ignoring {stale}: a save that did not finish (the next save removes it)"
            )
        provenance.pop("synthetic_key_depth", None)  # this run's data, not the loaded one's
        if config.synthetic_key_depth is not None:
            provenance["synthetic_key_depth"] = config.synthetic_key_depth
        return iteration, consumed, provenance

    def _micro_batches(self):
        """This data-parallel rank's endless micro-batch iterators, one per model chunk (each
        chunk reads every micro-batch: its packing and positions): training from the consumed
        samples on; validation (None without ``--eval-interval``) from the samples the
        validations before ``self.iteration`` took (Megatron-LM's ``consumed_valid_samples``),
        so a resumed run validates on the samples an uninterrupted one would."""
        from megatron.core import parallel_state

        config = self.config
        train, valid = build_train_valid_datasets(config, self.tokenizer)
        batches = functools.partial(
            micro_batches,
            micro_batch_size=config.micro_batch_size,
            global_batch_size=config.global_batch_size,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(),
        )
        chunks = range(len(self.model_chunks))
        train_batches = [batches(train, consumed_samples=self.consumed_samples) for _ in chunks]
        if valid is None:
            return train_batches, None
        validated = self.iteration // config.eval_interval * config.eval_iters
        consumed = validated * config.global_batch_size
        return train_batches, [batches(valid, consumed_samples=consumed) for _ in chunks]

    def evaluate(self) -> Optional[float]:
        """Mean token loss (nats) over ``--eval-iters`` global batches of the validation set,
        forward only, dropout off, all data-parallel ranks; None off the last pipeline stage."""
        config = self.config
        self.watchdog.begin_evaluation(self.iteration)
        for chunk in self.model_chunks:
            chunk.eval()
        losses = []
        with torch.no_grad():
            for _ in range(config.eval_iters):
                losses += self.forward_backward(
                    forward_step_func=functools.partial(_forward_step, self.split_batch),
                    data_iterator=self.valid_data,
                    model=self.model_chunks,
                    num_microbatches=config.num_micro_batches,
                    seq_length=config.seq_length,
                    micro_batch_size=config.micro_batch_size,
                    decoder_seq_length=config.seq_length,
                    forward_only=True,
                )
        for chunk in self.model_chunks:
            chunk.train()
        return _reduce_loss(losses)

    def train_step(self) -> tuple[Optional[float], Optional[float], float]:
        """Train iteration ``self.iteration + 1``; returns ``(mean token loss in nats, grad norm,
        the learning rate its update used)``, the loss None off the last pipeline stage."""
        config = self.config
        faults.begin_iteration(self.iteration + 1)
        self.watchdog.begin_iteration(self.iteration + 1)
        self._publish_background_save(blocking=False)
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.forward_backward(
            forward_step_func=functools.partial(_forward_step, self.split_batch),
            data_iterator=self.data,
            model=self.model_chunks,
            num_microbatches=config.num_micro_batches,
            seq_length=config.seq_length,
            micro_batch_size=config.micro_batch_size,
            decoder_seq_length=config.seq_length,
            forward_only=False,
        )
        lr = self.optimizer.param_groups[0]["lr"]  # the scheduler's step below sets the next one
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=config.global_batch_size)
        self.iteration += 1
        faults.point("optimizer-step", self.iteration)
        self.consumed_samples += config.global_batch_size
        return _reduce_loss(losses), grad_norm, lr

    def train(self) -> dict:
        """Iterate up to ``--train-iters``: log every ``--log-interval``, save every
        ``--save-interval`` and at the end; save and stop early on SIGTERM or at
        ``--exit-interval``; raise :class:`TrainingDiverged` on a non-finite loss."""
        config = self.config
        first_loss = last_loss = None
        while self.iteration < config.train_iters:
            start = time.perf_counter()
            loss, grad_norm, lr = self.train_step()
            diverged, stop_reason = self._agree_after_step(loss)
            if diverged:
                value = "not finite on the last pipeline stage" if loss is None else loss
                raise TrainingDiverged(
                    f"loss is {value} at iteration {self.iteration}: training diverged. Lower --lr (now {config.lr}) "
                    f"or --clip-grad, or resume from the last checkpoint in {config.save}"
                )
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss if loss is not None else last_loss
            last = self.iteration == config.train_iters
            if self.iteration % config.log_interval == 0 or last:
                self.logger.log(self.iteration, loss, lr, grad_norm, time.perf_counter() - start)
            if config.eval_interval and (self.iteration % config.eval_interval == 0 or last):
                self.logger.log_validation(self.iteration, self.evaluate())
            if self.iteration % config.save_interval == 0 or last or stop_reason:
                self.save()
            if stop_reason:
                resume = f"resume with --load {config.save}"
                self.logger.note(
                    f"stopped by {stop_reason} after iteration {self.iteration}; {resume}"
                )
                break
        self.watchdog.begin_save(self.iteration)
        self._publish_background_save(blocking=True)
        self.logger.done(self.iteration, first_loss, last_loss)
        return {
            "iteration": self.iteration,
            "first_loss": first_loss,
            "last_loss": last_loss,
            "save": config.save,
            "optimizer_state": offload.state_placement(self.optimizer),
            "model_state": offload.model_state_placement(self.model_chunks),
        }

    def _agree_after_step(self, loss: Optional[float]) -> tuple[bool, Optional[str]]:
        """``(diverged, stop_reason)`` after an iteration, the same on every rank (one MAX
        all-reduce): diverged if ``loss`` (known on the last pipeline stage only) is not
        finite; why to stop: "a signal" (SIGTERM on any rank), "--exit-duration-in-mins" (on any
        rank: as Megatron-LM, the ranks' clocks are combined), "--exit-interval", or None."""
        limit = self.config.exit_duration_in_mins
        out_of_time = limit is not None and (time.monotonic() - self.started) / 60 > limit
        not_finite = loss is not None and not math.isfinite(loss)
        diverged, signalled, out_of_time = self.stop.agreed(not_finite, out_of_time)
        if diverged:
            return True, None
        if signalled:
            return False, "a signal"
        if out_of_time:
            return False, f"--exit-duration-in-mins {limit:g}"
        if self.config.exit_interval and self.iteration % self.config.exit_interval == 0:
            return False, "--exit-interval"
        return False, None

    def save(self) -> None:
        """Checkpoint the current iteration under ``--save`` (collective). With
        ``--overlap-param-gather`` the model's parameters are gathered in the next forward, so
        they are gathered first (megatron's hooks off, then on again, as Megatron-LM saves).
        With ``--async-save`` the previous save is published first (one in flight at a time:
        training waits for its write if it is still running) and this one's shards are
        written in the background. The note says how long training was stopped for it, the
        wait for the previous write included."""
        self.watchdog.begin_save(self.iteration)
        start = time.perf_counter()
        self._publish_background_save(blocking=True)
        waited = time.perf_counter() - start
        if self.config.overlap_param_gather:
            for chunk in self.model_chunks:
                chunk.disable_forward_pre_hook()  # and the all-gather, synchronously
        path = self.checkpointer.save(
            self.config.save,
            self.iteration,
            self.consumed_samples,
            self.provenance,
            progress=self.watchdog.phase,
        )
        if self.config.overlap_param_gather:
            for chunk in self.model_chunks:
                chunk.enable_forward_pre_hook()
        stalled = time.perf_counter() - start
        if self.checkpointer.background is None:
            self.logger.note(f"saved checkpoint {path} (training stopped {stalled:.2f} s)")
        else:
            self.logger.note(
                f"writing checkpoint {path} in the background (training stopped {stalled:.2f} s, "
                f"{waited:.2f} s of it for the previous save's write)"
            )

    def _publish_background_save(self, blocking: bool) -> None:
        """``--async-save``: publish the save in flight once every rank's writer is done
        (``blocking``: wait for them); collective, a no-op without the flag."""
        path = self.checkpointer.finalize(blocking)
        if path is not None:
            self.logger.note(f"saved checkpoint {path} (written in the background)")

    def cleanup(self) -> None:
        """Give SIGTERM back its previous handler, stop the watchdog; close ``metrics.jsonl`` and
        TensorBoard."""
        self.stop.restore()
        self.watchdog.stop()
        self.logger.close()


def _check_built_in_data(config: TrainingConfig, provenance: dict) -> None:
    """A run resumed on the built-in task continues the documents it trained on: a checkpoint
    whose run placed the key otherwise (``--synthetic-key-depth``, recorded in its provenance) is
    refused, naming the flag (a fine-tune starts its data afresh: any placement)."""
    saved = provenance.get("synthetic_key_depth")
    now = config.synthetic_key_depth
    if config.finetune or saved is None or now is None or saved == now:
        return
    raise ValueError(
        f"--load {config.load}: its run trained on the built-in task with --synthetic-key-depth {saved}, "
        f"this one would continue with {now}: pass --synthetic-key-depth {saved} (or --finetune to "
        "start its data afresh)"
    )


def _forward_step(split_batch, data_iterator, model):
    device = platform.torch_device()
    batch = {key: value.to(device) for key, value in next(data_iterator).items()}
    batch, packed_seq_params = split_batch(batch)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        packed_seq_params=packed_seq_params,
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

    def agreed(self, diverged: bool, out_of_time: bool) -> tuple[bool, bool, bool]:
        """``(diverged on any rank, SIGTERM on any rank, out_of_time on any rank)``: one MAX
        all-reduce (collective)."""
        # on the device: NCCL and HCCL groups serve device tensors only
        flags = torch.tensor(
            [int(diverged), int(self._flag), int(out_of_time)], device=platform.torch_device()
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1]), bool(flags[2])

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
