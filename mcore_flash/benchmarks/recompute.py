"""``mcore-flash bench-recompute``: saved bytes and fwd+bwd time of the recompute modes.

A Llama-shaped ``GPTModel`` with our spec (RMSNorm, SwiGLU, GQA, RoPE, no biases, no
dropout, fp32, causal with ``attention_mask=None``; by default Llama's proportions at small
scale: 2 layers, h 1024, 8 heads of 128, 2 query groups, ffn 2752 = 2.6875 h) is built once
per recompute mode (:func:`build_model`,
:func:`mcore_flash.transformer.recompute.recompute_mode_settings`: ``none``, ``qkv`` (our
module: keeps the kernel's output, re-runs norm -> QKV -> RoPE), ``attention`` = Megatron's
``selective`` + ``core_attn`` with our ``FlashTransformerLayer``, ``full`` =
``full``/``uniform``/1 layer), all from the same seed, so the models hold identical weights.
At each sequence length (:func:`run_length`): **bytes** saved per layer and outside the
layers (:meth:`Runner.measure_bytes`); an untimed **check step** (largest saved tensor,
attention backend calls, loss and gradients against ``none``: :meth:`Runner.check_step`);
**time**, medians of wall-clock and process CPU ms over interleaved steps, the ratio to
``none`` paired by round (:func:`paired_ratio`, :func:`ratio_spread`), next to the planner's
predicted extra FLOPs (:func:`predicted_extra`). Progress goes to stderr, markdown tables
(bytes in MiB, times in ms) to stdout; column definitions, results and verdicts:
docs/benchmarks.md, "Recompute (CPU)".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .common import MIB, MegatronGroup, choice_list, int_list, loadavg, progress_log, timed

MODES = ("none", "qkv", "attention", "full")


@dataclass
class Result:
    """What one recompute mode measured at sequence length ``s`` (bytes, milliseconds)."""

    mode: str
    s: int
    layer_bytes: float = 0.0  # mean bytes per layer (layer submodules + the block's own saves / L)
    per_submodule: dict[str, float] = field(default_factory=dict)  # bytes per layer
    outside_bytes: int = 0  # embedding, final norm, output layer, loss
    input_bytes: int = 0  # one layer input [s, b, h]
    max_saved_numel: int = (
        0  # largest saved activation (parameters excluded), forward and recompute
    )
    max_saved_shape: tuple = ()
    square_saved: int = (
        0  # saved tensors whose last two dims are both s (an [.., s, s] score matrix)
    )
    saves_in_backward: int = 0  # tensors saved by recomputation during backward
    fwd_calls: int = 0  # attention backend calls in the check step
    bwd_calls: int = 0
    fallback_calls: int = 0
    loss: float = 0.0
    max_grad_diff: Optional[float] = None  # vs mode none
    times_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpu_ms)


def paired_ratio(times: list[float], base: list[float]) -> float:
    """Median over rounds of ``times[i] / base[i]``: each step against the ``none`` step of
    the same round (seconds apart), which cancels slow drifts of the machine's load."""
    return statistics.median(t / b for t, b in zip(times, base))


def ratio_spread(times: list[float], base: list[float]) -> tuple[float, float]:
    """Lower and upper quartile of the per-round ratios (the noise around :func:`paired_ratio`)."""
    ratios = sorted(t / b for t, b in zip(times, base))
    if len(ratios) < 4:
        return ratios[0], ratios[-1]
    low, _, high = statistics.quantiles(ratios, n=4)
    return low, high


def bench_shape(args, max_s: int):
    """The benchmark's model as a planner ``ModelShape`` (one source for the model and its FLOPs)."""
    from mcore_flash.planning import ModelShape

    return ModelShape(
        "bench",
        args.num_layers,
        args.hidden_size,
        args.ffn_hidden_size,
        args.num_attention_heads,
        args.num_query_groups,
        args.vocab_size,
        max_position_embeddings=max_s,
    )


def predicted_extra(args, mode: str, s: int) -> float:
    """Extra FLOPs of ``mode`` over no recompute by the planner's FLOP model (fused attention)."""
    from mcore_flash.planning import recompute_overhead

    return recompute_overhead(bench_shape(args, s), s, mode)


# ---- the model ----------------------------------------------------------------------------


def build_model(args, mode: str, max_s: int) -> torch.nn.Module:
    """The Llama-shaped GPTModel with our spec and ``mode``'s recompute settings."""
    from megatron.core import tensor_parallel

    from mcore_flash.benchmarks.models import build_flash_gpt
    from mcore_flash.transformer.recompute import recompute_mode_settings

    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    settings = recompute_mode_settings(mode)
    model = build_flash_gpt(
        bench_shape(args, max_s),
        use_te_activation_func=args.fused_swiglu,
        layer_recompute_modules=settings.layer_modules,
        **settings.config,
    )
    model.train()
    return model


