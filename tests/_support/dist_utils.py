"""Run a function in N gloo processes (CPU) and collect what each rank returns.

    from _support.dist_utils import run_distributed, init_megatron, teardown_megatron

    def _worker(rank, world_size, x):          # top level: pickled by name
        init_megatron(tp=world_size)
        try:
            return do_something(x)               # must be picklable (tensors are fine)
        finally:
            teardown_megatron()

    def test_it():
        results = run_distributed(_worker, 2, 3.0)   # [rank0 result, rank1 result]

A worker's exception fails the test with that worker's traceback. Everything is bounded
by ``timeout`` seconds (process-group init and collectives included).

The processes fork from multiprocessing's fork server, which imports torch and megatron-core
once per test session (:data:`PRELOAD`): a spawned process spent about 5 s importing them,
most of a small distributed test's time. Everything of ours (``mcore_flash``, the test
module) is still imported in each process, and each gets the caller's environment and its
standard output and error as a spawned process did (so ``capfd`` sees what ranks print).
"""

from __future__ import annotations

import datetime
import io
import os
import queue as queue_mod
import sys
import time
import traceback
from multiprocessing import reduction

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mcore_flash.ports import free_port

__all__ = [
    "run_distributed",
    "retried_after_a_lost_rank",
    "free_port",
    "init_megatron",
    "teardown_megatron",
]


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


# third-party modules only: their import has no state of ours, and a spawned rank imported them
# all the same. Not megatron's GPT model: tests/platform/test_platform.py imports it first after
# the platform's setup (which must reach modules imported later too)
PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.dist_checkpointing",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
]


class _CallersFd:
    """A file descriptor of the caller that the forked process gets a duplicate of (its
    fd 1 and 2 are the fork server's, not the caller's, which pytest's capture redirects)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return (_CallersFd._detach, (reduction.DupFd(self.fd),))

    @staticmethod
    def _detach(duplicate) -> int:
        return duplicate.detach()


def _worker(
    rank, world_size, port, timeout, fn, args, results, emulate_npu, bind_device, threads, caller
):
    environment, stdout, stderr = caller
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=str(threads),
    )
    torch.set_num_threads(threads)
    try:
        if emulate_npu:  # the emulated torch_npu: an npu device and the HCCL-strict backend
            from mcore_flash import emulation

            emulation.install()
            import torch_npu  # noqa: F401

            if bind_device:
                torch.npu.set_device(rank)
        dist.init_process_group(
            "hccl" if emulate_npu else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        out = fn(rank, world_size, *args)
        results.put((rank, True, _dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        parallel_state = sys.modules.get("megatron.core.parallel_state")  # never import it here
        if parallel_state is not None:
            try:
                parallel_state.destroy_model_parallel()
            except Exception:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn,
    world_size: int,
    *args,
    timeout: float = 180,
    emulate_npu: bool = False,
    bind_device: bool = True,
    threads: int = 1,
):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes forked from the fork server.

    ``emulate_npu``: the processes import the emulated ``torch_npu`` first, bind rank r to
    ``npu:r`` (unless ``bind_device=False``) and use the HCCL-strict ``hccl`` backend.
    ``threads``: torch's intra-op threads per process (default 1: the ranks share the cores).
    Returns the per-rank return values (rank order). Raises RuntimeError carrying the
    failing worker's traceback, or TimeoutError after ``timeout`` seconds.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    sys.stdout.flush()
    sys.stderr.flush()
    caller = (dict(os.environ), _CallersFd(1), _CallersFd(2))
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                rank,
                world_size,
                port,
                timeout,
                fn,
                args,
                results,
                emulate_npu,
                bind_device,
                threads,
                caller,
            ),
            daemon=False,  # workers may start processes (dist-ckpt save does)
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"run_distributed({fn.__name__}): ranks {sorted(set(range(world_size)) - set(out))} "
                    f"did not finish within {timeout} s"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [
                    (r, p.exitcode)
                    for r, p in enumerate(procs)
                    if r not in out and p.exitcode is not None
                ]
                if dead:
                    # give a late queue message a chance before declaring the rank dead
                    try:
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue_mod.Empty:
                        raise RuntimeError(
                            f"run_distributed({fn.__name__}): rank(s) exited without a result "
                            f"(rank, exitcode): {dead}"
                        ) from None
                else:
                    continue
            if not ok:
                last_line = payload.strip().splitlines()[-1]
                raise RuntimeError(
                    f"run_distributed({fn.__name__}): rank {rank} failed: {last_line}\n"
                    f"the other ranks: {_fate_of_the_others(procs, results, rank)}\n{payload}"
                )
            out[rank] = _loads(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [out[r] for r in range(world_size)]


def _fate_of_the_others(procs, results, failed: int, wait_s: float = 10.0) -> str:
    """What became of every rank but ``failed`` within ``wait_s`` seconds: its exit code (a
    negative one is the signal that ended it), the last line of its error, or "running", so a
    failure caused by a lost peer names how the peer was lost."""
    fates = {}
    deadline = time.monotonic() + wait_s
    while len(fates) < len(procs) - 1 and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.5)
            fates[rank] = "returned" if ok else payload.strip().splitlines()[-1]
        except queue_mod.Empty:
            for r, p in enumerate(procs):
                if r != failed and r not in fates and p.exitcode is not None:
                    fates[r] = f"exit code {p.exitcode}"
    return "; ".join(
        f"rank {r}: {fates.get(r, 'running')}" for r in range(len(procs)) if r != failed
    )


# A Megatron-FSDP launch on the CPU has lost a rank mid-collective on a loaded 2-core machine
# (its gloo peers then report the connection reset or closed by that peer: stop 36 on py312,
# stop 41 at four ranks, stop 42 in test_fsdp_checkpoint.py), never when rerun alone. The tests
# of those launches retry such a launch once, for that signature only; the retried launch
# must still pass every assertion.
LOST_RANK = ("Connection reset by peer", "Connection closed by peer", "exited without a result")


def retried_after_a_lost_rank(launch, root: str):
    """``(launch(root), root)``, or after a lost rank (:data:`LOST_RANK`) ``(launch(retry),
    retry)`` with ``retry = root/retry``: fresh directories for what the launch writes."""
    try:
        return launch(root), root
    except RuntimeError as error:
        if not any(sign in str(error) for sign in LOST_RANK):
            raise
        print(f"a rank was lost, retrying the launch once:\n{str(error)[-1500:]}")
        retry = os.path.join(root, "retry")
        return launch(retry), retry


def init_megatron(tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234, **kwargs):
    """Inside a worker: CPU platform, megatron's parallel state and Megatron-LM's seeding
    (python, numpy, torch and megatron's device generator and TP tracker)."""
    from mcore_flash import platform

    platform.setup("cpu")
    from megatron.core import parallel_state

    from mcore_flash.training.distributed import set_random_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        **kwargs,
    )
    set_random_seed(seed)


def teardown_megatron():
    """Undo ``init_megatron`` (the process group itself is destroyed by the runner)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
