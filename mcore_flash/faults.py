"""Fault injection for tests: SIGKILL one rank, or hang it, at a named point of training or saving.

Off unless the environment variable ``MCORE_FLASH_FAULT`` is set (read once, at import)::

    MCORE_FLASH_FAULT=POINT@ITERATION[:RANK]      e.g. backward@3, save-renamed@4, grad-reduce@3:1

The named rank (default 0) prints one line to stderr and kills itself with SIGKILL at
``POINT`` of iteration ``ITERATION`` (for the save points: the save of that iteration). No
``finally`` block, atexit handler or signal handler runs, as when a node dies; ``torchrun``
then ends the other ranks. A disk that fills up is not simulated here: the tests put
``--save`` on a small tmpfs, a real full disk (the drill, ``scripts/fault_drill.py``).

``hang@ITERATION[:RANK]`` (:data:`HANG`) makes that rank sleep forever inside the forward
pass of that iteration instead, as a stuck device or collective would: the other ranks wait
for it in their next collective, and the watchdog (:mod:`.watchdog`) ends them all.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import NamedTuple, Optional

ENV = "MCORE_FLASH_FAULT"

POINTS = {
    "forward": "inside the forward pass (entering the last decoder layer, first micro-batch)",
    "backward": "inside the backward pass (the gradient reaching the last decoder layer's output)",
    "grad-reduce": "entering the gradient reduce-scatter/all-reduce, the other ranks inside it",
    "optimizer-step": "after the optimizer step, before the iteration's checkpoint",
    "save-begin": "in the save: the .tmp directory made, nothing written",
    "save-shards": "in the save: after the model/optimizer shards (dist_checkpointing's or, with FSDP, DCP's files)",
    "save-rng": "in the save: after this rank's RNG file",
    "save-manifest": "in the save: after the manifest, before the rename",
    "save-renamed": "in the save: after the rename, before the tracker update",
    "save-tracker": "in the save: after the tracker update",
}  # the SIGKILL points: the rows of the fault drill (scripts/fault_drill.py)
BACKGROUND_POINTS = {
    "save-scheduled": "--async-save: the shards handed to the background writer, which is writing them",
    "save-writing": "--async-save: the background writer itself, before it writes (the rank trains on)",
}  # the points only a background save (``--async-save``) passes: rows of the drill's async table
KILL_POINTS = {**POINTS, **BACKGROUND_POINTS}
HANG = "hang"  # not a kill: the rank sleeps forever where ``forward`` would kill it
MODEL_POINTS = ("forward", "backward", HANG)


class Fault(NamedTuple):
    point: str
    iteration: int
    rank: int


def parse(spec: str) -> Fault:
    """``"POINT@ITERATION[:RANK]"`` -> :class:`Fault` (ValueError naming the variable)."""
    point, _, rest = spec.partition("@")
    iteration, _, rank = rest.partition(":")
    if point not in (*KILL_POINTS, HANG) or not iteration.isdigit() or not (rank or "0").isdigit():
        raise ValueError(
            f"{ENV}={spec!r}: expected POINT@ITERATION[:RANK], POINT one of {', '.join(KILL_POINTS)} or {HANG}"
        )
    return Fault(point, int(iteration), int(rank or 0))


_FAULT: Optional[Fault] = parse(os.environ[ENV]) if os.environ.get(ENV) else None
_iteration = 0  # the iteration being trained (1-based), for the points inside the model


def begin_iteration(iteration: int) -> None:
    """Tell the model's points which iteration (1-based) is being trained."""
    global _iteration
    _iteration = iteration


def point(name: str, iteration: Optional[int] = None) -> None:
    """Die here (hang here, for :data:`HANG`) if ``MCORE_FLASH_FAULT`` names this point,
    iteration and this rank."""
    if _FAULT is None or _FAULT.point != name:
        return
    iteration = _iteration if iteration is None else iteration
    if iteration != _FAULT.iteration or _rank() != _FAULT.rank:
        return
    if name == HANG:
        print(
            f"fault injection: hang in the forward pass, iteration {iteration}, rank {_FAULT.rank}",
            file=sys.stderr,
            flush=True,
        )
        while True:  # a SIGTERM (torchrun ending the job) only sets the loop's stop flag
            time.sleep(60)
    print(
        f"fault injection: SIGKILL at {name}, iteration {iteration}, rank {_FAULT.rank}",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)


def install(model_chunks: list, config) -> None:
    """Arm the points inside the model and the gradient reduction (a no-op when disarmed).

    ``model_chunks``: megatron's DDP- or FSDP-wrapped GPTModel chunks of this rank (the points
    sit in the last chunk's last layer); ``config``: their TransformerConfig, whose
    ``finalize_model_grads_func`` (the gradient reduce-scatter/all-reduce) gets wrapped.
    """
    if _FAULT is None:
        return
    if _FAULT.point in MODEL_POINTS:
        model = model_chunks[-1]
        while hasattr(model, "module"):  # DDP, or FSDP's adapter around MegatronFSDP
            model = model.module
        layers = model.decoder.layers
        entering = HANG if _FAULT.point == HANG else "forward"
        layers[-1].register_forward_pre_hook(lambda module, args: point(entering))
        layers[-1].register_forward_hook(_die_in_backward)
    if _FAULT.point == "grad-reduce":
        finalize = config.finalize_model_grads_func

        def finalize_and_die(*args, **kwargs):
            point("grad-reduce")
            return finalize(*args, **kwargs)

        config.finalize_model_grads_func = finalize_and_die


def _die_in_backward(module, args, output) -> None:
    import torch

    hidden = output[0] if isinstance(output, tuple) else output
    if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
        hidden.register_hook(lambda grad: point("backward"))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
