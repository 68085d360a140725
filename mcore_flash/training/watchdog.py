"""Hang detection: a rank that makes no progress for the timeout dumps its stacks and exits.

Provides :class:`Watchdog` (one daemon thread per rank), :func:`start` (this rank's, for a
training run) and ``EXIT_CODE`` (3). The loop arms it at the start of every iteration,
validation and save (:meth:`Watchdog.begin_iteration`, :meth:`~Watchdog.begin_evaluation`,
:meth:`~Watchdog.begin_save`); each mark of progress (:meth:`Watchdog.phase`, also from the
hooks of :meth:`Watchdog.install`) moves the deadline, so the limit bounds the longest single
phase, never an iteration's length. The limit is ``--distributed-timeout-minutes``
(Megatron-LM's flag; ``timeout_s`` in seconds), the one that bounds every collective
(:func:`mcore_flash.runtime.distributed.init_distributed`): a collective starts after the
phase that contains it, so this watchdog fires first, and it fires on the stuck rank too,
which has no collective in flight to time out. Firing (:meth:`Watchdog._fire`) writes every
thread's Python stack and one line naming the rank, its work and phase and where to resume,
then ends the process with ``os._exit(EXIT_CODE)``, so ``torchrun`` ends the job non-zero. It
needs the stuck call to release the GIL, as collectives, device synchronizations and sleeps
do. The manual: docs/fault-tolerance.md, section "A hung rank".
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Optional

EXIT_CODE = 3  # the process's exit code when the watchdog fires (torchrun reports it)


class Watchdog:
    """Ends this process when the work armed last makes no progress for ``timeout_s`` seconds.

    ``rank``: how the message names this rank, e.g. ``"rank 1 (TP 0, PP 0, CP 0, DP 1)"``;
    ``save``: the ``--save`` directory, named in the message as where to resume from.
    """

    def __init__(self, timeout_s: float, rank: str, save: str):
        self.timeout_s = timeout_s
        self._rank = rank
        self._save = save
        self._work: Optional[str] = None  # "iteration 3", "the save of iteration 2"
        self._phase: Optional[str] = None
        self._deadline: Optional[float] = None  # time.monotonic() seconds; None: disarmed
        self._stopped = False
        self._wake = threading.Condition()
        self._hooks: list = []
        self._thread = threading.Thread(
            target=self._watch, name="mcore-flash-watchdog", daemon=True
        )
        self._thread.start()

    def begin_iteration(self, iteration: int) -> None:
        """Iteration ``iteration`` (1-based) starts now, with its first forward pass."""
        self._arm(f"iteration {iteration}", "forward")

    def begin_evaluation(self, iteration: int) -> None:
        """The validation after iteration ``iteration`` runs from now on."""
        self._arm(f"the validation after iteration {iteration}", "validation forward")

    def begin_save(self, iteration: int) -> None:
        """The checkpoint of iteration ``iteration`` is being saved from now on."""
        self._arm(f"the save of iteration {iteration}", "save")

    def phase(self, name: str) -> None:
        """The armed work made progress and enters phase ``name``: the deadline moves to
        ``timeout_s`` from now (a disarmed watchdog stays disarmed)."""
        with self._wake:
            self._phase = name
            if self._deadline is not None:
                self._deadline = time.monotonic() + self.timeout_s

    def install(self, model_chunks: list, model_config, optimizer) -> None:
        """Mark progress from hooks: a forward pre-hook on the decoder of the GPTModel inside
        each of ``model_chunks`` (megatron's DDP or FSDP wrappers; not on the GPTModel itself,
        whose hooks Megatron-FSDP bypasses by calling its ``forward``) marks each
        micro-batch's "forward", a hook on the decoder output's gradient its "backward"; ``model_config.finalize_model_grads_func`` (the gradient
        reduce-scatter/all-reduce that megatron's schedule calls) and ``optimizer.step`` are
        wrapped to mark "gradient reduction", "optimizer" and what follows the update."""
        self._hooks = []
        for model in model_chunks:
            while hasattr(model, "module"):
                model = model.module
            decoder = model.decoder
            self._hooks += [
                decoder.register_forward_pre_hook(lambda module, args: self.phase("forward")),
                decoder.register_forward_hook(self._mark_backward),
            ]
        finalize = model_config.finalize_model_grads_func

        def finalize_marked(*args, **kwargs):
            self.phase("gradient reduction")
            return finalize(*args, **kwargs)

        model_config.finalize_model_grads_func = finalize_marked
        step = optimizer.step

        def step_marked(*args, **kwargs):
            self.phase("optimizer")
            result = step(*args, **kwargs)
            self.phase("after the update (loss and stop-signal all-reduces, logging)")
            return result

        optimizer.step = step_marked

    def stop(self) -> None:
        """Disarm for good, remove the model hooks and end the thread."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        for handle in self._hooks:
            handle.remove()
        self._thread.join(timeout=5)

    def _arm(self, work: str, phase: str) -> None:
        with self._wake:
            self._work, self._phase = work, phase
            self._deadline = time.monotonic() + self.timeout_s
            self._wake.notify()

    def _mark_backward(self, module, args, output) -> None:
        import torch

        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self.phase("backward"))

    def _watch(self) -> None:
        with self._wake:
            while not self._stopped:
                if self._deadline is None:
                    self._wake.wait()
                elif self._deadline > time.monotonic():
                    self._wake.wait(self._deadline - time.monotonic())
                else:
                    self._fire()

    def _fire(self) -> None:
        """When the armed work made no progress for ``timeout_s``:

        1. writes every thread's Python stack to stderr (``faulthandler.dump_traceback``),
        2. writes one line naming the rank (global rank and its TP/PP/CP/DP coordinates), the
           work (iteration, validation or save), the phase, and that the last complete
           checkpoint in ``--save`` is where to resume,
        3. ends the process with ``os._exit(EXIT_CODE)`` (no ``finally`` or ``atexit`` runs:
           the main thread is stuck), so ``torchrun`` ends the job non-zero and the scheduler
           can restart it with ``--load``.

        Stacks and line are written to file descriptor 2 itself, as ``sys.stderr`` may be
        redirected to a buffer that ``os._exit`` would drop."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass  # closed or replaced: nothing of ours to flush
        faulthandler.dump_traceback(file=2, all_threads=True)
        line = (
            f"mcore-flash pretrain: watchdog: {self._rank} is stuck: {self._work} made no progress "
            f"for {self.timeout_s:g} s (--distributed-timeout-minutes), in phase {self._phase}; "
            f"the stacks of its threads are above. Exiting with code {EXIT_CODE}: restart the job "
            f"with --load {self._save} to resume from the last complete checkpoint in --save "
            f"{self._save} (raise --distributed-timeout-minutes if one phase is only slow)\n"
        )
        os.write(2, line.encode())
        os._exit(EXIT_CODE)


def start(config, model_chunks: list, model_config, optimizer) -> Watchdog:
    """This rank's watchdog for a training run (after ``init_distributed``): the limit of
    ``config.distributed_timeout_minutes``, the phase hooks installed (:meth:`Watchdog.install`);
    disarmed until the first :meth:`~Watchdog.begin_iteration`."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank = (
        f"rank {dist.get_rank()} (TP {parallel_state.get_tensor_model_parallel_rank()}, "
        f"PP {parallel_state.get_pipeline_model_parallel_rank()}, "
        f"CP {parallel_state.get_context_parallel_rank()}, "
        f"DP {parallel_state.get_data_parallel_rank()})"
    )
    watchdog = Watchdog(config.distributed_timeout_minutes * 60, rank, config.save)
    watchdog.install(model_chunks, model_config, optimizer)
    return watchdog
