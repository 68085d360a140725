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
import os
import sys
import time

import torch.distributed as dist

from mcore_flash import platform
from mcore_flash.planning.flops import step_flops
from mcore_flash.planning.recipes import model_shape_for_pretrain_args

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
}


def model_flops_per_iteration(args, padded_vocab_size: int) -> float:
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
    shape = model_shape_for_pretrain_args(args, vocab_size=padded_vocab_size)
    return args.global_batch_size * step_flops(shape, args.seq_length, fused_attention=True)


class MetricsLogger:
    def __init__(self, args, num_parameters: int, padded_vocab_size: int):
        self.args = args
        self.active = dist.get_rank() == dist.get_world_size() - 1
        self.tokens_per_iteration = args.global_batch_size * args.seq_length
        self.flops_per_iteration = model_flops_per_iteration(args, padded_vocab_size)
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
        """Print, write and (with TensorBoard) add the record of ``iteration``, which took ``seconds``."""
        if not self.active:
            return
        devices = self.args.world_size
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
        if self.args.hardware is not None:
            record["mfu"] = tflops / self.args.hardware.peak_bf16_tflops
            mfu_text = f" | MFU {record['mfu']:.1%}"
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, tag in TENSORBOARD_TAGS.items():
                if record.get(key) is not None:
                    self.writer.add_scalar(tag, record[key], iteration)
            self.writer.flush()
        width = len(str(self.args.train_iters))
        print(
            f"iteration {iteration:>{width}}/{self.args.train_iters} | loss {loss:.4f} | lr {lr:.2e} | "
            f"grad norm {record['grad_norm'] or 0:.3f} | {record['tokens_per_s']:,.0f} tokens/s "
            f"({record['tokens_per_s_per_device']:,.0f}/device) | {tflops:.3g} TFLOP/s/device{mfu_text} | "
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
