"""``mcore-flash bench-cuda``: the ``cuda`` backend's kernels against torch SDPA's, on one GPU.

Implementations, all fed the same random bf16 q, k, v and output gradient (``[b, s, h, d]``
for ours, the ``[b, h, s, d]`` view of the same tensors for SDPA):

* ``ours``        -- ``flash_attn_func(backend="cuda")`` as it chooses (the kernel it ran is
  shown beside it);
* ``ours-flash`` / ``ours-cudnn`` -- a ``CudaBackend`` with that kernel first;
* ``sdpa-flash`` / ``sdpa-cudnn`` / ``sdpa-efficient`` -- ``torch.nn.functional.
  scaled_dot_product_attention`` held to one SDPA backend (``torch.nn.attention.sdpa_kernel``;
  ``enable_gqa`` when hkv < hq).

Each case is one forward + backward; the time is the median of ``--repeats`` runs after a
warm-up, between ``torch.cuda.synchronize()`` calls. TFLOP/s counts flash-attn's benchmark
convention (:func:`attention_flops`). An implementation that refuses a shape is shown with
its error. The last column is ``ours`` over the fastest SDPA backend at that length (the
target in issue 16: >= 0.95 at 8K-32K). ``--check`` first prints each implementation's largest
error against float64 math at s = 1024. Progress goes to stderr, markdown to stdout. Needs a
CUDA GPU; this has not run in this project's CI (no GPU there).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mcore_flash.ops import flash_attn_func
from mcore_flash.ops.backends.cuda import CudaBackend

from .common import int_list


def attention_flops(batch: int, seq: int, heads: int, head_dim: int, causal: bool) -> float:
    """FLOPs of one forward + backward: forward ``4 b s^2 h d`` (two matmuls), halved when causal,
    times 3.5 (backward = 2.5 forwards), as flash-attn's ``benchmarks/benchmark_flash_attention.py``."""
    forward = 4 * batch * seq * seq * heads * head_dim / (2 if causal else 1)
    return 3.5 * forward


@dataclass
class Row:
    """One implementation at one sequence length ``seq`` (tokens)."""

    impl: str
    seq: int
    ms: Optional[float]  # median fwd+bwd milliseconds; None: the implementation refused the shape
    tflops: Optional[float]  # attention_flops / time, 10^12 FLOP per second
    note: str = ""


def _inputs(args, seq: int, dtype=torch.bfloat16, seed: int = 0):
    """Random q, k, v and output gradient on the GPU, ``[b, seq, h, d]``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = lambda h: (args.batch, seq, h, args.head_dim)  # noqa: E731
    q = torch.randn(shape(args.heads), generator=g, device="cuda", dtype=dtype)
    k, v = (
        torch.randn(shape(args.kv_heads), generator=g, device="cuda", dtype=dtype) for _ in range(2)
    )
    return q, k, v, torch.randn_like(q)


def _ours(backend) -> Callable:
    return lambda q, k, v: flash_attn_func(q, k, v, causal=True, backend=backend)


def _sdpa(kernel) -> Callable:
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(kernel):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=True,
                enable_gqa=k.shape[2] != q.shape[2],
            )
        return out.transpose(1, 2)

    return run


def implementations() -> dict[str, Callable]:
    from torch.nn.attention import SDPBackend

    return {
        "ours": _ours("cuda"),
        "ours-flash": _ours(CudaBackend(preference="flash")),
        "ours-cudnn": _ours(CudaBackend(preference="cudnn")),
        "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }


def _step(fn, q, k, v, dout) -> None:
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    fn(q, k, v).backward(dout)


def time_ms(fn, inputs, repeats: int) -> float:
    """Median milliseconds of ``repeats`` forward + backward steps of ``fn`` after one warm-up."""
    _step(fn, *inputs)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _step(fn, *inputs)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def kernel_of_ours(q, k) -> str:
    """The kernel the automatic ``cuda`` backend runs for a causal call on these shapes."""
    from mcore_flash.ops.api import resolve_call

    backend, params = resolve_call(q, True, None, 0.0, "cuda")
    return backend.choose_kernel(q, k, params) or "reference"


def check_errors(args, impls: dict[str, Callable]) -> list[str]:
    """Markdown rows: each implementation's largest |error| of out, dq, dk, dv against float64."""
    q, k, v, dout = _inputs(args, 1024)
    want = _float64_reference(q, k, v, dout)
    lines = ["| impl | out | dq | dk | dv |", "|---|---|---|---|---|"]
    for name, fn in impls.items():
        try:
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
            out = fn(*leaves)
            out.backward(dout)
            errors = [
                (g.double() - w).abs().max().item()
                for g, w in zip((out, *(x.grad for x in leaves)), want)
            ]
            lines.append(f"| {name} | " + " | ".join(f"{e:.1e}" for e in errors) + " |")
        except RuntimeError as error:
            lines.append(f"| {name} | refused: {str(error).splitlines()[0][:80]} | | | |")
    return lines


