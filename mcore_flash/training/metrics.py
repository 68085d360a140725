"""Progress lines, ``metrics.jsonl`` and (optionally) TensorBoard for the trainer.

The last rank logs (it sits on the last pipeline stage, where the loss is known).
``metrics.jsonl`` in ``--save`` gets one JSON object per logged iteration:
``iteration, loss, lr, grad_norm, iteration_time_s, tokens_per_s, peak_memory_bytes``.
With ``--tensorboard-dir`` (the ``tensorboard`` extra) the same values become scalars under
Megatron-LM's tag names (:data:`TENSORBOARD_TAGS`), step = iteration.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

from mcore_flash import platform

#: ``metrics.jsonl`` key -> TensorBoard tag (Megatron-LM's ``training_log`` names)
TENSORBOARD_TAGS = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "iteration_time_s": "iteration-time",
    "tokens_per_s": "tokens-per-second",
    "peak_memory_bytes": "mem-max-allocated-bytes",
}


class MetricsLogger:
    def __init__(self, args, num_parameters: int):
        self.args = args
        self.active = dist.get_rank() == dist.get_world_size() - 1
        self.tokens_per_iteration = args.global_batch_size * args.seq_length
        self.writer = None
        self.started = time.perf_counter()
        if not self.active:
            return
        os.makedirs(args.save, exist_ok=True)
        self.path = os.path.join(args.save, "metrics.jsonl")
        self.file = open(self.path, "a")
        if args.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ValueError(
                    "--tensorboard-dir needs the tensorboard package: pip install 'mcore-flash[tensorboard]'"
                ) from error
            self.writer = SummaryWriter(args.tensorboard_dir)
        self.note(
            f"training {args.model}: {num_parameters:,} parameters on this rank, world size {args.world_size} "
            f"(TP {args.tensor_model_parallel_size}, PP {args.pipeline_model_parallel_size}, "
            f"CP {args.context_parallel_size}, DP {args.data_parallel_size}), {args.train_iters} iterations of "
            f"{args.global_batch_size} x {args.seq_length} tokens on {platform.device_type()}"
        )

    def log(self, iteration: int, loss, lr: float, grad_norm, seconds: float) -> None:
        if not self.active:
            return
        record = {
            "iteration": iteration,
            "loss": loss,
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "iteration_time_s": round(seconds, 4),
            "tokens_per_s": round(self.tokens_per_iteration / seconds, 1),
            "peak_memory_bytes": platform.peak_memory_bytes(),
        }
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, tag in TENSORBOARD_TAGS.items():
                if record[key] is not None:
                    self.writer.add_scalar(tag, record[key], iteration)
            self.writer.flush()
        width = len(str(self.args.train_iters))
        print(
            f"iteration {iteration:>{width}}/{self.args.train_iters} | loss {loss:.4f} | lr {lr:.2e} | "
            f"grad norm {record['grad_norm'] or 0:.3f} | {record['tokens_per_s']:,.0f} tokens/s | "
            f"{seconds * 1000:.0f} ms/it | peak mem {record['peak_memory_bytes'] / 2**20:,.0f} MiB | "
            f"elapsed {time.perf_counter() - self.started:.0f} s",
            flush=True,
        )

    def note(self, text: str) -> None:
        if self.active:
            print(f"[mcore-flash] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.active:
            self.file.close()
            if self.writer is not None:
                self.writer.close()
