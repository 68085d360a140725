"""Progress lines, ``metrics.jsonl`` and (optionally) TensorBoard for the trainer.

The last rank logs (it sits on the last pipeline stage, where the loss is known).
``metrics.jsonl`` in ``--save`` gets one JSON object per logged iteration:
``iteration, loss, lr, grad_norm, iteration_time_s, tokens_per_s, tokens_per_s_per_device,
tflops_per_device, peak_memory_bytes`` and, with ``--hardware``, ``mfu``.
With ``--tensorboard-dir`` (the ``tensorboard`` extra) the same values become scalars under
Megatron-LM's tag names (:data:`TENSORBOARD_TAGS`), step = iteration.

Throughput, as Megatron-LM's ``--log-throughput`` reports it: per device = divided by the
world size (every rank, whatever the TP/PP/CP/DP layout). ``tflops_per_device`` is model
FLOPs (:func:`model_flops_per_iteration`) / iteration seconds / world size / 1e12, and
``mfu`` that over the ``--hardware`` profile's dense BF16 peak (TFLOP/s; the profiles carry
no other peak, so fp16 and fp32 runs are measured against it too).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch.distributed as dist

from mcore_flash import platform
from mcore_flash.planning.flops import step_flops
from mcore_flash.planning.recipes import model_shape_for_pretrain_args
from mcore_flash.runtime.config import TrainingConfig

#: ``metrics.jsonl`` key -> TensorBoard tag (Megatron-LM's ``training_log`` names where it has
#: one: "throughput" is its TFLOP/s per GPU; the per-device tokens/s and MFU are ours)
TENSORBOARD_TAGS = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "iteration_time_s": "iteration-time",
    "tokens_per_s": "tokens-per-second",
    "tokens_per_s_per_device": "tokens-per-second-per-device",
    "tflops_per_device": "throughput",
    "mfu": "mfu",
    "peak_memory_bytes": "mem-max-allocated-bytes",
    "validation_loss": "lm loss validation",
    "validation_ppl": "lm loss validation ppl",
}


def model_flops_per_iteration(config: TrainingConfig, padded_vocab_size: int) -> float:
    """Model FLOPs of one iteration (``--global-batch-size`` sequences of ``--seq-length``
    tokens), all devices together: the planner's :func:`~mcore_flash.planning.flops.step_flops`,
    the convention of ``mcore-flash plan --hardware``'s MFU, so measured and planned MFU compare.

    Per sequence of ``s`` tokens (``L`` layers, ``a`` heads of ``d`` channels): 6 FLOPs per
    token per matmul weight (forward + 2x backward, 2 FLOPs per multiply-add; QKV, output
    projection, MLP, and the logits over the ``padded_vocab_size`` rows; no embedding lookup,
    norms, biases or other elementwise work), plus the causal attention kernel, ``2·s²·a·d``
    per layer forward (half of the dense ``QK^T`` and ``PV``) and 2.5x that backward (the fused
    kernel re-forms ``QK^T``): ``7·L·a·d·s²``. Activation recompute (``--recompute-*``) is
    not counted: MFU counts model FLOPs, not the work a run chooses to redo. With
    ``--reset-attention-mask`` attention is still counted over whole sequences (an upper
    bound). Megatron-LM's ``num_floating_point_operations`` counts the matmuls alike and the
    attention dense, ``12·L·a·d·s²``, so its TFLOP/s reads higher at long context.
    """
    shape = model_shape_for_pretrain_args(config, vocab_size=padded_vocab_size)
    return config.global_batch_size * step_flops(shape, config.seq_length, fused_attention=True)


class MetricsLogger:
    """The last rank's progress lines, ``metrics.jsonl`` and TensorBoard scalars (a no-op on
    the other ranks); ``num_parameters``: this rank's, for the opening note."""

    def __init__(self, config: TrainingConfig, num_parameters: int, padded_vocab_size: int):
        self.config = config
        self.active = dist.get_rank() == dist.get_world_size() - 1
        self.tokens_per_iteration = config.global_batch_size * config.seq_length
        self.flops_per_iteration = model_flops_per_iteration(config, padded_vocab_size)
        self.writer = None
        self.file = None  # metrics.jsonl, opened by :meth:`begin`
        self.started = time.perf_counter()
        if not self.active:
            return
        os.makedirs(config.save, exist_ok=True)
        self.path = os.path.join(config.save, "metrics.jsonl")
        if config.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ValueError(
                    "--tensorboard-dir needs the tensorboard package: pip install 'mcore-flash[tensorboard]'"
                ) from error
            self.writer = SummaryWriter(config.tensorboard_dir)
        model = f"{config.num_layers} layers, hidden {config.hidden_size}"
        model = (
            f"the model of {config.load} ({model}, --use-checkpoint-args)"
            if config.use_checkpoint_args
            else f"{config.model} ({model})"
        )
        vp = config.virtual_pipeline_model_parallel_size
        virtual = f"VP {vp}, " if vp else ""
        self.note(
            f"training {model}: {num_parameters:,} parameters on this rank, world size {config.world_size} "
            f"(TP {config.tensor_model_parallel_size}, PP {config.pipeline_model_parallel_size}, {virtual}"
            f"CP {config.context_parallel_size}, DP {config.data_parallel_size}), {config.train_iters} iterations of "
            f"{config.global_batch_size} x {config.seq_length} tokens on {platform.device_type()}"
        )

    def begin(self, iteration: int) -> None:
        """Open ``metrics.jsonl`` to append the iterations after ``iteration`` (0, or the
        resumed one). The records of later iterations, which a run logged after its last
        checkpoint and the resume trains again, are dropped first (the file is replaced
        atomically), so each iteration has one record, in order; a record torn by a kill goes
        with them."""
        if not self.active:
            return
        if os.path.exists(self.path):
            with open(self.path) as f:
                lines = f.readlines()
            kept = [line for line in lines if _iteration_of(line) <= iteration]
            if len(kept) < len(lines):
                with open(self.path + ".tmp", "w") as f:
                    f.writelines(kept)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(self.path + ".tmp", self.path)
                self.note(
                    f"metrics.jsonl: dropped {len(lines) - len(kept)} records past iteration {iteration}, "
                    "where this run resumes"
                )
        self.file = open(self.path, "a")

    def log(self, iteration: int, loss, lr: float, grad_norm, seconds: float) -> None:
        """Print, write and (with TensorBoard) add the record of ``iteration``, which took
        ``seconds``; ``lr`` is the learning rate its update used."""
        if not self.active:
            return
        devices = self.config.world_size
        tflops = self.flops_per_iteration / seconds / devices / 1e12
        record = {
            "iteration": iteration,
            "loss": loss,
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "iteration_time_s": round(seconds, 4),
            "tokens_per_s": round(self.tokens_per_iteration / seconds, 1),
            "tokens_per_s_per_device": round(self.tokens_per_iteration / seconds / devices, 1),
            "tflops_per_device": tflops,
            "peak_memory_bytes": platform.peak_memory_bytes(),
        }
        mfu_text = ""
        if self.config.hardware is not None:
            record["mfu"] = tflops / self.config.hardware.peak_bf16_tflops
            mfu_text = f" | MFU {record['mfu']:.1%}"
        self._write(record)
        width = len(str(self.config.train_iters))
        print(
            f"iteration {iteration:>{width}}/{self.config.train_iters} | loss {loss:.4f} | lr {lr:.2e} | "
            f"grad norm {record['grad_norm'] or 0:.3f} | {record['tokens_per_s']:,.0f} tokens/s "
            f"({record['tokens_per_s_per_device']:,.0f}/device) | {tflops:.3g} TFLOP/s/device{mfu_text} | "
            f"{seconds * 1000:.0f} ms/it | peak mem {record['peak_memory_bytes'] / 2**20:,.0f} MiB | "
            f"elapsed {time.perf_counter() - self.started:.0f} s",
            flush=True,
        )

    def log_validation(self, iteration: int, loss: float) -> None:
        """Print, write and add the validation loss after ``iteration`` (mean token loss in
        nats) and its perplexity, ``exp(min(20, loss))`` as in Megatron-LM; its own record
        in ``metrics.jsonl``: ``{"iteration", "validation_loss", "validation_ppl"}``."""
        if not self.active:
            return
        record = {
            "iteration": iteration,
            "validation_loss": loss,
            "validation_ppl": math.exp(min(20.0, loss)),
        }
        self._write(record)
        print(
            f"validation loss at iteration {iteration} | lm loss value: {loss:.6e} | "
            f"lm loss PPL: {record['validation_ppl']:.6e}",
            flush=True,
        )

    def _write(self, record: dict) -> None:
        """One ``metrics.jsonl`` line, and its keys' TensorBoard scalars at its iteration."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, tag in TENSORBOARD_TAGS.items():
                if record.get(key) is not None:
                    self.writer.add_scalar(tag, record[key], record["iteration"])
            self.writer.flush()

    def done(self, iteration: int, first_loss, last_loss) -> None:
        """The job's one summary line on stdout (the last rank's): the losses of the
        iterations this launch trained, or that a resumed run had nothing left to train."""
        if not self.active:
            return
        if first_loss is None:
            print(
                f"already done: {self.config.load} is at iteration {iteration} of --train-iters "
                f"{self.config.train_iters}; nothing to train (raise --train-iters to train on)"
            )
        else:
            print(
                f"done: {iteration} iterations, loss {first_loss:.4f} -> {last_loss:.4f}; "
                f"checkpoints and metrics.jsonl in {self.config.save}"
            )

    def note(self, text: str) -> None:
        """``[mcore-flash] text`` on stderr."""
        if self.active:
            print(f"[mcore-flash] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Close ``metrics.jsonl`` and the TensorBoard writer."""
        if self.active:
            if self.file is not None:
                self.file.close()
            if self.writer is not None:
                self.writer.close()


def _iteration_of(line: str) -> float:
    """The iteration of one ``metrics.jsonl`` line; infinity for a torn or foreign line."""
    try:
        return json.loads(line)["iteration"]
    except (ValueError, KeyError, TypeError):
        return float("inf")
