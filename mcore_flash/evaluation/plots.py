"""PNG pictures of the evaluation results (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from mcore_flash.evaluation.loss_by_position import PositionBucket
from mcore_flash.evaluation.needle import NeedleCell
from mcore_flash.plot import pyplot

__all__ = ["needle_heatmap", "loss_by_position_plot"]


def needle_heatmap(cells: list[NeedleCell], output: str, title: str = "") -> None:
    """Exact-retrieval accuracy, context length (rows) x needle depth (columns), annotated."""
    plt = pyplot()
    lengths = sorted({c.length for c in cells})
    depths = sorted({c.depth for c in cells})
    grid = [
        [next(c.exact for c in cells if c.length == n and c.depth == d) for d in depths]
        for n in lengths
    ]
    figure, axes = plt.subplots(
        figsize=(1.2 * len(depths) + 2.4, 0.6 * len(lengths) + 1.8), dpi=100
    )
    image = axes.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for row, values in enumerate(grid):
        for column, value in enumerate(values):
            axes.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=9)
    axes.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    axes.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    axes.set_xlabel("needle depth (0 = start of the context)")
    axes.set_ylabel("context length (tokens)")
    axes.set_title(title or f"needle retrieval, exact ({cells[0].samples} samples per cell)")
    figure.colorbar(image, ax=axes, label="accuracy")
    figure.tight_layout()
    figure.savefig(output, format="png")
    plt.close(figure)


def loss_by_position_plot(buckets: list[PositionBucket], output: str, title: str = "") -> None:
    """Mean loss per position bucket against the bucket's last position (log x)."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    axes.plot([b.end for b in buckets], [b.loss for b in buckets], marker="o")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("token position (bucket end)")
    axes.set_ylabel("mean loss (nats/token)")
    axes.set_title(title or "loss by position")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(output, format="png")
    plt.close(figure)
