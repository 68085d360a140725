"""The benchmark commands run end to end on tiny shapes and report what they measure exactly.

Timings are not asserted (they belong in docs/benchmarks.md); byte counts, call counts and
gradient agreement are deterministic and checked against independent numbers: q + k + v +
out + lse computed from the shapes, the layer input, torch's gradients without recompute.
Each benchmark runs in a subprocess (they set up their own process groups).
"""

from __future__ import annotations

import re
import subprocess
import sys

from mcore_flash.benchmarks.common import MIB

from _support.pretrain_flags import model_shape


def _bench(command: str, *argv: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "mcore_flash.cli", command, *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.strip(), "progress goes to stderr"
    return result.stdout


def _rows(table: str, first_column: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith(f"| {first_column} ")
    ]


def test_bench_attention_saves_exactly_qkv_out_lse():
    b, heads, kv_heads, d, s = 1, 4, 2, 64, 1024
    out = _bench(
        "bench-attention",
        "--seq-lengths",
        str(s),
        "--heads",
        str(heads),
        "--kv-heads",
        str(kv_heads),
        "--head-dim",
        str(d),
        "--repeats",
        "1",
        "--threads",
        "1",
        "--impls",
        "stock,cpu,reference",
    )
    rows = {
        row[0]: row for row in _rows(out, "stock") + _rows(out, "cpu") + _rows(out, "reference")
    }
    expected = (
        4 * b * s * d * (2 * heads + 2 * kv_heads) + 4 * b * heads * s
    )  # fp32 q, out, k, v; lse
    for impl in ("cpu", "reference"):
        assert float(rows[impl][3]) == round(expected / MIB, 1), rows[impl]
    assert float(rows["stock"][3]) > 4 * float(
        rows["cpu"][3]
    )  # keeps the [b, h, s, s] probabilities


def test_bench_recompute_reports_bytes_calls_and_exact_gradients():
    out = _bench(
        "bench-recompute",
        *model_shape(),
        "--vocab-size",
        "128",
        "--seq-lengths",
        "64,128",
        "--repeats",
        "1",
    )
    rows = {
        (row[0], int(row[1])): row
        for mode in ("none", "qkv", "attention", "full")
        for row in _rows(out, mode)
    }
    assert len(rows) == 8
    for (mode, _), row in rows.items():
        # kernel forward calls per layer: once, plus once more where recompute re-runs it; never the fallback
        assert row[9] == f"{1 if mode in ('none', 'qkv') else 2}, 1 (0)", row
        assert row[10] == "0"  # no [.., s, s] tensor saved in forward or recompute
        if mode != "none":
            assert float(row[12]) == 0.0  # gradients identical to no recompute
    verdicts = [line for line in out.splitlines() if line.startswith("- ")]
    attention = [v for v in verdicts if v.startswith("- attention")]
    full = [v for v in verdicts if v.startswith("- full")]
    assert len(attention) == len(full) == 2
    for s, line in zip((64, 128), attention):
        layer_input = s * 64 * 4 / MIB
        assert (
            f"attention sub-block keeps 0.000 MiB + checkpoint input {layer_input:.3f} MiB" in line
        )
        assert float(re.search(r"saved bytes cut ([\d.]+)%", line).group(1)) >= 25
    assert all("only inputs + shared RoPE table" in line for line in full)
    qkv = [v for v in verdicts if v.startswith("- qkv")]
    assert len(qkv) == 2 and all("kernel forward calls 2/step = 1/layer" in line for line in qkv)


def test_bench_cp_halves_saved_bytes_at_cp2():
    out = _bench(
        "bench-cp",
        "--seq-length",
        "512",
        "--cp-sizes",
        "1,2",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--repeats",
        "1",
    )
    rows = _rows(out, "1") + _rows(out, "2")
    assert [(row[0], row[1]) for row in rows] == [("1", "-"), ("2", "p2p"), ("2", "a2a")]
    for row in rows[1:]:
        assert (
            float(row[7]) == 0.5
        )  # saved bytes per rank vs cp=1 (kv heads >= cp: a2a needs no K/V copies)
        assert float(row[8]) > 0  # K/V travelled


def test_bench_convert_round_trips_and_reports_peak_rss():
    """bench-convert on the trainer's tiny preset: parameter count from the shape (2 layers,
    h 128, FFN 352, 4 heads / 2 KV heads, vocabulary 384 = the byte tokenizer's 258 padded,
    untied), a bit-exact round trip, and a peak RSS per conversion that is at least the
    import-only baseline."""
    import json

    result = json.loads(
        _bench("bench-convert", "--model", "tiny", "--json").strip().splitlines()[-1]
    )
    h, ffn, kv, vocab = 128, 352, 64, 384
    per_layer = 2 * h + h * h + 2 * kv * h + h * h + 3 * ffn * h
    assert result["parameters"] == 2 * vocab * h + 2 * per_layer + h
    assert result["bytes"] == 2 * result["parameters"]  # bf16
    assert result["round_trip_bit_exact"] is True
    for name in ("hf_to_mcore", "mcore_to_hf"):
        assert result[name]["peak_rss"] >= result["baseline"]["peak_rss"] > 0


def test_bench_packed_reports_documents_and_sum_of_squares_prediction():
    """bench-packed on a tiny sample: document lengths that sum to S and lie in [1, 2D-1] (the
    last one cut), the prediction equal to sum(len^2) / S^2 recomputed here, the measured ratio
    the quotient of the reported medians, and per-document attention that matches the dense
    causal output on the first document. The table run reports the same seeded documents."""
    import json

    s, mean, repeats = 256, 16, 2
    argv = (
        "--seq-length",
        str(s),
        "--mean-document-length",
        str(mean),
        "--heads",
        "2",
        "--head-dim",
        "16",
        "--repeats",
        str(repeats),
        "--threads",
        "1",
        "--seed",
        "3",
    )
    result = json.loads(_bench("bench-packed", *argv, "--json").strip().splitlines()[-1])
    lengths = result["document_lengths"]
    assert sum(lengths) == s and result["num_documents"] == len(lengths) > 1
    assert all(1 <= n <= 2 * mean - 1 for n in lengths)
    assert result["predicted_ratio"] == sum(n * n for n in lengths) / s**2
    assert len(result["dense_runs_ms"]) == len(result["packed_runs_ms"]) == repeats
    assert result["measured_ratio"] == result["packed_ms"] / result["dense_ms"]
    assert result["measured_cpu_ratio"] == result["packed_cpu_ms"] / result["dense_cpu_ms"]
    assert (
        result["first_document_max_diff"] < 1e-5
    )  # fp32: document masking leaves a prefix unchanged

    table = _bench("bench-packed", *argv)
    (dense,), (packed,) = _rows(table, "dense"), _rows(table, "packed")
    assert dense[1] == "1" and dense[3] == dense[5] == dense[6] == "1.000"
    assert packed[1] == str(len(lengths)) and packed[6] == f"{result['predicted_ratio']:.3f}"
    assert f"document lengths: {','.join(map(str, lengths))}" in table


def test_bench_window_reports_pairs_predictions_and_both_levels():
    """bench-window on a tiny layer: the predicted ratio is the attended pairs counted here by
    brute force, the chunks compute at least those, the measured ratios are the quotients of
    the medians, and the first W rows (which see the same keys either way) agree exactly."""
    import json

    from mcore_flash.benchmarks.window import attended_pairs, computed_pairs

    from _support import oracle

    s, w = 384, 96
    visible = oracle.visible(s, s, causal=True, window=(w - 1, 0))
    assert (
        attended_pairs(s, w) == int(visible.sum()) and attended_pairs(s, None) == s * (s + 1) // 2
    )
    assert computed_pairs(s, w, 64) >= attended_pairs(s, w)
    argv = (
        "--seq-length",
        str(s),
        "--window",
        str(w),
        "--hidden-size",
        "64",
        "--ffn-hidden-size",
        "96",
        "--repeats",
        "1",
    )
    result = json.loads(_bench("bench-window", *argv, "--json").strip().splitlines()[-1])
    assert result["predicted_attention_ratio"] == attended_pairs(s, w) / attended_pairs(s, None)
    assert result["predicted_attention_ratio"] < result["predicted_layer_ratio"] < 1
    assert result["attention_ratio"] == result["attention_window_ms"] / result["attention_full_ms"]
    assert result["layer_ratio"] == result["layer_window_ms"] / result["layer_full_ms"]
    assert result["max_abs_diff_first_window"] < 1e-5  # fp32; 0 on our machine


def test_bench_generate_times_both_paths_which_give_the_same_tokens():
    """bench-generate on the tests' tiny model: one row per path, each with the prompt and
    new-token counts asked for, and the two paths' greedy tokens equal (exit code 0)."""
    argv = ("--prompt-length", "24", "--new-tokens", "5", "--repeats", "1", *model_shape())
    out = _bench("bench-generate", *argv)
    rows = _rows(out, "megatron's") + _rows(out, "none")
    assert [row[:3] for row in rows] == [
        ["megatron's (default)", "24", "5"],
        ["none (--no-kv-cache)", "24", "5"],
    ]
    assert "same tokens: yes" in out


def test_bench_cuda_counts_flash_attn_flops_and_needs_a_gpu(capsys):
    """The forward term equals torch's FLOP counter on attention's two matmuls (non-causal,
    so nothing is skipped); the total is flash-attn's 3.5 forwards. Without a GPU the command
    says so."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from mcore_flash.benchmarks import cuda_kernels

    q = torch.randn(2, 4, 96, 32)
    with FlopCounterMode(display=False) as counter:
        torch.softmax(q @ q.transpose(-1, -2), dim=-1) @ q
    forward = counter.get_total_flops()
    assert cuda_kernels.attention_flops(2, 96, 4, 32, causal=False) == 3.5 * forward
    assert cuda_kernels.attention_flops(2, 96, 4, 32, causal=True) == 3.5 * forward / 2
    if not torch.cuda.is_available():
        assert cuda_kernels.main(["--seq-lengths", "1024"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_cuda_table_divides_the_fastest_sdpa_by_ours():
    from mcore_flash.benchmarks.cuda_kernels import Row, table

    rows = [
        Row("ours", 8192, 10.0, 500.0, "cudnn"),
        Row("sdpa-flash", 8192, 16.0, 300.0),
        Row("sdpa-cudnn", 8192, 9.5, 520.0),
        Row("sdpa-efficient", 8192, None, None, "refused: head_dim"),
    ]
    lines = table(rows)
    assert "| 8192 | ours | 10.00 | 500 | cudnn |" in lines
    assert "| 8192 | sdpa-efficient | — | — | refused: head_dim |" in lines
    assert lines[-1] == "| 8192 | 0.95 |"
