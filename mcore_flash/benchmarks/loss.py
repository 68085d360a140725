"""``mcore-flash bench-loss``: time and peak bytes of the sequence-tiled loss and MLP against
megatron's untiled paths, on the CPU.

**Loss** (``--parts loss``). At each vocabulary V (``--vocab-sizes``) and sequence s
(``--seq-lengths``): hidden states ``[s, 1, h]`` (N(0, 1)), an output weight ``[V, h]``
(N(0, 0.02²)) and uniform random labels, through two paths that must give the same loss:

* ``default``: megatron's, ``logits = F.linear(hidden, weight)`` then
  ``vocab_parallel_cross_entropy(logits, labels)`` (the whole ``[s, 1, V]`` fp32 logits);
* ``chunked``: :func:`mcore_flash.transformer.linear_cross_entropy.linear_cross_entropy`,
  ``--tile-tokens`` tokens per tile (backward recomputes each tile's logits).

The backward starts from the mean per-token loss. **MLP** (``--parts mlp``): at each s,
megatron's MLP as the project's spec builds it (:func:`mcore_flash.transformer.specs.
get_gpt_layer_flash_spec`: fc1 -> our fused SwiGLU -> fc2, no biases), untiled and as
:class:`~mcore_flash.transformer.tiled_mlp.TiledMLP` at each of ``--mlp-tiles`` (same weights),
on input N(0, 1) ``[s, 1, h]`` with an N(0, 1) output gradient.

Per path and size: a **check step** (also the warm-up), one fwd+bwd under :class:`LiveBytes`:
the **peak bytes** the step's ops hold at once, the largest single allocation, the output's mean
(the loss) and the largest difference of the output and every gradient from the first path's
(relative to that tensor's largest entry). Then ``--repeats`` **timed** rounds of one fwd+bwd per
path, interleaved (the first path rotating), without the tracker: medians of process CPU and
wall ms, and each path's CPU time against the first path's of the same round (median of the
per-round ratios). A path whose predicted peak (:func:`predicted_loss_bytes`,
:func:`predicted_mlp_bytes`) exceeds ``--max-memory-gb`` (default 60% of the memory available
at start) is not run and reported as not fitting (the rest is left to the process's inputs
and reference gradients, and to whoever else uses the machine). Progress goes to stderr;
markdown tables and verdicts (or, with ``--json``, one JSON object) to stdout. Results:
docs/benchmarks.md, "Sequence-tiled loss and MLP (bench-loss)".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .common import (
    DTYPES,
    GIB,
    MIB,
    MegatronGroup,
    choice_list,
    int_list,
    loadavg,
    progress_log,
    timed,
)
from .recompute import paired_ratio

PARTS = ("loss", "mlp")
TARGET = {"vocab": 128256, "s": 16384, "time_ratio": 1.15, "peak_ratio": 10.0}  # the issue's


class LiveBytes(TorchDispatchMode):
    """Inside ``with LiveBytes() as live:``, ``live.current`` is the bytes of the tensor storages
    that ops run in the block allocated and that are still alive, ``live.peak`` its maximum and
    ``live.largest`` the largest such storage.

    A storage counts from the op that created it until it is freed; an op output that shares an
    input's storage (a view, an in-place or ``out=`` op) is no new allocation. Counted: every
    intermediate, output and gradient, and the backward of a ``backward()`` called in the block
    (on the CPU autograd runs it on the calling thread, under the mode), recomputation included.
    Not counted: tensors that existed before the block (inputs, parameters), memory a kernel
    allocates and frees within one op (GEMM packing buffers, reduction scratch) and the
    process's other memory (the CPU allocator keeps no cache).
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = self.largest = 0
        self._alive: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor.untyped_storage(), inputs)
        return out

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if nbytes == 0 or key in self._alive or storage.data_ptr() in inputs:
            return
        self._alive[key] = (weakref.ref(storage, lambda _: self._free(key)), nbytes)
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self.largest = max(self.largest, nbytes)

    def _free(self, key: int) -> None:
        self.current -= self._alive.pop(key)[1]


# ---- predicted bytes (which cases fit) ----------------------------------------------------


