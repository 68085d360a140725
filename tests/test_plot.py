"""`mcore-flash plot`: a real PNG whose pixels show the curves; clear errors for bad input.

Oracle: the image read back by matplotlib's PNG reader - its size, that it is not blank, that
each run's line colour is drawn, and that a falling loss is drawn falling.
"""

from __future__ import annotations

import json

import numpy as np

from mcore_flash.plot import main

C0, C1 = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's first two line colours


def _write_run(directory, losses):
    directory.mkdir()
    path = directory / "metrics.jsonl"
    with open(path, "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"iteration": i, "loss": loss, "lr": 1e-3}) + "\n")
    return str(path)


def _pixels_of(image, colour):
    """(rows, cols) of pixels within 8/255 of ``colour``."""
    rgb = (image[..., :3] * 255).round()
    return np.nonzero(np.abs(rgb - np.array(colour)).max(axis=-1) <= 8)


def test_plot_draws_each_run_as_a_real_png(tmp_path, capsys):
    import matplotlib.image

    falling = _write_run(tmp_path / "falling", [5.0 - 0.05 * i for i in range(60)])
    flat = _write_run(tmp_path / "flat", [4.0] * 60)
    out = tmp_path / "loss.png"
    assert main([falling, flat, "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(str(out))
    assert image.shape[:2] == (400, 640)  # 6.4 x 4.0 inches at 100 dpi
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 50  # not blank
    rows, cols = _pixels_of(image, C0)
    assert len(rows) > 200
    left, right = cols < np.percentile(cols, 20), cols > np.percentile(cols, 80)
    assert (
        rows[left].mean() < rows[right].mean()
    )  # the falling loss: high on the left, low on the right
    flat_rows, _ = _pixels_of(image, C1)
    # the flat run: one horizontal line (most of its pixels; the rest is its legend sample)
    assert len(flat_rows) > 200 and np.mean(np.abs(flat_rows - np.median(flat_rows)) <= 3) > 0.8


def test_plot_errors_name_the_problem(tmp_path, capsys):
    run = _write_run(tmp_path / "run", [3.0, 2.0])
    assert main([str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x.png")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main([run, "--metric", "perplexity", "-o", str(tmp_path / "x.png")]) == 2
    assert "no metric 'perplexity'; choose --metric from ['loss', 'lr']" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert main([str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "x.png")]) == 2
    assert "no records yet" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
