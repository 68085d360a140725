"""``mcore-flash bench-cp``: per-rank time and memory of context-parallel attention.

For each context-parallel size (``--cp-sizes``, default 1, 2, 4) and algorithm
(``--comm-types``: ``p2p`` ring, ``a2a`` Ulysses) the script starts ``cp`` processes on
127.0.0.1 (gloo), gives each rank its two chunks (``r`` and ``2cp-1-r`` of ``2cp``) of one
fixed total sequence (``--seq-length``) and times one forward + backward of
:func:`mcore_flash.ops.context_parallel.context_parallel_attn_func` (median of
``--repeats`` runs after one untimed warm-up; ranks start each run together after a
barrier). CP=1 is the plain fused kernel on the whole sequence.

Reported per rank (:func:`format_table`; ms, MiB, ratios against cp=1): fwd+bwd time of the
slowest and the fastest rank, bytes saved for backward
(:func:`mcore_flash.measured_memory.measure_saved_bytes`), bytes sent
(:func:`comm_bytes_per_rank`, computed from the algorithm). Column definitions and results:
docs/benchmarks.md, "Context parallelism (CPU, gloo)". Each rank runs ``--threads``
threads; on a machine with fewer cores than ``cp x threads`` the ranks share cores (the
table header says how many cores there were). Progress goes to stderr, the markdown
table to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue as queue_mod
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Optional

import torch

from mcore_flash.ports import free_port

from .common import DTYPES, MIB, choice_list, int_list, loadavg

# --dtype: all but fp64 (comm_bytes_per_rank counts fp32 dK/dV accumulators; fp64 inputs
# accumulate in fp64)
DTYPE_CHOICES = tuple(name for name in sorted(DTYPES) if name != "fp64")


@dataclass(frozen=True)
class Case:
    """One context-parallel run: ``cp`` ranks, the algorithm, ``seq`` tokens in all (split
    over the ranks), batch ``b``, query and key/value heads ``hq``/``hkv``, head dimension
    ``d``, the ``--dtype`` name, causal or not, and each block's attention backend."""

    cp: int
    comm: str  # "p2p" | "a2a" ("-" for cp = 1)
    seq: int
    b: int
    hq: int
    hkv: int
    d: int
    dtype: str
    causal: bool
    backend: str


@dataclass
class Result:
    """What one :class:`Case` measured, per rank."""

    case: Case
    max_ms: float  # the slowest rank's median fwd+bwd milliseconds
    min_ms: float  # the fastest rank's
    saved_bytes: int  # bytes saved for backward, the largest over ranks
    comm_bytes: int  # bytes one rank sends in one fwd+bwd (:func:`comm_bytes_per_rank`)


def comm_bytes_per_rank(case: Case) -> int:
    """Bytes one rank sends in one forward + backward, computed from the algorithm.

    Ring (``p2p``): ``(cp-1)`` K/V blocks forward, ``(cp-1)`` K/V blocks and ``cp`` fp32
    dK/dV blocks backward. Ulysses (``a2a``): ``(cp-1)/cp`` of q, k, v, out forward and of
    dout, dq, dk, dv backward, and the fp32 lse (K/V after replication to ``cp`` heads when
    ``hkv`` is not a multiple of ``cp``, e.g. ``hkv < cp``). 0 for cp = 1.
    """
    cp = case.cp
    if cp == 1:
        return 0
    elem = torch.empty(0, dtype=DTYPES[case.dtype]).element_size()
    local = case.seq // cp
    q_bytes = case.b * local * case.hq * case.d * elem
    if case.comm == "p2p":
        kv_bytes = 2 * case.b * local * case.hkv * case.d * elem
        dkv_bytes = kv_bytes // elem * 4  # fp32 accumulators
        return (cp - 1) * kv_bytes + (cp - 1) * kv_bytes + cp * dkv_bytes
    hkv = case.hkv if case.hkv % cp == 0 else cp
    kv_bytes = 2 * case.b * local * hkv * case.d * elem
    per_pass = 2 * q_bytes + kv_bytes  # forward: q, k, v, out; backward: dout, dq, dk, dv
    lse_bytes = case.b * local * case.hq * 4  # forward: the fp32 logsumexp back to its rank
    return (2 * per_pass + lse_bytes) * (cp - 1) // cp


