"""``mcore-flash bench-attention``: fwd+bwd time and saved-for-backward bytes of attention.

Implementations (each in its native layout, all fed the same random q, k, v and output
gradient):

* ``stock``     -- Megatron-core's own ``DotProductAttention`` (``[s, b, h, d]``, explicit
  bool causal mask, unfused softmax: ``masked_softmax_fusion=False``). Needs a one-process
  gloo group, ``initialize_model_parallel()`` and ``mcore_flash.platform.setup("cpu")``.
* ``sdpa``      -- ``torch.nn.functional.scaled_dot_product_attention`` (``[b, h, s, d]``).
* ``cpu``       -- ``mcore_flash.ops.flash_attn_func(backend="cpu")`` (``[b, s, h, d]``).
* ``reference`` -- ``flash_attn_func(backend="reference")``; ``reference@BQxBK`` runs a
  ``ReferenceBackend(block_q=BQ, block_k=BK)`` (for block-size sweeps).

Each case is one forward + backward with a random output gradient; the time is the median of
``--repeats`` runs after one untimed warm-up run, which also measures the bytes saved for
backward (:func:`mcore_flash.measured_memory.measure_saved_bytes`). A case whose
predicted peak memory exceeds ``--max-memory-gb`` is skipped, not run. Progress goes to
stderr, the markdown table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mcore_flash.measured_memory import measure_saved_bytes

from .common import (
    DTYPES,
    GIB,
    MIB,
    MegatronGroup,
    int_list,
    loadavg,
    peak_rss,
    progress_log,
    reset_peak_rss,
    timed,
)

Tensor = torch.Tensor

IMPLS = ("stock", "sdpa", "cpu", "reference")


@dataclass(frozen=True)
class Case:
    """One attention call to time: implementation, batch ``b``, sequence length ``s`` (tokens),
    query and key/value heads ``hq``/``hkv``, head dimension ``d``, dtype, causal or not."""

    impl: str  # "stock" | "sdpa" | "cpu" | "reference" | "reference@BQxBK"
    b: int
    s: int
    hq: int
    hkv: int
    d: int
    dtype: torch.dtype
    causal: bool


@dataclass
class Result:
    """What one :class:`Case` measured (nothing but ``skipped`` when it was not run)."""

    case: Case
    ms: Optional[float] = None  # median fwd+bwd milliseconds
    saved_bytes: Optional[int] = None  # bytes saved for backward
    skipped: str = ""  # reason, when not run
    max_err: Optional[float] = None  # max |out|,|grads| difference vs the first impl run at this s


# ---- memory prediction --------------------------------------------------------------------


def predicted_peak_bytes(case: Case) -> int:
    """Peak bytes one fwd+bwd of ``case`` allocates (inputs, grads and temporaries).

    ``stock`` holds up to four ``[b, h, s, s]`` score-sized tensors at once (Megatron's
    preallocated baddbmm buffer, the scores, the saved probabilities and, in backward, the
    probability and score gradients) plus the ``s x s`` bool mask; the fused kernels are
    O(s); ``reference`` adds fp32 gradient accumulators and a few ``block_q x block_k``
    blocks per head. Checked against measured RSS on 2 CPU cores (see docs/benchmarks.md).
    """
    e = torch.finfo(case.dtype).bits // 8
    qo = case.b * case.s * case.hq * case.d * e  # bytes of q (= out, dout, dq)
    kv = case.b * case.s * case.hkv * case.d * e  # bytes of k (= v, dk, dv)
    io = 5 * qo + 4 * kv  # q, out, dout, dq + k, v, dk, dv (+ out's grad path)
    name, block_q, block_k = _parse_impl(case.impl)
    if name == "stock":
        scores = case.b * case.hq * case.s * case.s * max(e, 4)  # fp16/bf16: softmax runs in fp32
        expanded = 4 * qo if case.hq != case.hkv else 0  # repeat_interleave'd k, v and grads
        return io + expanded + 4 * scores + case.s * case.s
    if name == "reference":
        acc = (
            4 * (case.b * case.s * (case.hq + 2 * case.hkv) * case.d) * 2
        )  # fp32 dq, dk, dv (+ copies)
        block = case.b * case.hq * block_q * block_k * 4
        return io + acc + 8 * block + 64 * MIB
    return io + 64 * MIB  # fused kernels: per-thread blocks and the lse


# ---- implementations ----------------------------------------------------------------------


def _parse_impl(impl: str) -> tuple[str, int, int]:
    """``"reference@128x256"`` -> ("reference", 128, 256); other names get the defaults."""
    name, _, blocks = impl.partition("@")
    if name not in IMPLS:
        raise ValueError(
            f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)} (or reference@BQxBK)"
        )
    if blocks and name != "reference":
        raise ValueError(f"only reference takes block sizes, got {impl!r}")
    if name == "reference":
        from mcore_flash.ops.backends import ReferenceBackend

        default = ReferenceBackend()
        if not blocks:
            return name, default.block_q, default.block_k
        try:
            block_q, block_k = (int(x) for x in blocks.lower().split("x"))
        except ValueError:
            raise ValueError(
                f"block sizes must look like reference@128x256, got {impl!r}"
            ) from None
        if block_q < 1 or block_k < 1:
            raise ValueError(f"block sizes must be positive, got {impl!r}")
        return name, block_q, block_k
    return name, 0, 0


def _stock_module(case: Case) -> torch.nn.Module:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=case.hq * case.d,
        num_attention_heads=case.hq,
        num_query_groups=case.hkv,
        kv_channels=case.d,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=True,
        params_dtype=case.dtype,
        bf16=case.dtype == torch.bfloat16,
        fp16=case.dtype == torch.float16,
        use_cpu_initialization=True,
    )
    mask_type = AttnMaskType.causal if case.causal else AttnMaskType.no_mask
    return DotProductAttention(
        config, layer_number=1, attn_mask_type=mask_type, attention_type="self"
    )


def _free_megatron_buffer() -> None:
    """Drop Megatron's preallocated score buffer (it only grows otherwise)."""
    from megatron.core import parallel_state

    buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    if buffer is not None:
        buffer.buffer.clear()


