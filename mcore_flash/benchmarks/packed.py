"""``mcore-flash bench-packed``: attention time of packed documents vs one causal sequence.

One sample of ``S = --seq-length`` tokens holds documents of random lengths (see
:func:`document_lengths`). Two runs get the same random q, k, v and output gradient:

* ``dense``  -- :func:`mcore_flash.ops.flash_attn_func` ``(causal=True)`` over all S tokens
  (``[1, S, h, d]``): every token sees every earlier token, across documents;
* ``packed`` -- :func:`mcore_flash.ops.flash_attn_varlen_func` ``(causal=True)`` over the
  same tokens as ``[S, h, d]`` with the documents' ``cu_seqlens``: document masking, each
  token sees only the earlier tokens of its own document.

Causal attention work is proportional to the squared length, so the packed run should
take ``sum(len_i**2) / S**2`` of the dense time (the *prediction*, :func:`predicted_ratio`).
Times are milliseconds of one forward + backward, wall and process CPU, medians over
``--repeats`` (how they are taken, and the warm-up's correctness check: :func:`measure`).
Progress goes to stderr; stdout gets a markdown table (:func:`format_report`), or with
``--json`` one JSON object (the fields of :class:`Report`). Usage, results and their
reading: docs/benchmarks.md, "Packed documents (CPU)".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from mcore_flash.ops import flash_attn_func, flash_attn_varlen_func

from .common import DTYPES, loadavg, progress_log, timed

Tensor = torch.Tensor


def document_lengths(seq_length: int, mean_length: int, seed: int) -> list[int]:
    """Token counts of the documents packed into one sample; they sum to ``seq_length``.

    Lengths are drawn independently and uniformly from the integers ``[1, 2 * mean_length - 1]``
    (mean ``mean_length``) by a ``torch.Generator`` seeded with ``seed``, until they reach
    ``seq_length``; the last document is cut to fit.
    """
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    remaining = seq_length
    while remaining > 0:
        length = int(torch.randint(1, 2 * mean_length, (1,), generator=generator))
        lengths.append(min(length, remaining))
        remaining -= lengths[-1]
    return lengths


def predicted_ratio(lengths: list[int]) -> float:
    """``sum(len_i**2) / S**2`` with ``S = sum(len_i)``: packed causal work over dense causal work."""
    total = sum(lengths)
    return sum(n * n for n in lengths) / (total * total)


def cu_seqlens(lengths: list[int]) -> Tensor:
    """int32 ``[num_documents + 1]`` cumulative lengths from 0, as ``flash_attn_varlen_func`` takes them."""
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)


class Run:
    """One attention call, forward + backward, on its own leaf copies of q, k, v.

    ``forward`` maps the leaves to the output; ``grad`` is the output gradient (same shape).
    """

    def __init__(
        self, name: str, leaves: list[Tensor], forward: Callable[..., Tensor], grad: Tensor
    ):
        self.name, self.leaves, self.forward, self.grad = name, leaves, forward, grad
        self.times_ms: list[float] = []
        self.cpu_ms: list[float] = []

    def step(self) -> Tensor:
        """One forward + backward; returns the detached output, leaves the gradients in the leaves."""
        for leaf in self.leaves:
            leaf.grad = None
        out = self.forward(*self.leaves)
        out.backward(self.grad)
        return out.detach()

    def timed_step(self) -> None:
        """One forward + backward; appends its wall time to ``times_ms`` and the process's CPU
        time to ``cpu_ms`` (milliseconds)."""
        with timed(self.times_ms, self.cpu_ms):
            self.step()


def build_runs(args, lengths: list[int]) -> tuple[Run, Run]:
    """The dense (``[1, S, h, d]``, causal over all S tokens) and packed (``[S, h, d]``,
    causal per document) runs, fed the same q, k, v and output gradient drawn with ``args.seed``."""
    s, dtype = args.seq_length, DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(args.seed)
    shape_q, shape_kv = (1, s, args.heads, args.head_dim), (1, s, args.kv_heads, args.head_dim)
    q, k, v, dout = (
        torch.randn(shape, generator=generator).to(dtype)
        for shape in (shape_q, shape_kv, shape_kv, shape_q)
    )
    cu = cu_seqlens(lengths)
    longest = max(lengths)

    def dense(q, k, v):
        return flash_attn_func(q, k, v, causal=True, backend=args.backend)

    def packed(q, k, v):
        return flash_attn_varlen_func(
            q, k, v, cu, cu, longest, longest, causal=True, backend=args.backend
        )

    dense_run = Run("dense", [x.clone().requires_grad_() for x in (q, k, v)], dense, dout)
    packed_run = Run("packed", [x[0].clone().requires_grad_() for x in (q, k, v)], packed, dout[0])
    return dense_run, packed_run


def first_document_diff(dense_out: Tensor, packed_out: Tensor, first_length: int) -> float:
    """Max |packed - dense| over the first document's rows (dense ``[1, S, h, d]``, packed ``[S, h, d]``)."""
    rows = slice(0, first_length)
    return (packed_out[rows].double() - dense_out[0, rows].double()).abs().max().item()