def _inputs(case: Case) -> tuple[torch.Tensor, ...]:
    """The whole sequence's q, k, v and output gradient, ``[b, seq, h, d]``, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    dtype = DTYPES[case.dtype]
    q = torch.randn(case.b, case.seq, case.hq, case.d, generator=generator).to(dtype)
    k = torch.randn(case.b, case.seq, case.hkv, case.d, generator=generator).to(dtype)
    v = torch.randn(case.b, case.seq, case.hkv, case.d, generator=generator).to(dtype)
    dout = torch.randn(case.b, case.seq, case.hq, case.d, generator=generator).to(dtype)
    return q, k, v, dout


def _worker(rank: int, case: Case, port: int, threads: int, repeats: int, results) -> None:
    """One rank of ``case`` (a spawned process): puts ``(rank, True, (median ms, saved bytes))``
    on the ``results`` queue, or ``(rank, False, traceback)``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=case.cp, timeout=datetime.timedelta(seconds=1800)
        )
        from mcore_flash.measured_memory import measure_saved_bytes
        from mcore_flash.ops.context_parallel import context_parallel_attn_func, split_for_cp_rank

        group = dist.group.WORLD
        q, k, v, dout = (split_for_cp_rank(x, 1, case.cp, rank) for x in _inputs(case))
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]

        def forward():
            return context_parallel_attn_func(
                *leaves,
                group,
                causal=case.causal,
                comm_type=case.comm if case.cp > 1 else "p2p",
                backend=case.backend,
            )

        out, saved = measure_saved_bytes(forward)
        out.backward(dout)
        times = []
        for _ in range(repeats):
            for leaf in leaves:
                leaf.grad = None
            dist.barrier()
            start = time.perf_counter()
            forward().backward(dout)
            times.append(time.perf_counter() - start)
        results.put((rank, True, (statistics.median(times) * 1e3, saved.total)))
    except BaseException:  # noqa: BLE001 - report to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_case(case: Case, threads: int, repeats: int, timeout: float = 3600) -> Result:
    """Run ``case`` in ``case.cp`` spawned processes; raises RuntimeError on a rank failure."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, case, port, threads, repeats, results))
        for r in range(case.cp)
    ]
    for p in procs:
        p.start()
    per_rank = {}
    deadline = time.monotonic() + timeout
    try:
        while len(per_rank) < case.cp:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{case} did not finish within {timeout} s") from None
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"{case}: a rank exited without a result") from None
                continue
            if not ok:
                raise RuntimeError(f"{case}: rank {rank} failed:\n{payload}")
            per_rank[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    times = [ms for ms, _ in per_rank.values()]
    return Result(
        case=case,
        max_ms=max(times),
        min_ms=min(times),
        saved_bytes=max(nbytes for _, nbytes in per_rank.values()),
        comm_bytes=comm_bytes_per_rank(case),
    )


def format_table(results: list[Result]) -> str:
    """The markdown table: one row per result; times in ms, bytes in MiB, ratios against the
    cp=1 run of the same sequence."""
    base: dict[tuple, Result] = {}
    for r in results:
        if r.case.cp == 1:
            base[(r.case.seq, r.case.causal)] = r
    lines = [
        "| cp | algorithm | tokens/rank | fwd+bwd ms (slowest rank) | fastest rank ms | speed-up vs cp=1 | saved MiB/rank | saved vs cp=1 | comm MiB/rank |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ref: Optional[Result] = base.get((r.case.seq, r.case.causal))
        speedup = f"{ref.max_ms / r.max_ms:.2f}x" if ref else "-"
        saved_ratio = f"{r.saved_bytes / ref.saved_bytes:.3f}" if ref else "-"
        lines.append(
            f"| {r.case.cp} | {r.case.comm} | {r.case.seq // r.case.cp} | {r.max_ms:.0f} | {r.min_ms:.0f} | "
            f"{speedup} | {r.saved_bytes / MIB:.1f} | {saved_ratio} | {r.comm_bytes / MIB:.1f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-flash bench-cp",
        description="Per-rank time, saved bytes and communication of context-parallel attention (gloo)",
    )
    parser.add_argument(
        "--seq-length", type=int, default=8192, help="total tokens (split over the CP ranks)"
    )
    parser.add_argument("--cp-sizes", type=int_list, default=[1, 2, 4])
    parser.add_argument(
        "--comm-types", type=choice_list("--comm-types", ("p2p", "a2a")), default=["p2p", "a2a"]
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="fp32")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--backend", default="cpu", help="attention backend of each block (default cpu)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per case (median reported)"
    )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for cp in args.cp_sizes:
        if args.seq_length % (2 * cp):
            print(
                f"bench-cp: --seq-length {args.seq_length} must be divisible by 2 x cp = {2 * cp} for every "
                f"size in --cp-sizes {','.join(map(str, args.cp_sizes))}",
                file=sys.stderr,
            )
            return 2
    cases = []
    for cp in args.cp_sizes:
        for comm in ["-"] if cp == 1 else args.comm_types:
            cases.append(
                Case(
                    cp,
                    comm,
                    args.seq_length,
                    args.batch_size,
                    args.heads,
                    args.kv_heads,
                    args.head_dim,
                    args.dtype,
                    args.causal,
                    args.backend,
                )
            )
    results = []
    for case in cases:
        print(f"bench-cp: cp={case.cp} {case.comm} ...", file=sys.stderr, flush=True)
        results.append(run_case(case, args.threads, args.repeats))
    cores = os.cpu_count()
    print(
        f"seq {args.seq_length} (total), b {args.batch_size}, heads {args.heads}/{args.kv_heads} (q/kv), "
        f"head_dim {args.head_dim}, {args.dtype}, {'causal' if args.causal else 'full'}, backend "
        f"{args.backend}, {args.threads} thread(s)/rank, {cores} cores, load avg {loadavg() or 'n/a'}, "
        f"median of {args.repeats}\n"
    )
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
