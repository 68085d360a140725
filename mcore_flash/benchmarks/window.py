"""``mcore-flash bench-window``: a sliding-window Llama-style layer against full causal attention.

Two levels, each run with the window (``config.window_size = (W - 1, 0)``: every token sees
itself and the W - 1 tokens before it) and without (full causal), on the same inputs:

* ``attention`` -- :func:`mcore_flash.ops.flash_attn_func` alone, ``[1, S, h, d]``;
* ``layer``     -- a one-layer megatron-core ``GPTModel`` with our spec (RMSNorm, SwiGLU,
  RoPE, GQA; the embedding and output layer are small next to the layer at this S).

The prediction for attention is the ratio of attended (query, key) pairs,
:func:`attended_pairs` ``(S, W) / (S (S + 1) / 2)``. For the layer it weights that ratio by
the attention kernel's share of the step's FLOPs (:func:`mcore_flash.planning.step_flops`).
The cpu backend visits every key of a query chunk's band (``query_chunk`` rows at a time),
so it computes ``computed_pairs`` -- a few more than attended -- which is also reported.
Each time is one forward + backward, the median of ``--repeats`` runs after one untimed
warm-up of each; the runs alternate (full, window, full, ...). Progress goes to stderr,
a markdown table (or ``--json``) to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from mcore_flash.ops import flash_attn_func
from mcore_flash.ops.backends.base import band_rows

from .common import DTYPES, MegatronGroup, loadavg, progress_log
from .packed import run_conditions


def attended_pairs(seq_length: int, window: Optional[int]) -> int:
    """(query, key) pairs causal attention over ``seq_length`` tokens attends, each query seeing
    at most ``window`` keys (itself included; None = all earlier keys)."""
    if window is None or window >= seq_length:
        return seq_length * (seq_length + 1) // 2
    return window * (window + 1) // 2 + (seq_length - window) * window


def computed_pairs(seq_length: int, window: int, query_chunk: int) -> int:
    """Pairs the cpu backend's chunked kernel calls compute for that window (each chunk of
    ``query_chunk`` rows against every key its band reaches)."""
    total = 0
    for q0 in range(0, seq_length, query_chunk):
        q1 = min(q0 + query_chunk, seq_length)
        k0, k1 = band_rows(-(window - 1), 0, q0, q1, seq_length, seq_length)
        total += (q1 - q0) * (k1 - k0)
    return total


@dataclass
class Timing:
    """Wall-clock milliseconds of every timed fwd+bwd run of one level, full causal and windowed."""

    name: str
    full_ms: list[float]
    window_ms: list[float]

    @property
    def ratio(self) -> float:
        """Median window time over median full time."""
        return statistics.median(self.window_ms) / statistics.median(self.full_ms)


@dataclass
class Report:
    """What ``bench-window`` measured; times are median fwd+bwd milliseconds."""

    seq_length: int
    window: int
    hidden_size: int
    ffn_hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    backend: str
    threads: int
    repeats: int
    torch: str
    predicted_attention_ratio: float  # attended pairs, window / full
    computed_pairs_ratio: float  # what the cpu backend's chunks compute, window / full causal pairs
    predicted_layer_ratio: float  # FLOP-weighted
    attention_full_ms: float
    attention_window_ms: float
    attention_ratio: float
    layer_full_ms: float
    layer_window_ms: float
    layer_ratio: float
    max_abs_diff_first_window: float  # rows < W see the same keys with and without the window
    load_average: str  # 1-minute load average before -> after ("" where unknown)


def _time_alternating(
    name: str, full: Callable[[], None], window: Callable[[], None], repeats: int, log
) -> Timing:
    """One untimed warm-up of each step, then ``repeats`` rounds of full, window (wall clock)."""
    full()
    window()  # warm-up, untimed
    timing = Timing(name, [], [])
    for rep in range(repeats):
        for label, fn, times in (
            ("full", full, timing.full_ms),
            ("window", window, timing.window_ms),
        ):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            log(f"{name} repeat {rep + 1}/{repeats}: {label:>6} {times[-1]:9.1f} ms")
    return timing


def _attention_runs(args):
    s, dtype = args.seq_length, DTYPES[args.dtype]
    g = torch.Generator().manual_seed(args.seed)
    d = args.hidden_size // args.heads
    q = torch.randn(1, s, args.heads, d, generator=g).to(dtype).requires_grad_()
    k, v = (
        torch.randn(1, s, args.kv_heads, d, generator=g).to(dtype).requires_grad_()
        for _ in range(2)
    )
    dout = torch.randn(1, s, args.heads, d, generator=g).to(dtype)
    outputs = {}

    def run(window_size):
        def step():
            for x in (q, k, v):
                x.grad = None
            out = flash_attn_func(q, k, v, 0.0, None, True, window_size, backend=args.backend)
            out.backward(dout)
            outputs[window_size] = out.detach()

        return step

    full, window = run((-1, -1)), run((args.window - 1, 0))
    return full, window, outputs


def _shape(args):
    from mcore_flash.planning import ModelShape

    return ModelShape(
        "bench-window",
        1,
        args.hidden_size,
        args.ffn_hidden_size,
        args.heads,
        args.kv_heads,
        args.vocab_size,
        max_position_embeddings=args.seq_length,
    )


def _layer_runs(args):
    from mcore_flash.benchmarks.models import build_flash_gpt

    dtype = DTYPES[args.dtype]
    models = {}
    for name, window in (("full", None), ("window", (args.window - 1, 0))):
        torch.manual_seed(args.seed)
        models[name] = build_flash_gpt(
            _shape(args), window_size=window, params_dtype=dtype, bf16=dtype == torch.bfloat16
        )
        models[name].train()
    models["window"].load_state_dict(models["full"].state_dict())
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab_size, (1, args.seq_length + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(args.seq_length).unsqueeze(0)

    def run(model):
        def step():
            model.zero_grad(set_to_none=True)
            model(inputs, positions, None, labels=labels).mean().backward()

        return step

    return run(models["full"]), run(models["window"])


def predicted_layer_ratio(args, attention_ratio: float) -> float:
    """The layer's window/full FLOP ratio when only the attention kernel's FLOPs shrink by
    ``attention_ratio`` (the planner's FLOP model, fused kernel)."""
    from mcore_flash.planning import step_flops
    from mcore_flash.planning.flops import FUSED_ATTENTION_BACKWARD, forward_flops

    shape = _shape(args)
    total = step_flops(shape, args.seq_length)
    kernel = (1 + FUSED_ATTENTION_BACKWARD) * forward_flops(shape, args.seq_length)[
        "attention_kernel"
    ]
    return (total - (1 - attention_ratio) * kernel) / total


def measure(args, log) -> Report:
    """Time both levels with and without the window, and predict their ratios: the :class:`Report`."""
    full_pairs = attended_pairs(args.seq_length, None)
    predicted = attended_pairs(args.seq_length, args.window) / full_pairs
    load_before = loadavg()
    full, window, outputs = _attention_runs(args)
    attention = _time_alternating("attention", full, window, args.repeats, log)
    rows = slice(0, args.window)
    diff = (
        (outputs[(-1, -1)][:, rows].double() - outputs[(args.window - 1, 0)][:, rows].double())
        .abs()
        .max()
        .item()
    )
    with MegatronGroup():
        layer = _time_alternating("layer", *_layer_runs(args), args.repeats, log)
    from mcore_flash.ops.backends import get_backend

    chunk = getattr(get_backend(args.backend), "query_chunk", 1)
    return Report(
        seq_length=args.seq_length,
        window=args.window,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        dtype=args.dtype,
        backend=args.backend,
        threads=torch.get_num_threads(),
        repeats=args.repeats,
        torch=torch.__version__,
        predicted_attention_ratio=predicted,
        computed_pairs_ratio=computed_pairs(args.seq_length, args.window, chunk) / full_pairs,
        predicted_layer_ratio=predicted_layer_ratio(args, predicted),
        attention_full_ms=statistics.median(attention.full_ms),
        attention_window_ms=statistics.median(attention.window_ms),
        attention_ratio=attention.ratio,
        layer_full_ms=statistics.median(layer.full_ms),
        layer_window_ms=statistics.median(layer.window_ms),
        layer_ratio=layer.ratio,
        max_abs_diff_first_window=diff,
        load_average=f"{load_before} -> {loadavg()}" if load_before else "",
    )


def format_report(r: Report) -> str:
    """The markdown summary: a title line, a table (times in ms) and the pairs the cpu backend computes."""
    title = (
        f"S={r.seq_length}, window {r.window}, hidden {r.hidden_size}, ffn {r.ffn_hidden_size}, "
        + run_conditions(r)
    )
    return "\n".join(
        [
            title,
            "",
            "| what | full causal fwd+bwd ms | window fwd+bwd ms | measured window / full | predicted | measured / predicted |",
            "|---|---:|---:|---:|---:|---:|",
            f"| attention op | {r.attention_full_ms:.1f} | {r.attention_window_ms:.1f} | **{r.attention_ratio:.3f}** "
            f"| {r.predicted_attention_ratio:.3f} (attended pairs) | {r.attention_ratio / r.predicted_attention_ratio:.2f} |",
            f"| one-layer GPT | {r.layer_full_ms:.1f} | {r.layer_window_ms:.1f} | **{r.layer_ratio:.3f}** "
            f"| {r.predicted_layer_ratio:.3f} (FLOP-weighted) | {r.layer_ratio / r.predicted_layer_ratio:.2f} |",
            "",
            f"pairs the cpu backend's chunks compute, window / full causal: {r.computed_pairs_ratio:.3f}; "
            f"rows < window: max |window - full| = {r.max_abs_diff_first_window:.1e}",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-flash bench-window",
        description="fwd+bwd time of sliding-window attention (alone and in a Llama-style layer) against full "
        "causal attention, next to the ratio of attended pairs.",
    )
    parser.add_argument("--seq-length", type=int, default=16384, help="tokens S (default 16384)")
    parser.add_argument(
        "--window",
        type=int,
        default=4096,
        help="keys each token sees, itself included (default 4096)",
    )
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--ffn-hidden-size", type=int, default=688)
    parser.add_argument("--num-attention-heads", dest="heads", type=int, default=4)
    parser.add_argument("--num-query-groups", dest="kv_heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--backend", default="cpu", help="attention backend (default cpu)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs of each (median reported)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not 1 <= args.window <= args.seq_length or args.repeats < 1:
        print(
            "bench-window: need 1 <= --window <= --seq-length and --repeats >= 1", file=sys.stderr
        )
        return 2
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        print(
            "bench-window: --hidden-size must be a multiple of --num-attention-heads, and that of "
            "--num-query-groups",
            file=sys.stderr,
        )
        return 2

    log = progress_log("bench-window")
    log(
        f"S={args.seq_length} window={args.window} hidden={args.hidden_size} heads={args.heads}/{args.kv_heads} "
        f"{args.dtype} backend={args.backend} threads={torch.get_num_threads()} torch {torch.__version__}"
    )
    report = measure(args, log)
    print(json.dumps(asdict(report)) if args.json else f"\n{format_report(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