def predicted_loss_bytes(
    path: str, s: int, vocab: int, hidden: int, tile: int, itemsize: int
) -> int:
    """Bytes one fwd+bwd of the loss ``path`` holds at its peak, from the code's buffers (fp32:
    exact but for the per-token vectors). ``default``: the ``[s, V]`` logits (below fp32 also
    their fp32 working copy), the weight's ``[V, h]`` and the hidden states' ``[s, h]`` gradients.
    ``chunked``: one tile's logits (below fp32 also the low-precision GEMM output and gradient),
    the fp32 ``[V, h]`` weight-gradient accumulator (it is the gradient in fp32, cast below),
    one tile's ``[V, h]`` product added into it, the hidden gradient and the per-token loss,
    maximum and sum of exponentials."""
    low = itemsize if itemsize < 4 else 0  # bytes of a low-precision copy beside an fp32 one
    if path == "default":
        return s * vocab * (4 + low) + vocab * hidden * itemsize + s * hidden * itemsize
    weight_grads = vocab * hidden * (4 + itemsize + low)
    return tile * vocab * (4 + 2 * low) + weight_grads + s * hidden * itemsize + 16 * s


def predicted_mlp_bytes(s: int, hidden: int, ffn: int, tile: Optional[int], itemsize: int) -> int:
    """An upper estimate of the bytes one fwd+bwd of the MLP holds at its peak: per row it runs
    at once (``s``, or one ``tile``) 8 ``ffn``-wide vectors (fc1's ``[2 ffn]`` output, the
    activation, their gradients, the fused SwiGLU's backward temporaries); the input gradient,
    the output and its tiles' copy ``[s, h]``; the weight gradients (twice when tiles
    accumulate them)."""
    rows = s if tile is None else min(tile, s)
    weights = 3 * ffn * hidden * itemsize * (1 if tile is None else 2)
    return rows * 8 * ffn * itemsize + 3 * s * hidden * itemsize + weights


# ---- one path at one size -----------------------------------------------------------------


@dataclass
class Path:
    """One implementation at one size: how to run it (``run``: one fwd+bwd returning the output,
    its gradients land in ``leaves``; both dropped once measured) and what it measured."""

    name: str
    predicted_bytes: int
    run: Optional[Callable[[], torch.Tensor]] = None
    leaves: list[torch.Tensor] = field(default_factory=list)
    skipped: str = ""  # why it was not run ("" = it ran)
    peak_bytes: Optional[int] = None  # LiveBytes.peak of the check step
    largest_bytes: Optional[int] = None  # LiveBytes.largest of the check step
    mean_output: Optional[float] = None  # the loss (mean per-token loss); the MLP output's mean
    rel_diff: Optional[float] = None  # output and gradients vs the first path, max relative
    check_s: float = 0.0  # seconds of the check step (tracker included)
    cpu_ms: list[float] = field(default_factory=list)
    wall_ms: list[float] = field(default_factory=list)

    def drop(self) -> None:
        """Release the tensors the closures hold (the measurements stay)."""
        self.run, self.leaves = None, []

    def summary(self, base: "Path") -> dict:
        """JSON fields: the measurements, medians and the ratios against ``base``."""
        both = not self.skipped and not base.skipped
        return {
            "name": self.name,
            "skipped": self.skipped,
            "predicted_bytes": self.predicted_bytes,
            "peak_bytes": self.peak_bytes,
            "largest_bytes": self.largest_bytes,
            "mean_output": self.mean_output,
            "rel_diff": self.rel_diff,
            "cpu_ms": statistics.median(self.cpu_ms) if self.cpu_ms else None,
            "wall_ms": statistics.median(self.wall_ms) if self.wall_ms else None,
            "cpu_runs_ms": self.cpu_ms,
            "wall_runs_ms": self.wall_ms,
            "cpu_ratio": paired_ratio(self.cpu_ms, base.cpu_ms) if both and self.cpu_ms else None,
            "peak_ratio": base.peak_bytes / self.peak_bytes if both else None,
        }