def _build(case: Case, q: Tensor, k: Tensor, v: Tensor, dout: Tensor):
    """Leaf inputs in the impl's layout, a forward closure, its output gradient, and a
    function mapping (out, dq, dk, dv) back to ``[b, s, h, d]`` for the cross-check."""
    name, block_q, block_k = _parse_impl(case.impl)
    if name == "stock":
        module = _stock_module(case)
        leaves = [
            x.transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v)
        ]  # [s, b, h, d]
        mask = None
        if case.causal:
            mask = torch.ones(1, 1, case.s, case.s, dtype=torch.bool).triu_(1)  # True = masked
        grad = dout.transpose(0, 1).reshape(case.s, case.b, case.hq * case.d).contiguous()

        def forward():
            return module(*leaves, attention_mask=mask)

        def to_bshd(t: Tensor) -> Tensor:
            return t.reshape(t.shape[0], t.shape[1], -1, case.d).transpose(0, 1)

        return leaves, forward, grad, to_bshd
    if name == "sdpa":
        leaves = [
            x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)
        ]  # [b, h, s, d]
        grad = dout.transpose(1, 2).contiguous()
        gqa = {"enable_gqa": True} if case.hq != case.hkv else {}

        def forward():
            return torch.nn.functional.scaled_dot_product_attention(
                *leaves, is_causal=case.causal, **gqa
            )

        return leaves, forward, grad, lambda t: t.transpose(1, 2)

    from mcore_flash.ops import flash_attn_func
    from mcore_flash.ops.backends import ReferenceBackend

    backend = ReferenceBackend(block_q=block_q, block_k=block_k) if name == "reference" else name
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]  # [b, s, h, d]

    def forward():
        return flash_attn_func(*leaves, causal=case.causal, backend=backend)

    return leaves, forward, dout, lambda t: t


