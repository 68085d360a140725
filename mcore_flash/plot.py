"""``mcore-flash plot``: training curves from ``metrics.jsonl`` into a PNG (no TensorBoard needed).

    mcore-flash plot runs/tiny/metrics.jsonl -o loss.png
    mcore-flash plot runs/a/metrics.jsonl runs/b/metrics.jsonl --metric loss --log-x -o both.png

One line per file (labelled by its run directory), ``--metric`` (a ``metrics.jsonl`` key:
``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ...) against the iteration. Needs
matplotlib (the ``plot`` extra); drawn with its non-interactive Agg backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["read_metric", "plot_runs", "pyplot", "main"]


def read_metric(path: str, metric: str) -> tuple[list[int], list[float]]:
    """``(iterations, values)`` of ``metric`` in one ``metrics.jsonl`` (records without it skipped).

    Raises ValueError naming the file for a missing/empty file, a bad line or an unknown metric.
    """
    if not os.path.isfile(path):
        raise ValueError(
            f"{path}: no such file; pass the metrics.jsonl a `mcore-flash pretrain --save DIR` wrote"
        )
    iterations, values, keys = [], [], set()
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON object ({error})") from error
            keys.update(record)
            if record.get(metric) is not None:
                iterations.append(int(record["iteration"]))
                values.append(float(record[metric]))
    if not keys:
        raise ValueError(f"{path}: no records yet (is the run logging? see --log-interval)")
    if metric not in keys:
        raise ValueError(
            f"{path} has no metric {metric!r}; choose --metric from {sorted(keys - {'iteration'})}"
        )
    return iterations, values


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend; ValueError when matplotlib
    is missing (it is the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ValueError("plots need matplotlib: pip install 'mcore-flash[plot]'") from error
    return plt


def plot_runs(paths: list[str], metric: str, output: str, log_x: bool = False) -> None:
    """Draw ``metric`` against the iteration for every file in ``paths`` into the PNG ``output``."""
    plt = pyplot()
    curves = [(path, *read_metric(path, metric)) for path in paths]
    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for path, iterations, values in curves:
        axes.plot(
            iterations, values, label=os.path.basename(os.path.dirname(os.path.abspath(path)))
        )
    axes.set_xlabel("iteration")
    axes.set_ylabel(metric)
    if log_x:
        axes.set_xscale("log")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(output, format="png")
    plt.close(figure)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcore-flash plot", description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", nargs="+", help="metrics.jsonl files (one line each)")
    p.add_argument("-o", "--output", required=True, help="PNG file to write")
    p.add_argument("--metric", default="loss", help="metrics.jsonl key to plot (default loss)")
    p.add_argument("--log-x", action="store_true", help="logarithmic iteration axis")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plot_runs(args.metrics, args.metric, args.output, args.log_x)
    except ValueError as error:
        print(f"mcore-flash plot: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0