class CallCounter:
    """Counts calls of the attention backend's ``forward``/``backward`` (and its fallback's)."""

    def __init__(self) -> None:
        from mcore_flash.ops.backends import get_backend

        self.backend = get_backend(None, "cpu")
        self.counts: dict[str, int] = defaultdict(int)
        self._restore: list[tuple[object, str]] = []
        self._wrap(self.backend, "forward", "fwd")
        self._wrap(self.backend, "backward", "bwd")
        fallback = getattr(self.backend, "fallback", None)
        if fallback is not None:
            self._wrap(fallback, "forward", "fallback_fwd")
            self._wrap(fallback, "backward", "fallback_bwd")

    def _wrap(self, obj, name: str, key: str) -> None:
        original = getattr(obj, name)

        def counted(*args, **kwargs):
            self.counts[key] += 1
            return original(*args, **kwargs)

        setattr(obj, name, counted)  # instance attribute shadows the method
        self._restore.append((obj, name))

    def reset(self) -> None:
        self.counts.clear()

    def close(self) -> None:
        for obj, name in self._restore:
            delattr(obj, name)
        self._restore.clear()


class Runner:
    """One mode at one sequence length: the model, its inputs and results."""

    def __init__(self, model: torch.nn.Module, mode: str, tokens: torch.Tensor):
        self.model, self.mode, self.tokens = model, mode, tokens
        self.positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        self.result = Result(mode, tokens.shape[1])

    def forward(self) -> torch.Tensor:
        return self.model(self.tokens, self.positions, None, labels=self.tokens).mean()

    def zero_grads(self) -> None:
        for param in self.model.parameters():
            param.grad = None

    def measure_bytes(self, num_layers: int, hidden: int) -> None:
        """One forward's saved bytes into the result: per layer, per submodule, outside the layers.

        Measured under :func:`mcore_flash.measured_memory.measure_activation_bytes`. "Per
        layer" is everything saved under ``decoder.layers.<i>`` plus what the ``decoder``
        block itself saves (with full recompute Megatron's checkpoint is called by the block,
        so the layer inputs -- and the RoPE table, shared -- are charged to ``decoder``),
        divided by the number of layers. What lies outside the layers (embedding, final
        norm, output layer, loss) is reported separately.
        """
        from mcore_flash.measured_memory import measure_activation_bytes

        saved = measure_activation_bytes(
            self.model, self.tokens, self.positions, None, labels=self.tokens
        )
        block = saved.by_module.get("decoder", 0)
        per = dict(saved.per_layer())
        if block:
            per["(decoder block, / layers)"] = block / num_layers
        r = self.result
        r.per_submodule = per
        r.layer_bytes = sum(per.values())
        r.outside_bytes = saved.total - int(round(r.layer_bytes * num_layers))
        r.input_bytes = self.tokens.numel() * hidden * torch.get_default_dtype().itemsize

    def check_step(self, counter: CallCounter) -> dict[str, torch.Tensor]:
        """Untimed fwd+bwd (also the warm-up): largest saved tensor, backend calls; returns
        the gradients (:func:`run_length` compares them with mode ``none``'s, and the loss).

        The step runs under a saved-tensor hook that sees every tensor saved in forward *and*
        in the recomputations run during backward, and records the largest one (an ``s x s``
        probability matrix would show up here). The attention backend's ``forward``/``backward``
        are wrapped (:class:`CallCounter`) to count calls, and calls of its fallback, if it has
        one -- the CPU backend falls back to the blocked reference kernel for dropout, which
        this benchmark does not use.
        """
        r = self.result
        phase = ["forward"]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if isinstance(tensor, torch.nn.Parameter) or isinstance(
                tensor._base, torch.nn.Parameter
            ):
                return tensor
            if tensor.dim() >= 2 and tensor.shape[-1] == tensor.shape[-2] == r.s:
                r.square_saved += 1
            if tensor.numel() > r.max_saved_numel:
                r.max_saved_numel, r.max_saved_shape = tensor.numel(), tuple(tensor.shape)
            if phase[0] == "backward":
                r.saves_in_backward += 1
            return tensor

        counter.reset()
        self.zero_grads()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = self.forward()
            phase[0] = "backward"
            loss.backward()
        r.loss = loss.item()
        r.fwd_calls = counter.counts["fwd"]
        r.bwd_calls = counter.counts["bwd"]
        r.fallback_calls = counter.counts["fallback_fwd"] + counter.counts["fallback_bwd"]
        grads = {
            name: p.grad.detach().clone()
            for name, p in self.model.named_parameters()
            if p.grad is not None
        }
        self.zero_grads()
        return grads

    def timed_step(self) -> None:
        with timed(self.result.times_ms, self.result.cpu_ms):
            loss = self.forward()
            loss.backward()
        del loss
        self.zero_grads()