def _float64_reference(q, k, v, dout):
    groups = q.shape[2] // k.shape[2]
    q64, k64, v64 = (x.double().requires_grad_(True) for x in (q, k, v))
    scores = (
        torch.einsum("bihd,bjhd->bhij", q64, k64.repeat_interleave(groups, 2)) / q.shape[-1] ** 0.5
    )
    scores = scores.masked_fill(
        torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf")
    )
    out = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v64.repeat_interleave(groups, 2))
    return (out.detach(), *torch.autograd.grad(out, (q64, k64, v64), dout.double()))


def table(rows: list[Row]) -> list[str]:
    """Markdown: one row per (length, implementation), then ours / fastest SDPA per length."""
    lines = ["| s | impl | ms | TFLOP/s | note |", "|---|---|---|---|---|"]
    for row in rows:
        ms = "—" if row.ms is None else f"{row.ms:.2f}"
        tflops = "—" if row.tflops is None else f"{row.tflops:.0f}"
        lines.append(f"| {row.seq} | {row.impl} | {ms} | {tflops} | {row.note} |")
    lines += ["", "| s | ours / fastest sdpa |", "|---|---|"]
    for seq in sorted({row.seq for row in rows}):
        ours = next((r.ms for r in rows if r.seq == seq and r.impl == "ours" and r.ms), None)
        sdpa = [r.ms for r in rows if r.seq == seq and r.impl.startswith("sdpa") and r.ms]
        ratio = f"{min(sdpa) / ours:.2f}" if ours and sdpa else "—"
        lines.append(f"| {seq} | {ratio} |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="mcore-flash bench-cuda", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seq-lengths", type=int_list, default=[8192, 16384, 32768])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--check",
        action="store_true",
        help="first print each implementation's error against float64",
    )
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "mcore-flash bench-cuda needs a CUDA GPU (torch.cuda.is_available() is False)",
            file=sys.stderr,
        )
        return 2
    impls = implementations()
    print(
        f"# bench-cuda on {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}"
    )
    if args.check:
        print("\n".join(check_errors(args, impls)) + "\n")
    rows = []
    for seq in args.seq_lengths:
        inputs = _inputs(args, seq)
        flops = attention_flops(args.batch, seq, args.heads, args.head_dim, causal=True)
        for name, fn in impls.items():
            print(f"bench-cuda: s={seq} {name}", file=sys.stderr, flush=True)
            note = kernel_of_ours(inputs[0], inputs[1]) if name == "ours" else ""
            try:
                ms = time_ms(fn, inputs, args.repeats)
                rows.append(Row(name, seq, ms, flops / ms / 1e9, note))
            except RuntimeError as error:
                rows.append(
                    Row(name, seq, None, None, f"refused: {str(error).splitlines()[0][:80]}")
                )
            torch.cuda.empty_cache()
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