@dataclass
class Case:
    """Every path of one part at one size; ``paths[0]`` is the reference (megatron's path)."""

    part: str
    s: int
    vocab: Optional[int]
    paths: list[Path]

    def label(self) -> str:
        """``"loss s=4096 V=32000"``, ``"mlp s=4096"``: the progress lines' prefix."""
        return f"{self.part} s={self.s}" + (f" V={self.vocab}" if self.vocab else "")

    def summary(self) -> dict:
        """JSON fields: the size and each path's :meth:`Path.summary` against ``paths[0]``."""
        return {
            "part": self.part,
            "s": self.s,
            "vocab": self.vocab,
            "paths": [p.summary(self.paths[0]) for p in self.paths],
        }


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |x - ref| / max |ref|`` in float64."""
    ref = ref.double()
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def _clear_grads(path: Path) -> None:
    """Drop the gradients of the path's leaves (each step starts without any)."""
    for leaf in path.leaves:
        leaf.grad = None


def _check(path: Path, reference: Optional[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The check step of ``path`` into its fields (peak bytes, mean output, difference from
    ``reference``: the first path's output and gradients); returns its own output and gradients."""
    _clear_grads(path)
    start = time.perf_counter()
    with LiveBytes() as live:
        output = path.run()
    path.check_s = time.perf_counter() - start
    path.peak_bytes, path.largest_bytes = live.peak, live.largest
    path.mean_output = output.double().mean().item()
    tensors = [output] + [leaf.grad for leaf in path.leaves]
    _clear_grads(path)
    if reference is not None:
        path.rel_diff = max(_rel(x, ref) for x, ref in zip(tensors, reference))
    return tensors


def _timed_step(path: Path) -> None:
    """One fwd+bwd of ``path``, its wall and process CPU ms appended to the path's lists."""
    with timed(path.wall_ms, path.cpu_ms):
        output = path.run()
    del output
    _clear_grads(path)


def _size(nbytes: float) -> str:
    """``"16.1 GiB"``, or ``"8.8 MiB"`` below a GiB."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def _out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the CPU allocator refusing memory (not some other failure)."""
    return isinstance(error, MemoryError) or "memory" in str(error).lower()


def run_case(case: Case, repeats: int, budget: float, log: Callable[[str], None]) -> None:
    """Check steps (the first path's output and gradients the reference), then ``repeats``
    interleaved timed rounds of the paths that fit in ``budget`` bytes and ran; every path's
    tensors are dropped at the end."""
    reference = None
    for path in case.paths:
        if path.predicted_bytes > budget:
            path.skipped = (
                f"does not fit: needs ~{_size(path.predicted_bytes)} > {_size(budget)} "
                "(--max-memory-gb)"
            )
        else:
            try:
                tensors = _check(path, reference)
            except (RuntimeError, MemoryError) as error:
                if not _out_of_memory(error):
                    raise
                path.skipped = f"out of memory ({str(error).splitlines()[0][:80]})"
        if path.skipped:
            log(f"{case.label()} {path.name}: {path.skipped}")
            path.drop()
            continue
        if path is case.paths[0]:
            reference = tensors
        diff = "" if path.rel_diff is None else f", rel. diff {path.rel_diff:.1e}"
        log(
            f"{case.label()} {path.name}: peak {path.peak_bytes / MIB:.1f} MiB (predicted "
            f"{path.predicted_bytes / MIB:.1f}), largest {path.largest_bytes / MIB:.1f} MiB, "
            f"mean {path.mean_output:.7f}{diff}; check step {path.check_s:.1f} s"
        )
        del tensors
    del reference
    ran = [p for p in case.paths if not p.skipped]
    for rep in range(repeats):
        for i in range(len(ran)):
            path = ran[(rep + i) % len(ran)]
            _timed_step(path)
            cpu = path.cpu_ms[-1]
            log(f"{case.label()} {path.name}: round {rep + 1}/{repeats} {cpu:.0f} ms CPU")
    for path in case.paths:
        path.drop()


# ---- the two parts ------------------------------------------------------------------------


def loss_case(vocab: int, s: int, args) -> Case:
    """The loss at vocabulary ``vocab`` and sequence ``s``: megatron's path, then the tiled one,
    sharing the same leaf tensors (built here, seeded by ``s`` and ``vocab``)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from mcore_flash.transformer.linear_cross_entropy import linear_cross_entropy

    dtype, h, tile = DTYPES[args.dtype], args.hidden_size, args.tile_tokens
    itemsize = dtype.itemsize
    paths = [
        Path(name, predicted_loss_bytes(name, s, vocab, h, tile, itemsize))
        for name in ("default", "chunked")
    ]
    if all(p.predicted_bytes > args.max_bytes for p in paths):
        return Case("loss", s, vocab, paths)
    gen = torch.Generator().manual_seed(s * 7919 + vocab)
    hidden = torch.randn(s, 1, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=gen) * 0.02).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (s, 1), generator=gen)
    group = parallel_state.get_tensor_model_parallel_group()
    losses = {
        "default": lambda: vocab_parallel_cross_entropy(
            torch.nn.functional.linear(hidden, weight), labels
        ),
        "chunked": lambda: linear_cross_entropy(hidden, weight, labels, tile, group, False),
    }
    for path in paths:
        path.run, path.leaves = _mean_backward(losses[path.name]), [hidden, weight]
    return Case("loss", s, vocab, paths)


def _mean_backward(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A ``run`` for :class:`Path`: the per-token loss, backward from its mean; returns it."""

    def run() -> torch.Tensor:
        loss = loss_fn()
        loss.mean().backward()
        return loss.detach()

    return run


def _build_mlp(args, tile: Optional[int]) -> torch.nn.Module:
    """The MLP of a transformer layer built from the project's spec (``mlp_chunk_size=tile``)."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_flash.transformer.specs import get_gpt_layer_flash_spec

    h = args.hidden_size
    config = TransformerConfig(
        num_layers=1,
        hidden_size=h,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=max(1, h // 128),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        use_te_activation_func=True,  # our fused SwiGLU, as the trainer builds it
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=DTYPES[args.dtype],
    )
    layer = build_module(
        get_gpt_layer_flash_spec(mlp_chunk_size=tile), config=config, layer_number=1
    )
    return layer.mlp


def mlp_case(s: int, args) -> Case:
    """The MLP at sequence ``s``: untiled, then tiled at each ``--mlp-tiles`` (same weights)."""
    dtype, itemsize = DTYPES[args.dtype], DTYPES[args.dtype].itemsize
    h, ffn = args.hidden_size, args.ffn_hidden_size
    tiles = [None] + args.mlp_tiles
    paths = [
        Path("untiled" if t is None else f"tiled {t}", predicted_mlp_bytes(s, h, ffn, t, itemsize))
        for t in tiles
    ]
    gen = torch.Generator().manual_seed(s)
    x = torch.randn(s, 1, h, generator=gen).to(dtype).requires_grad_()
    grad_out = torch.randn(s, 1, h, generator=gen).to(dtype)
    torch.manual_seed(1234)
    untiled = _build_mlp(args, None)
    for path, tile in zip(paths, tiles):
        mlp = untiled if tile is None else _build_mlp(args, tile)
        mlp.load_state_dict(untiled.state_dict())
        path.run, path.leaves = _output_backward(mlp, x, grad_out), [x, *mlp.parameters()]
    return Case("mlp", s, None, paths)


def _output_backward(mlp, x: torch.Tensor, grad_out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A ``run`` for :class:`Path`: ``mlp(x)``, backward from ``grad_out``; returns the output."""

    def run() -> torch.Tensor:
        out, _ = mlp(x)
        out.backward(grad_out)
        return out.detach()

    return run


# ---- tables -------------------------------------------------------------------------------


def _cell(value: Optional[float], fmt: str) -> str:
    """A table cell: ``value`` formatted, or a dash for a missing one."""
    return "—" if value is None else format(value, fmt)


def _cells(row: dict) -> tuple[str, str, str]:
    """CPU ms, peak MiB and largest-allocation MiB cells of a :meth:`Path.summary`; a path
    that did not run says why in the first and gets dashes."""
    if row["skipped"]:
        return row["skipped"], "—", "—"
    mib = (row["peak_bytes"] / MIB, row["largest_bytes"] / MIB)
    return _cell(row["cpu_ms"], ".0f"), f"{mib[0]:.1f}", f"{mib[1]:.1f}"


def loss_table(cases: list[Case]) -> list[str]:
    """Markdown: one row per (V, s), the default path against the chunked one."""
    lines = [
        "| V | s | default CPU ms | chunked CPU ms | chunked / default CPU | default peak MiB "
        "| chunked peak MiB | default / chunked peak | largest allocation MiB, default / chunked "
        "| loss rel. diff | max rel. diff, loss + grads |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        base, chunk = (p.summary(case.paths[0]) for p in case.paths)
        (base_cpu, base_peak, base_big), (cpu, peak, big) = _cells(base), _cells(chunk)
        loss_diff = None
        if not base["skipped"] and not chunk["skipped"]:
            loss_diff = abs(chunk["mean_output"] - base["mean_output"]) / abs(base["mean_output"])
        lines.append(
            f"| {case.vocab} | {case.s} | {base_cpu} | {cpu} | {_cell(chunk['cpu_ratio'], '.3f')} "
            f"| {base_peak} | {peak} | {_cell(chunk['peak_ratio'], '.1f')} | {base_big} / {big} "
            f"| {_cell(loss_diff, '.1e')} | {_cell(chunk['rel_diff'], '.1e')} |"
        )
    return lines


def mlp_table(cases: list[Case]) -> list[str]:
    """Markdown: one row per (s, MLP), each against the untiled MLP at that s."""
    lines = [
        "| s | MLP | CPU ms | vs untiled CPU | peak MiB | untiled / this peak "
        "| max rel. diff, output + grads |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        for path in case.paths:
            row = path.summary(case.paths[0])
            cpu, peak, _ = _cells(row)
            lines.append(
                f"| {case.s} | {path.name} | {cpu} | {_cell(row['cpu_ratio'], '.3f')} | {peak} "
                f"| {_cell(row['peak_ratio'], '.2f')} | {_cell(row['rel_diff'], '.1e')} |"
            )
    return lines


def verdicts(cases: list[Case]) -> list[str]:
    """One line per loss size where both paths ran, against the issue's targets (chunked CPU
    time <= 1.15x the default's, peak bytes >= 10x lower); the target size is marked."""
    lines = []
    for case in cases:
        base, chunk = case.paths
        if base.skipped or chunk.skipped or not chunk.cpu_ms:
            continue
        row = chunk.summary(base)
        time_ok = row["cpu_ratio"] <= TARGET["time_ratio"]
        peak_ok = row["peak_ratio"] >= TARGET["peak_ratio"]
        target = (case.vocab, case.s) == (TARGET["vocab"], TARGET["s"])
        lines.append(
            f"V={case.vocab} s={case.s}{' (the target size)' if target else ''}: chunked CPU "
            f"time {row['cpu_ratio']:.3f}x the default's (target <= {TARGET['time_ratio']}x: "
            f"{'met' if time_ok else 'NOT met'}), peak bytes {row['peak_ratio']:.1f}x lower "
            f"(target >= {TARGET['peak_ratio']:g}x: {'met' if peak_ok else 'NOT met'}; largest "
            f"allocation {base.largest_bytes / chunk.largest_bytes:.1f}x smaller)"
        )
    return lines


# ---- command line -------------------------------------------------------------------------


def _available_bytes() -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where there is no such file."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def positive_int(text: str) -> int:
    """argparse type: one integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command's flags (checked further by :func:`parse_args`)."""
    parser = argparse.ArgumentParser(
        prog="mcore-flash bench-loss",
        description="CPU time and peak bytes of megatron's loss and MLP against the sequence-tiled "
        "loss (linear_cross_entropy) and TiledMLP.",
    )
    add = parser.add_argument
    add("--parts", type=choice_list("--parts", PARTS), default=list(PARTS), help="loss,mlp (both)")
    add("--vocab-sizes", type=int_list, default=[32000, 128256, 152064], help="32000,128256,152064")
    add("--seq-lengths", type=int_list, default=[4096, 8192, 16384, 32768], help="4K..32K")
    add("--hidden-size", type=positive_int, default=1024, help="h (1024)")
    add("--ffn-hidden-size", type=positive_int, default=2752, help="MLP (2752 = 2.6875 h)")
    add("--tile-tokens", type=positive_int, default=1024, help="loss tile (MindSpeed-LLM's 1024)")
    add(
        "--mlp-tiles", type=int_list, default=[1024, 2048, 4096], help="TiledMLP's (1024,2048,4096)"
    )
    add(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="weights and hidden states (fp32)"
    )
    add("--repeats", type=positive_int, default=3, help="timed rounds after the check step (3)")
    add("--threads", type=positive_int, default=1, help="torch.set_num_threads (1)")
    add("--max-memory-gb", type=float, default=None, help="budget (60%% of MemAvailable)")
    add("--quick", action="store_true", help="tiny grid for the tests (overrides the sizes)")
    add("--json", action="store_true", help="print one JSON object instead of the tables")
    return parser


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    """Parsed and checked arguments (``max_bytes``: the memory budget in bytes); ``ValueError``
    naming the flag for sizes that cannot run."""
    args = build_parser().parse_args(argv)
    if args.quick:
        args.vocab_sizes, args.seq_lengths, args.mlp_tiles = [512, 2048], [512, 1024], [128, 256]
        args.hidden_size, args.ffn_hidden_size, args.tile_tokens, args.repeats = 64, 96, 128, 1
    shortest = min(args.seq_lengths)
    if args.tile_tokens > shortest:
        raise ValueError(
            f"--tile-tokens {args.tile_tokens} exceeds the shortest --seq-lengths {shortest} "
            "(one tile would be the whole sequence)"
        )
    if max(args.mlp_tiles) > shortest:
        raise ValueError(
            f"--mlp-tiles {max(args.mlp_tiles)} exceeds the shortest --seq-lengths {shortest}"
        )
    if min(args.vocab_sizes) < 2:
        raise ValueError("--vocab-sizes must be >= 2")
    if args.max_memory_gb is not None and args.max_memory_gb <= 0:
        raise ValueError(f"--max-memory-gb must be positive, got {args.max_memory_gb}")
    available = _available_bytes()
    if args.max_memory_gb is None:
        args.max_bytes = 0.6 * available if available else 8 * GIB
    else:
        args.max_bytes = args.max_memory_gb * GIB
    return args


def _title(args, seconds: float, load: str) -> str:
    """One line: the machine, the settings, the load and how long the run took."""
    return (
        f"{_cpu_model()}, {os.cpu_count()} cores, {args.threads} torch thread(s), "
        f"torch {torch.__version__}; "
        f"{args.dtype}, b=1, h={args.hidden_size}, loss tile {args.tile_tokens}, "
        f"MLP ffn {args.ffn_hidden_size}; median of {args.repeats} after a check step; memory "
        f"budget {args.max_bytes / GIB:.1f} GiB; load average {load}; {seconds:.0f} s"
    )


def _cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` ("CPU" where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def _cases_at(s: int, args) -> Iterator[Case]:
    """The cases at sequence ``s``, built one at a time (one case's tensors exist at once)."""
    if "loss" in args.parts:
        for vocab in args.vocab_sizes:
            yield loss_case(vocab, s, args)
    if "mlp" in args.parts:
        yield mlp_case(s, args)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as error:
        print(f"mcore-flash bench-loss: error: {error}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    log = progress_log("bench-loss")
    load_before, started = loadavg(), time.perf_counter()
    cases: dict[str, list[Case]] = {part: [] for part in PARTS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron: "Transformer Engine and Apex are not installed"
        with MegatronGroup():
            for s in args.seq_lengths:
                for case in _cases_at(s, args):
                    run_case(case, args.repeats, args.max_bytes, log)
                    cases[case.part].append(case)
                    table = loss_table if case.part == "loss" else mlp_table
                    for row in table([case])[2:]:  # kept in the log should the run not finish
                        log(f"row {row}")
    cases["loss"].sort(key=lambda case: (case.vocab, case.s))
    load = f"{load_before} -> {loadavg()}"
    title = _title(args, time.perf_counter() - started, load)
    log(f"done: {title}")
    if args.json:
        summary = {part: [c.summary() for c in found] for part, found in cases.items()}
        print(json.dumps({"settings": title, **summary, "verdicts": verdicts(cases["loss"])}))
        return 0
    print(f"\n{title}\n")
    if cases["loss"]:
        print("\n".join(loss_table(cases["loss"])))
        print()
        print("\n".join(f"- {line}" for line in verdicts(cases["loss"])))
    if cases["mlp"]:
        print()
        print("\n".join(mlp_table(cases["mlp"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