def run_length(
    models: dict[str, torch.nn.Module],
    s: int,
    args,
    counter: CallCounter,
    log: Callable[[str], None],
) -> list[Result]:
    """Every mode at sequence length ``s``: bytes and the check step (gradients against
    ``none``), then the interleaved timed steps; progress lines go to ``log``.

    Timing: after one more untimed step per mode, ``--repeats`` rounds of one fwd+bwd step
    per mode, interleaved (none, qkv, attention, full, then qkv, attention, full, none, ...)
    so that a change in machine load hits them alike. Medians of wall-clock and of process
    CPU time are reported; the time relative to ``none`` is the median over rounds of the
    ratio to the same round's ``none`` step (:func:`paired_ratio`), and the quartiles of the
    per-round ratios show the noise (:func:`ratio_spread`); next to them, the extra FLOPs the
    planner's model (:func:`mcore_flash.planning.recompute_overhead`) predicts for the same
    shape. One thread by default (``--threads``): on a shared machine the process CPU time is
    then close to what the step takes on an idle core, while wall-clock also counts the time
    the process waited for one.
    """
    gen = torch.Generator().manual_seed(s)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, s), generator=gen)
    runners = [Runner(models[mode], mode, tokens) for mode in args.modes]
    base_grads = None
    for runner in runners:
        runner.measure_bytes(args.num_layers, args.hidden_size)
        grads = runner.check_step(counter)
        r = runner.result
        note = ""
        if runner.mode == "none":
            base_grads = grads
        elif base_grads is not None:
            r.max_grad_diff = max((grads[n] - base_grads[n]).abs().max().item() for n in base_grads)
            note = f", max |grad - grad(none)| {r.max_grad_diff:.1e}"
        log(
            f"{runner.mode:>9} s={s:>6}: saved {r.layer_bytes / MIB:.2f} MiB/layer "
            f"(+{r.outside_bytes / MIB:.2f} MiB outside layers), largest saved tensor {r.max_saved_shape} "
            f"({r.max_saved_numel} el, b*hq*s*s={_probs_numel(r, args)}), [.., s, s] tensors saved {r.square_saved} "
            f"(tensors saved during backward {r.saves_in_backward}), attention fwd/bwd calls {r.fwd_calls}/{r.bwd_calls} "
            f"(fallback {r.fallback_calls}), loss {r.loss:.6f}{note}"
        )
    for runner in runners:  # one more untimed step each, so that no mode times a first run
        runner.timed_step()
        runner.result.times_ms.clear()
        runner.result.cpu_ms.clear()
    for rep in range(args.repeats):
        for i in range(len(runners)):  # interleaved, the starting mode rotating each round
            runners[(rep + i) % len(runners)].timed_step()
    for runner in runners:
        r = runner.result
        log(
            f"{r.mode:>9} s={s:>6}: {r.ms:9.1f} ms median (runs {', '.join(f'{t:.0f}' for t in r.times_ms)}; "
            f"process CPU {r.cpu:.0f} ms)"
        )
    return [runner.result for runner in runners]


# ---- tables -------------------------------------------------------------------------------


def _probs_numel(r: Result, args) -> int:
    """Elements of the attention probabilities ``[b, hq, s, s]`` the fused kernel never keeps."""
    return args.micro_batch_size * args.num_attention_heads * r.s * r.s