class Runner:
    """One case, built and warmed up: inputs, the forward closure and its output gradient."""

    def __init__(self, case: Case):
        self.case = case
        gen = torch.Generator().manual_seed(case.s)
        shape_q = (case.b, case.s, case.hq, case.d)
        shape_k = (case.b, case.s, case.hkv, case.d)
        q, k, v = (
            torch.randn(s, generator=gen, dtype=case.dtype) for s in (shape_q, shape_k, shape_k)
        )
        dout = torch.randn(shape_q, generator=gen, dtype=case.dtype)
        self.leaves, self.forward, self.grad, self._to_bshd = _build(case, q, k, v, dout)
        self.times_ms: list[float] = []
        self.cpu_ms: list[float] = []

    def warmup(self) -> tuple[int, list[Tensor]]:
        """One untimed fwd+bwd: returns the bytes saved for backward and (out, dq, dk, dv)
        in ``[b, s, h, d]`` for the cross-check."""
        out, saved = measure_saved_bytes(self.forward)
        saved = saved.total
        out.backward(self.grad)
        outputs = [self._to_bshd(out.detach())] + [self._to_bshd(leaf.grad) for leaf in self.leaves]
        self._zero_grads()
        return saved, outputs

    def timed_step(self) -> None:
        with timed(self.times_ms, self.cpu_ms):
            out = self.forward()
            out.backward(self.grad)
        del out
        self._zero_grads()

    def _zero_grads(self) -> None:
        for leaf in self.leaves:
            leaf.grad = None


def run_length(
    cases: list[Case], repeats: int, max_bytes: float, log: Callable[[str], None]
) -> list[Result]:
    """All implementations at one sequence length, timed interleaved (impl A, B, C, A, B, C,
    ...) so that a change in machine load hits them alike."""
    results, runners, reference = [], [], None
    for case in cases:
        need = predicted_peak_bytes(case)
        if need > max_bytes:
            result = Result(case, skipped=f"skipped (needs {need / GIB:.1f} GiB)")
            log(
                f"{case.impl:>15} s={case.s:>6}: {result.skipped}, over --max-memory-gb {max_bytes / GIB:g}"
            )
            results.append(result)
            continue
        gc.collect()
        rss0 = reset_peak_rss()
        runner = Runner(case)
        saved, outputs = runner.warmup()
        peak = peak_rss()
        result = Result(case, saved_bytes=saved)
        note = ""
        if reference is None:
            reference = (case.impl, outputs)
        else:
            result.max_err = max(
                (a.double() - b.double()).abs().max().item() for a, b in zip(outputs, reference[1])
            )
            note = f", max |diff| vs {reference[0]} {result.max_err:.1e}"
        if rss0 is not None and peak is not None:
            note += f", peak RSS +{(peak - rss0) / GIB:.2f} GiB (predicted {need / GIB:.2f})"
        del outputs
        log(f"{case.impl:>15} s={case.s:>6}: warm-up done, saved {saved / MIB:.1f} MiB{note}")
        if case.impl == "stock":
            _free_megatron_buffer()
        runners.append(runner)
        results.append(result)
    for _ in range(repeats):
        for runner in runners:
            runner.timed_step()
            if runner.case.impl == "stock":
                _free_megatron_buffer()
    for result in results:
        runner = next((r for r in runners if r.case is result.case), None)
        if runner is not None:
            result.ms = statistics.median(runner.times_ms)
            log(
                f"{result.case.impl:>15} s={result.case.s:>6}: {result.ms:10.1f} ms median "
                f"(runs {', '.join(f'{t:.0f}' for t in runner.times_ms)}; "
                f"process CPU {statistics.median(runner.cpu_ms):.0f} ms)"
            )
    return results