@dataclass
class Report:
    """What ``bench-packed`` measured; times in milliseconds."""

    seq_length: int
    mean_document_length: int
    seed: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    backend: str
    threads: int
    repeats: int
    torch: str
    document_lengths: list[int]
    num_documents: int
    predicted_ratio: float  # sum(len_i**2) / S**2
    dense_ms: float  # median wall time
    packed_ms: float  # median wall time
    measured_ratio: float  # packed_ms / dense_ms
    dense_cpu_ms: float  # median process CPU time
    packed_cpu_ms: float  # median process CPU time
    measured_cpu_ratio: float  # packed_cpu_ms / dense_cpu_ms
    dense_runs_ms: list[float]  # wall time of every timed run
    packed_runs_ms: list[float]
    first_document_max_diff: float
    load_average: str  # 1-minute load average before -> after ("" where unknown)


def measure(args, log: Callable[[str], None]) -> Report:
    """Warm up both runs, then time them alternately; returns the :class:`Report`.

    Each time is one forward + backward, the median of ``--repeats`` runs after one untimed
    warm-up of each; the runs alternate (dense, packed, dense, ...) so that a change in
    machine load hits both alike. Both the wall time and the process's CPU time are
    reported: with one thread (the default) the CPU time is what the kernels cost even while
    other processes take the core, which stretches the wall time. The warm-up also checks
    that the packed output of the first document equals the dense output on those rows
    (causal attention over a prefix does not depend on what follows it).
    """
    lengths = document_lengths(args.seq_length, args.mean_document_length, args.seed)
    prediction = predicted_ratio(lengths)
    log(
        f"{len(lengths)} documents (mean {args.seq_length / len(lengths):.1f} tokens, longest {max(lengths)}), "
        f"sum(len^2)/S^2 = {prediction:.4f}"
    )
    load_before = loadavg()
    dense, packed = build_runs(args, lengths)
    diff = first_document_diff(dense.step(), packed.step(), lengths[0])
    log(f"warm-up done; first document: max |packed - dense| = {diff:.1e}")
    for rep in range(args.repeats):
        for run in (dense, packed):
            run.timed_step()
            log(
                f"repeat {rep + 1}/{args.repeats}: {run.name:>6} {run.times_ms[-1]:9.1f} ms "
                f"(process CPU {run.cpu_ms[-1]:.1f} ms)"
            )
    load_after = loadavg()
    dense_ms, packed_ms = statistics.median(dense.times_ms), statistics.median(packed.times_ms)
    dense_cpu_ms, packed_cpu_ms = statistics.median(dense.cpu_ms), statistics.median(packed.cpu_ms)
    return Report(
        seq_length=args.seq_length,
        mean_document_length=args.mean_document_length,
        seed=args.seed,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        backend=args.backend,
        threads=torch.get_num_threads(),
        repeats=args.repeats,
        torch=torch.__version__,
        document_lengths=lengths,
        num_documents=len(lengths),
        predicted_ratio=prediction,
        dense_ms=dense_ms,
        packed_ms=packed_ms,
        measured_ratio=packed_ms / dense_ms,
        dense_cpu_ms=dense_cpu_ms,
        packed_cpu_ms=packed_cpu_ms,
        measured_cpu_ratio=packed_cpu_ms / dense_cpu_ms,
        dense_runs_ms=dense.times_ms,
        packed_runs_ms=packed.times_ms,
        first_document_max_diff=diff,
        load_average=f"{load_before} -> {load_after}" if load_before else "",
    )