def format_summary(results: list[Result], args) -> str:
    """The main markdown table: one row per (mode, s); bytes in MiB, times in ms, ratios against ``none``."""
    num_layers = args.num_layers
    base = {r.s: r for r in results if r.mode == "none"}
    lines = [
        "| mode | s | saved MiB / layer | % of none | fwd+bwd ms, wall (median) | wall vs none "
        "| fwd+bwd ms, CPU (median) | CPU vs none (quartiles) | FLOP model | attention kernel fwd, bwd calls / layer (fallback) "
        "| [.., s, s] tensors saved | largest saved tensor / (b·hq·s²) | max abs grad diff vs none |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        b = base.get(r.s)
        pct = f"{100 * r.layer_bytes / b.layer_bytes:.1f}%" if b and b.layer_bytes else "n/a"
        wall = f"{paired_ratio(r.times_ms, b.times_ms):.3f}x" if b else "n/a"
        cpu = "n/a"
        if b:
            low, high = ratio_spread(r.cpu_ms, b.cpu_ms)
            cpu = f"{paired_ratio(r.cpu_ms, b.cpu_ms):.3f}x ({low:.2f}-{high:.2f})"
        flops = f"{1 + predicted_extra(args, r.mode, r.s):.3f}x"
        diff = "" if r.max_grad_diff is None else f"{r.max_grad_diff:.1e}"
        lines.append(
            f"| {r.mode} | {r.s} | {r.layer_bytes / MIB:.2f} | {pct} | {r.ms:.1f} | {wall} | {r.cpu:.1f} | {cpu} | {flops} "
            f"| {r.fwd_calls / num_layers:g}, {r.bwd_calls / num_layers:g} ({r.fallback_calls}) | {r.square_saved} "
            f"| {r.max_saved_numel / _probs_numel(r, args):.3f} | {diff} |"
        )
    return "\n".join(lines)


def format_submodules(results: list[Result]) -> str:
    """Markdown: saved MiB per layer by submodule and mode, at the longest sequence."""
    s = max(r.s for r in results)
    at_s = [r for r in results if r.s == s]
    names: list[str] = []
    for r in at_s:
        names += [n for n in r.per_submodule if n not in names]
    lines = [
        f"| submodule (MiB per layer, s={s}) | " + " | ".join(r.mode for r in at_s) + " |",
        "|---|" + "---:|" * len(at_s),
    ]
    for name in names:
        lines.append(
            f"| {name} | "
            + " | ".join(f"{r.per_submodule.get(name, 0.0) / MIB:.3f}" for r in at_s)
            + " |"
        )
    lines.append(
        "| **layer total** | " + " | ".join(f"**{r.layer_bytes / MIB:.3f}**" for r in at_s) + " |"
    )
    lines.append(
        "| (outside the layers, total) | "
        + " | ".join(f"{r.outside_bytes / MIB:.3f}" for r in at_s)
        + " |"
    )
    lines.append(
        "| (one layer input [s, b, h]) | "
        + " | ".join(f"{r.input_bytes / MIB:.3f}" for r in at_s)
        + " |"
    )
    return "\n".join(lines)


_ATTENTION_PARTS = ("input_layernorm", "self_attention")


def verdicts(results: list[Result], args) -> list[str]:
    """One line per target and sequence length."""
    num_layers = args.num_layers
    base = {r.s: r for r in results if r.mode == "none"}
    lines = []
    for r in results:
        b = base.get(r.s)
        if r.mode == "none" or b is None:
            continue
        cut = 1 - r.layer_bytes / b.layer_bytes
        extra = paired_ratio(r.times_ms, b.times_ms) - 1
        extra_cpu = paired_ratio(r.cpu_ms, b.cpu_ms) - 1
        low, high = (x - 1 for x in ratio_spread(r.cpu_ms, b.cpu_ms))
        model = f"FLOP model {100 * predicted_extra(args, r.mode, r.s):+.1f}%"
        spread = f"{100 * low:+.1f}..{100 * high:+.1f}%"
        common = (
            f"bwd calls {r.bwd_calls}/step = {r.bwd_calls / num_layers:g}/layer, fallback {r.fallback_calls}, "
            f"[.., s, s] tensors saved {r.square_saved}, largest saved tensor {r.max_saved_numel / _probs_numel(r, args):.3f} "
            f"x b·hq·s²"
        )
        if r.mode == "qkv":
            lines.append(
                f"qkv s={r.s}: keeps {r.layer_bytes / MIB:.3f} MiB/layer; saved bytes cut {100 * cut:.1f}%; kernel "
                f"forward calls {r.fwd_calls}/step = {r.fwd_calls / num_layers:g}/layer (never re-run); extra time "
                f"{100 * extra:+.1f}% wall, {100 * extra_cpu:+.1f}% CPU (quartiles {spread}; {model}); {common}"
            )
        elif r.mode == "attention":
            attn = sum(v for n, v in r.per_submodule.items() if n.startswith(_ATTENTION_PARTS))
            layer_own = r.per_submodule.get("<layer>", 0.0)
            lines.append(
                f"attention s={r.s}: attention sub-block keeps {attn / MIB:.3f} MiB + checkpoint input "
                f"{layer_own / MIB:.3f} MiB (= layer input {r.input_bytes / MIB:.3f}); saved bytes cut {100 * cut:.1f}% "
                f"(target >= 25%: {'met' if cut >= 0.25 else 'MISSED'}); extra time {100 * extra:+.1f}% wall, "
                f"{100 * extra_cpu:+.1f}% CPU (quartiles {spread}; {model}; target <= 15%: {'met' if extra_cpu <= 0.15 else 'MISSED'} by CPU time, {'met' if extra <= 0.15 else 'MISSED'} by wall); {common}"
            )
        elif r.mode == "full":
            lines.append(
                f"full s={r.s}: keeps {r.layer_bytes / MIB:.3f} MiB/layer (layer input {r.input_bytes / MIB:.3f}, "
                f"{'only inputs + shared RoPE table' if r.layer_bytes - r.input_bytes <= r.s * 512 else 'MORE than inputs'}); "
                f"saved bytes cut {100 * cut:.1f}%; extra time {100 * extra:+.1f}% wall, {100 * extra_cpu:+.1f}% CPU "
                f"(quartiles {spread}; {model}; target <= 35%: {'met' if extra_cpu <= 0.35 else 'MISSED'} by CPU time, {'met' if extra <= 0.35 else 'MISSED'} by wall); {common}"
            )
    return lines


# ---- command line -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-flash bench-recompute",
        description="Saved-for-backward bytes per layer and fwd+bwd time of recompute modes none/qkv/attention/full "
        "for a Llama-shaped GPTModel with the fused-attention spec.",
    )
    parser.add_argument(
        "--seq-lengths",
        type=int_list,
        default=[512, 1024, 2048],
        help="comma-separated sequence lengths (default: 512,1024,2048)",
    )
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument(
        "--ffn-hidden-size", type=int, default=2752, help="default 2752 = Llama's 2.6875 x hidden"
    )
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-query-groups", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument(
        "--repeats", type=int, default=9, help="timed steps per mode and length (median reported)"
    )
    parser.add_argument(
        "--modes",
        type=choice_list("--modes", MODES),
        default=list(MODES),
        help="comma-separated: none,qkv,attention,full",
    )
    parser.add_argument(
        "--fused-swiglu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our fused SwiGLU via config.use_te_activation_func (default: on, as the trainer)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared machine, threads waiting for a "
        "descheduled sibling spin and distort wall and CPU time alike)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: s=256,512, 2 layers, 1 repeat (overrides those options)",
    )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.seq_lengths, args.num_layers, args.repeats = [256, 512], 2, 1
    if (
        args.num_attention_heads % args.num_query_groups
        or args.hidden_size % args.num_attention_heads
    ):
        print(
            "bench-recompute: --num-attention-heads must divide --hidden-size and be a multiple of "
            "--num-query-groups",
            file=sys.stderr,
        )
        return 2
    if args.repeats < 1 or args.num_layers < 1:
        print("bench-recompute: --repeats and --num-layers must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)

    log = progress_log("bench-recompute")
    log(
        f"layers={args.num_layers} h={args.hidden_size} ffn={args.ffn_hidden_size} heads={args.num_attention_heads} "
        f"groups={args.num_query_groups} b={args.micro_batch_size} fused_swiglu={args.fused_swiglu} "
        f"repeats={args.repeats} threads={torch.get_num_threads()} torch {torch.__version__}"
    )
    load_before = loadavg()
    results: list[Result] = []
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # megatron's "Transformer Engine and Apex are not installed"
        with MegatronGroup():
            models = {mode: build_model(args, mode, max(args.seq_lengths)) for mode in args.modes}
            counter = CallCounter()
            try:
                for s in args.seq_lengths:
                    results += run_length(models, s, args, counter, log)
            finally:
                counter.close()
    load = f", load average {load_before} -> {loadavg()}" if load_before else ""
    log(f"done in {time.perf_counter() - started:.0f} s")
    title = (
        f"{args.num_layers} layers, h={args.hidden_size}, ffn={args.ffn_hidden_size}, {args.num_attention_heads} heads, "
        f"{args.num_query_groups} query groups, b={args.micro_batch_size}, fp32, "
        f"{'fused' if args.fused_swiglu else 'Megatron'} SwiGLU, {torch.get_num_threads()} threads, "
        f"median of {args.repeats}, torch {torch.__version__}{load}"
    )
    print(f"\n{title}\n")
    print(format_summary(results, args))
    if any(r.per_submodule for r in results):
        print()
        print(format_submodules(results))
    if "none" in args.modes:
        print()
        for line in verdicts(results, args):
            print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