# ---- command line -------------------------------------------------------------------------


def _impl_list(text: str) -> list[str]:
    impls = [x.strip() for x in text.split(",") if x.strip()]
    for impl in impls:
        try:
            _parse_impl(impl)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return impls


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-flash bench-attention",
        description="Time fwd+bwd and measure saved-for-backward bytes of attention implementations.",
    )
    parser.add_argument(
        "--seq-lengths",
        type=int_list,
        default=[1024, 2048, 4096, 8192, 16384],
        help="comma-separated sequence lengths (default: 1024,2048,4096,8192,16384)",
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument(
        "--kv-heads", type=int, default=None, help="key/value heads (GQA); default = --heads"
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument(
        "--causal",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="causal masking (default: on)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per case (median reported)"
    )
    parser.add_argument(
        "--impls",
        type=_impl_list,
        default=list(IMPLS),
        help="comma-separated: stock,sdpa,cpu,reference (or reference@BQxBK)",
    )
    parser.add_argument(
        "--max-memory-gb",
        type=float,
        default=8.0,
        help="skip a case whose predicted peak memory exceeds this (GiB)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: s=512,1024 and 1 repeat (overrides --seq-lengths/--repeats)",
    )
    return parser


def _fmt_ms(result: Result) -> str:
    """The time cell: the median in ms, or why the case was skipped."""
    return result.skipped if result.skipped else f"{result.ms:.1f}"


def format_table(results: list[Result]) -> str:
    """The markdown table: one row per result, time in ms, saved bytes in MiB, and the
    speed-up over ``stock`` at the same ``s``."""
    stock = {r.case.s: r for r in results if r.case.impl == "stock" and r.ms is not None}
    lines = [
        "| impl | s | fwd+bwd ms (median) | saved-for-backward MiB | speedup vs stock |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        saved = "" if r.saved_bytes is None else f"{r.saved_bytes / MIB:.1f}"
        base = stock.get(r.case.s)
        speedup = f"{base.ms / r.ms:.2f}x" if base is not None and r.ms else "n/a"
        lines.append(f"| {r.case.impl} | {r.case.s} | {_fmt_ms(r)} | {saved} | {speedup} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.seq_lengths, args.repeats = [512, 1024], 1
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if args.heads % kv_heads:
        print(
            f"bench-attention: --heads ({args.heads}) must be a multiple of --kv-heads ({kv_heads})",
            file=sys.stderr,
        )
        return 2
    if args.repeats < 1:
        print("bench-attention: --repeats must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]

    log = progress_log("bench-attention")
    log(
        f"b={args.batch_size} heads={args.heads} kv_heads={kv_heads} d={args.head_dim} {args.dtype} "
        f"causal={args.causal} repeats={args.repeats} threads={torch.get_num_threads()} torch {torch.__version__}"
    )
    megatron = (
        MegatronGroup()
        if any(_parse_impl(i)[0] == "stock" for i in args.impls)
        else contextlib.nullcontext()
    )
    load_before = loadavg()
    results: list[Result] = []
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # megatron's "Transformer Engine and Apex are not installed"
        with megatron:
            for s in args.seq_lengths:
                cases = [
                    Case(
                        impl,
                        args.batch_size,
                        s,
                        args.heads,
                        kv_heads,
                        args.head_dim,
                        dtype,
                        args.causal,
                    )
                    for impl in args.impls
                ]
                results += run_length(cases, args.repeats, args.max_memory_gb * GIB, log)
    load = f", load average {load_before} -> {loadavg()}" if load_before else ""
    title = (
        f"b={args.batch_size}, {args.heads} heads, {kv_heads} kv heads, d={args.head_dim}, {args.dtype}, "
        f"{'causal' if args.causal else 'non-causal'}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats}, torch {torch.__version__}{load}"
    )
    print(f"\n{title}\n")
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
