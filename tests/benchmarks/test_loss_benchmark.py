"""``mcore-flash bench-loss`` on its ``--quick`` grid reports what it measures consistently.

Timings are not asserted (docs/benchmarks.md has them); the byte counts of the allocation
tracker are checked against the buffers the two loss paths allocate (fp32, ``--quick``: h 64,
tile 128, V 512 / 2048, s 512 / 1024): megatron's path holds the whole ``[s, V]`` logits at
once, the chunked one a tile's, so its largest allocation is exactly ``s / tile`` times smaller
and its peak lower by at least the logits the tile never holds, less what it adds (its
weight-gradient product ``[V, h]`` and per-token and per-tile vectors). Losses and gradients of
the two paths, and of the untiled and tiled MLP, agree to 1e-6 relative. The benchmark runs in
a subprocess (it sets up its own process group).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mcore_flash.benchmarks import loss
from mcore_flash.benchmarks.common import MIB

H, TILE, MLP_TILES = 64, 128, (128, 256)  # --quick's sizes
FP32_REL = 1e-6


def _bench(*argv: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "mcore_flash.cli", "bench-loss", "--quick", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[bench-loss]" in result.stderr, "progress goes to stderr"
    return result.stdout


def _check_loss_case(case: dict) -> None:
    s, vocab = case["s"], case["vocab"]
    default, chunked = case["paths"]
    assert (default["name"], chunked["name"]) == ("default", "chunked")
    assert default["skipped"] == chunked["skipped"] == ""
    assert abs(chunked["mean_output"] - default["mean_output"]) <= FP32_REL * default["mean_output"]
    assert chunked["rel_diff"] <= FP32_REL  # the per-token loss and both gradients
    # the logits: all [s, V] fp32 at once, or one tile's (larger than the [V, h] gradient here)
    assert default["largest_bytes"] == 4 * s * vocab
    assert chunked["largest_bytes"] == 4 * TILE * vocab
    # megatron's peak: logits + weight and hidden gradients; the chunked path's saving: the
    # logits the tile never holds, less its [V, h] product and its per-token / per-tile vectors
    assert default["peak_bytes"] >= 4 * s * vocab + 4 * vocab * H + 4 * s * H
    saving = default["peak_bytes"] - chunked["peak_bytes"]
    assert saving >= 4 * vocab * (s - TILE) - 4 * vocab * H - 16 * s - 512 * TILE
    assert chunked["peak_ratio"] == default["peak_bytes"] / chunked["peak_bytes"]
    assert chunked["cpu_ratio"] == chunked["cpu_runs_ms"][0] / default["cpu_runs_ms"][0]


def test_bench_loss_quick_grid_reports_consistent_bytes_and_equal_losses():
    """The whole ``--quick`` grid in one run, under a 5 MiB budget: megatron's path at V 2048,
    s 1024 (8.75 MiB predicted) is reported as not fitting and the chunked path still runs
    there; every other size runs both paths."""
    result = json.loads(_bench("--json", "--max-memory-gb", str(5 / 1024)).strip().splitlines()[-1])
    sizes = [(c["vocab"], c["s"]) for c in result["loss"]]
    assert sizes == [(512, 512), (512, 1024), (2048, 512), (2048, 1024)]
    for case in result["loss"][:3]:
        _check_loss_case(case)
    default, chunked = result["loss"][3]["paths"]
    assert default["skipped"] == "does not fit: needs ~8.8 MiB > 5.0 MiB (--max-memory-gb)"
    assert default["peak_bytes"] is None and chunked["peak_ratio"] is None
    assert chunked["skipped"] == "" and chunked["largest_bytes"] == 4 * TILE * 2048
    assert len(result["verdicts"]) == 3  # sizes where both paths ran
    assert [c["s"] for c in result["mlp"]] == [512, 1024]
    for case in result["mlp"]:
        untiled, *tiled = case["paths"]
        assert [p["name"] for p in tiled] == [f"tiled {t}" for t in MLP_TILES]
        assert all(p["rel_diff"] <= FP32_REL for p in tiled)  # output and every gradient
        peaks = [p["peak_bytes"] for p in tiled]  # smaller tiles hold fewer rows' intermediates
        assert peaks == sorted(peaks) and peaks[-1] < untiled["peak_bytes"]


def test_loss_table_shows_what_did_not_run():
    """The markdown row of a size whose default path did not fit: the reason in its time cell,
    dashes for what needs both paths, the chunked path's numbers."""
    default = loss.Path("default", 0, skipped="does not fit: needs ~20.0 GiB > 13.0 GiB")
    chunked = loss.Path("chunked", 0, peak_bytes=3 * MIB, largest_bytes=MIB)
    chunked.cpu_ms, chunked.mean_output = [2.0, 4.0, 3.0], 11.9
    case = loss.Case("loss", 32768, 152064, [default, chunked])
    (row,) = loss.loss_table([case])[2:]
    assert row == (
        "| 152064 | 32768 | does not fit: needs ~20.0 GiB > 13.0 GiB | 3 | — | — | 3.0 | — "
        "| — / 1.0 | — | — |"
    )
    assert loss.verdicts([case]) == []


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--seq-lengths", "2048", "--tile-tokens", "4096"], "--tile-tokens"),
        (["--seq-lengths", "4096", "--mlp-tiles", "1024,8192"], "--mlp-tiles"),
        (["--vocab-sizes", "1"], "--vocab-sizes"),
        (["--max-memory-gb", "0"], "--max-memory-gb"),
    ],
)
def test_bad_sizes_name_the_flag(argv, flag, capsys):
    assert loss.main(argv) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--hidden-size", "--seq-lengths", "--repeats"])
def test_non_positive_sizes_name_the_flag(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        loss.main([flag, "0"])
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
