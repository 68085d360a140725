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

A failure raises :class:`LaunchFailed` with the traceback of the rank whose failure is its
own (not a peer's lost connection), what became of every other rank (an exit code, the
signal that ended it, faulthandler's stacks of a fatal signal). Everything is bounded by
``timeout`` seconds (process-group init and collectives included).

The processes fork from multiprocessing's fork server, which imports torch and megatron-core
once per test session (:data:`PRELOAD`): a spawned process spent about 5 s importing them,
most of a small distributed test's time. Everything of ours (``mcore_flash``, the test
module) is still imported in each process, and each gets the caller's environment and its
standard output and error as a spawned process did (so ``capfd`` sees what ranks print).
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import io
import os
import queue as queue_mod
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing import reduction
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mcore_flash.ports import free_port

__all__ = [
    "run_distributed",
    "LaunchFailed",
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


class _Launch(NamedTuple):
    """What every rank of one launch gets (pickled into each forked process): the
    parameters of :func:`run_distributed`, its port and result queue, and ``caller``: the
    caller's environment and its standard output and error (:class:`_CallersFd`)."""

    world_size: int
    port: int
    timeout: float
    fn: Callable
    args: tuple
    results: Any
    emulate_npu: bool
    bind_device: bool
    threads: int
    caller: tuple


def _worker(rank: int, launch: _Launch, crash_log: str):
    world_size, port, timeout, fn, args, results, emulate_npu, bind_device, threads, caller = launch
    environment, stdout, stderr = caller
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    # a fatal signal (SIGSEGV, SIGBUS, SIGABRT, ...) writes every thread's Python stack here; the
    # launcher reads it back when this rank exits without a result. Closed by the process's exit
    faulthandler.enable(file=open(crash_log, "w"), all_threads=True)  # noqa: SIM115
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


# gloo's words when the other end of a connection went away (the peer's process ended, or it
# destroyed its process group after failing): the error of a rank that lost a peer, not a cause
LOST_PEER = ("Connection reset by peer", "Connection closed by peer")
# after the first failure, how long the other ranks get to report theirs (a peer blocked in a
# collective learns of the failure when the failed rank's connections close)
GRACE_S = 10.0
# how long a rank that has exited gets for a result still on its way through the queue
LATE_RESULT_S = 2.0


@dataclasses.dataclass
class RankFate:
    """What became of one rank of a launch: it ``returned``, ``raised`` (``error``: its
    traceback), ``exited`` without a result (``exitcode``: negative is the signal that ended
    it; ``crash_log``: the Python stacks faulthandler wrote on a fatal signal) or is still
    ``running``."""

    rank: int
    status: str
    error: str = ""
    exitcode: int | None = None
    crash_log: str = ""

    @property
    def last_line(self) -> str:
        return self.error.strip().splitlines()[-1] if self.error.strip() else ""

    @property
    def lost_a_peer(self) -> bool:
        """It raised gloo's error for a connection whose other end went away."""
        return self.status == "raised" and any(sign in self.last_line for sign in LOST_PEER)

    @property
    def signal(self) -> str | None:
        """The name of the signal that ended it (``SIGKILL``), if one did."""
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def summary(self) -> str:
        if self.status == "raised":
            return self.last_line
        if self.status == "exited":
            ended = f"killed by {self.signal}" if self.signal else f"exit code {self.exitcode}"
            return f"exited without a result ({ended})"
        return self.status


class LaunchFailed(RuntimeError):
    """A launch in which some rank failed. ``cause`` is the rank whose failure is its own: the
    first to raise an error other than a lost peer's (:data:`LOST_PEER`); else the first to
    exit without a result; else the first to raise. ``fates`` holds every rank's, in rank order."""

    def __init__(self, name: str, fates: list[RankFate], arrival: list[int]):
        self.fates = fates
        order = [fates[r] for r in arrival]
        self.cause = next(
            (f for f in order if f.status == "raised" and not f.lost_a_peer),
            next((f for f in order if f.status == "exited"), order[0]),
        )
        others = "; ".join(f"rank {f.rank}: {f.summary()}" for f in fates if f is not self.cause)
        detail = self.cause.error or self.cause.crash_log or "(faulthandler wrote nothing)\n"
        super().__init__(
            f"run_distributed({name}): rank {self.cause.rank} failed: {self.cause.summary()}\n"
            f"the other ranks: {others}\n{detail}"
        )

    @property
    def lost_rank(self) -> RankFate | None:
        """The rank a signal ended without a result when no rank raised an error of its own,
        only lost-peer errors: a process lost to a crash or a kill. ``None`` for a rank that
        chose to exit (a positive exit code: ``sys.exit``, the hang watchdog's ``os._exit``)."""
        if self.cause.status != "exited" or self.cause.signal is None:
            return None
        return self.cause


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
    Returns the per-rank return values (rank order). Raises :class:`LaunchFailed` naming the
    rank whose failure is its own and what became of the others, or TimeoutError after
    ``timeout`` seconds.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    sys.stdout.flush()
    sys.stderr.flush()
    results = ctx.Queue()
    port = free_port()
    crash_dir = tempfile.mkdtemp(prefix="run_distributed-")
    crash_logs = [os.path.join(crash_dir, f"rank{rank}.txt") for rank in range(world_size)]
    launch = _Launch(
        world_size,
        port,
        timeout,
        fn,
        args,
        results,
        emulate_npu,
        bind_device,
        threads,
        (dict(os.environ), _CallersFd(1), _CallersFd(2)),
    )
    procs = [
        ctx.Process(  # daemon=False: workers may start processes (dist-ckpt save does)
            target=_worker, args=(rank, launch, crash_logs[rank]), daemon=False
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        fates, payloads, arrival = _collect(procs, results, time.monotonic() + timeout)
        if len(payloads) == world_size:
            return [_loads(payloads[r]) for r in range(world_size)]
        if not arrival:
            missing = sorted(set(range(world_size)) - set(payloads))
            raise TimeoutError(
                f"run_distributed({fn.__name__}): ranks {missing} did not finish within {timeout} s"
            )
        every = []
        for rank in range(world_size):
            fate = fates.get(rank, RankFate(rank, "running"))
            if fate.status == "exited" and os.path.exists(crash_logs[rank]):
                with open(crash_logs[rank]) as log:
                    fate.crash_log = log.read()
            every.append(fate)
        raise LaunchFailed(fn.__name__, every, arrival)
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        shutil.rmtree(crash_dir, ignore_errors=True)


def _collect(procs, results, deadline: float):
    """Read the ranks' reports until every rank returned, ``deadline`` passed, or
    :data:`GRACE_S` after the first failure. Returns ``(fates, payloads, arrival)``: the
    failed ranks' :class:`RankFate`, the returned ranks' pickled results, and the failed
    ranks in the order their failures were seen."""
    fates: dict[int, RankFate] = {}
    payloads: dict[int, bytes] = {}
    arrival: list[int] = []
    exit_seen: dict[int, float] = {}
    while len(fates) + len(payloads) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=max(0.0, min(deadline - time.monotonic(), 0.5)))
        except queue_mod.Empty:
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in fates or r in payloads or p.exitcode is None:
                    continue
                if now - exit_seen.setdefault(r, now) >= LATE_RESULT_S:
                    fates[r] = RankFate(r, "exited", exitcode=p.exitcode)
                    arrival.append(r)
            if arrival:
                deadline = min(deadline, now + GRACE_S)
            continue
        if ok:
            payloads[rank] = payload
        else:
            fates[rank] = RankFate(rank, "raised", error=payload)
            arrival.append(rank)
            deadline = min(deadline, time.monotonic() + GRACE_S)
    return fates, payloads, arrival


class LostRankRetry(UserWarning):
    """A launch was retried after it lost a rank (:attr:`LaunchFailed.lost_rank`)."""


# the retries of the running test, for tests/conftest.py to record in the JUnit report
RETRIES: list[str] = []


def retried_after_a_lost_rank(launch, root: str):
    """``(launch(root), root)``, or, when that launch lost a rank (:attr:`LaunchFailed.lost_rank`:
    a signal ended a process without a result while every other failing
    rank only reports the lost connection), ``(launch(retry), retry)`` with ``retry =
    root/retry``: fresh directories for what the launch writes. The retry emits a
    :class:`LostRankRetry` warning and is recorded in the JUnit report; the retried launch
    must pass as the first had to. Any other failure fails at once."""
    try:
        return launch(root), root
    except LaunchFailed as error:
        if error.lost_rank is None:
            raise
        notice = f"a rank was lost, the launch is retried once:\n{str(error)[:3000]}"
        RETRIES.append(notice)
        warnings.warn(notice, LostRankRetry, stacklevel=2)
        retry = os.path.join(root, "retry")
        return launch(retry), retry


def init_megatron(tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234, **kwargs):
    """Inside a worker: CPU platform, megatron's parallel state and Megatron-LM's seeding
    (python, numpy, torch and megatron's device generator and TP tracker)."""
    from mcore_flash import platform

    platform.setup("cpu")
    from megatron.core import parallel_state

    from mcore_flash.runtime.distributed import set_random_seed

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