def run_conditions(r) -> str:
    """How a timed attention benchmark ran, the end of its title: ``"{heads} heads, {kv_heads}
    kv heads, d={head_dim}, {dtype}, backend {backend}, {threads} threads, median of {repeats},
    torch {torch}"``, then ``", load average {before} -> {after}"`` where known. ``r``: a report
    with those fields (``bench-packed``'s :class:`Report`, ``bench-window``'s)."""
    load = f", load average {r.load_average}" if r.load_average else ""
    return (
        f"{r.heads} heads, {r.kv_heads} kv heads, d={r.head_dim}, {r.dtype}, backend {r.backend}, "
        f"{r.threads} threads, median of {r.repeats}, torch {r.torch}{load}"
    )


def format_report(r: Report) -> str:
    """The markdown summary: a title line, a table and the document lengths."""
    title = (
        f"S={r.seq_length}, mean document length {r.mean_document_length} (seed {r.seed}), "
        + run_conditions(r)
    )
    lines = [
        title,
        "",
        "| attention | documents | fwd+bwd ms, wall (median) | wall vs dense | fwd+bwd ms, CPU (median) "
        "| CPU vs dense | predicted (sum len² / S²) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| dense (one causal attention over S) | 1 | {r.dense_ms:.1f} | 1.000 | {r.dense_cpu_ms:.1f} | 1.000 "
        "| 1.000 |",
        f"| packed (causal per document, varlen) | {r.num_documents} | {r.packed_ms:.1f} | {r.measured_ratio:.3f} "
        f"| {r.packed_cpu_ms:.1f} | {r.measured_cpu_ratio:.3f} | {r.predicted_ratio:.3f} |",
        "",
        f"measured / predicted = {r.measured_ratio / r.predicted_ratio:.2f} (wall), "
        f"{r.measured_cpu_ratio / r.predicted_ratio:.2f} (CPU); first document: "
        f"max |packed - dense| = {r.first_document_max_diff:.1e}",
        f"document lengths: {','.join(map(str, r.document_lengths))}",
    ]
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-flash bench-packed",
        description="fwd+bwd time of per-document (varlen) causal attention over packed documents against one "
        "causal attention over the whole sample, next to the prediction sum(len^2) / S^2.",
    )
    parser.add_argument(
        "--seq-length", type=int, default=8192, help="tokens in the sample, S (default 8192)"
    )
    parser.add_argument(
        "--mean-document-length",
        type=int,
        default=None,
        help="mean document length D; lengths uniform in [1, 2D-1], the last cut to fit "
        "(default S // 16)",
    )
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument(
        "--kv-heads", type=int, default=None, help="key/value heads (GQA); default = --heads"
    )
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument(
        "--backend", default="cpu", help="attention backend of both runs (default cpu)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs of each (median reported)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds the document lengths and q, k, v"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared machine every kernel call of two "
        "threads can wait for a descheduled sibling, which hits the many short per-document "
        "calls far harder than the one long dense call)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    return parser


def _check_args(args) -> Optional[str]:
    """The first problem with the parsed arguments, or None."""
    if args.seq_length < 1 or args.repeats < 1:
        return "--seq-length and --repeats must be >= 1"
    if not 1 <= args.mean_document_length <= args.seq_length:
        return (
            f"--mean-document-length must lie in [1, --seq-length], got {args.mean_document_length}"
        )
    if args.heads % args.kv_heads:
        return f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mean_document_length is None:
        args.mean_document_length = max(1, args.seq_length // 16)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    problem = _check_args(args)
    if problem:
        print(f"bench-packed: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)

    log = progress_log("bench-packed")
    log(
        f"S={args.seq_length} D={args.mean_document_length} heads={args.heads} kv_heads={args.kv_heads} "
        f"d={args.head_dim} {args.dtype} backend={args.backend} repeats={args.repeats} "
        f"threads={torch.get_num_threads()} torch {torch.__version__}"
    )
    report = measure(args, log)
    print(json.dumps(asdict(report)) if args.json else f"\n{format_report(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
