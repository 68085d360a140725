"""Megatron-LM ``--log-throughput``-style throughput in the trainer's log: tokens/s and model
TFLOP/s per device, and MFU against a ``--hardware`` profile's peak.

Oracles: the model FLOPs written out by hand from the tiny model's dimensions, and the
identities tokens/s per device = tokens/s / world size, TFLOP/s per device = model FLOPs /
iteration seconds / world size / 1e12, MFU = TFLOP/s per device / the profile's peak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _support.dist_utils import run_distributed

L, H, F, HEADS, GROUPS, S = 2, 64, 128, 4, 2, 64
MICRO, GLOBAL = 2, 4
PADDED_VOCAB = 512  # the byte tokenizer's 258 ids padded to a multiple of 256
TINY = [
    "--num-layers",
    str(L),
    "--hidden-size",
    str(H),
    "--ffn-hidden-size",
    str(F),
    "--num-attention-heads",
    str(HEADS),
    "--num-query-groups",
    str(GROUPS),
    "--seq-length",
    str(S),
    "--max-position-embeddings",
    str(S),
    "--micro-batch-size",
    str(MICRO),
    "--global-batch-size",
    str(GLOBAL),
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "1",
    "--log-interval",
    "1",
    "--make-vocab-size-divisible-by",
    "256",
    "--train-iters",
    "2",
]


def _hand_flops_per_iteration() -> float:
    """6 x matmul weights x tokens + the causal flash-attention kernel, from the dimensions."""
    d = H // HEADS
    per_layer = (
        H * (HEADS + 2 * GROUPS) * d + HEADS * d * H + H * 2 * F + F * H
    )  # QKV, proj, fc1 (SwiGLU), fc2
    weights = L * per_layer + H * PADDED_VOCAB  # + the output layer
    tokens = GLOBAL * S
    causal_forward = 2 * S * S * HEADS * d  # QK^T and PV, half of the s x s scores masked
    attention = GLOBAL * L * causal_forward * (1 + 2.5)  # fused backward: 2.5x the forward
    return 6 * weights * tokens + attention


def _records(save_dir) -> list[dict]:
    with open(os.path.join(save_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _check_throughput(records, world_size):
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        seconds = r["iteration_time_s"]
        rounding = (
            5e-5 / seconds + 0.05 / r["tokens_per_s"] + 1e-9
        )  # iteration_time_s has 4 decimals, tokens_per_s 1
        assert r["tokens_per_s_per_device"] == pytest.approx(
            r["tokens_per_s"] / world_size, abs=0.1
        )
        assert r["tokens_per_s"] == pytest.approx(GLOBAL * S / seconds, rel=rounding)
        expected = _hand_flops_per_iteration() / seconds / world_size / 1e12
        assert r["tflops_per_device"] == pytest.approx(expected, rel=rounding)


def test_model_flops_per_iteration_equals_hand_count():
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training.metrics import model_flops_per_iteration

    args = parse_config(TINY, world_size=1)
    assert model_flops_per_iteration(args, PADDED_VOCAB) == _hand_flops_per_iteration()
    # activation recompute is work redone, not model FLOPs
    full = parse_config(
        [
            *TINY,
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
        world_size=1,
    )
    assert model_flops_per_iteration(full, PADDED_VOCAB) == _hand_flops_per_iteration()


def test_one_process_run_logs_throughput_without_mfu(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mcore_flash.pretrain", *TINY, "--save", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = _records(tmp_path)
    _check_throughput(records, world_size=1)
    assert all("mfu" not in r for r in records)  # no --hardware: no peak to divide by
    lines = [line for line in result.stdout.splitlines() if line.startswith("iteration ")]
    assert len(lines) == 2
    assert "/device) | " in lines[0] and " TFLOP/s/device | " in lines[0] and "MFU" not in lines[0]


def _w_pretrain(rank, world_size, argv):
    from mcore_flash.pretrain import main

    return main(argv)


def test_data_parallel_run_logs_per_device_throughput_and_mfu(tmp_path, capfd):
    from mcore_flash.planning.hardware import HARDWARE_PROFILES

    argv = [*TINY, "--save", str(tmp_path), "--hardware", "h100-80g"]
    assert run_distributed(_w_pretrain, 2, argv, timeout=300) == [0, 0]
    records = _records(tmp_path)
    _check_throughput(records, world_size=2)
    peak = HARDWARE_PROFILES["h100-80g"].peak_bf16_tflops
    for r in records:
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / peak, rel=1e-12)
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("iteration ")]
    assert len(lines) == 2 and " | MFU " in lines[0]


def test_hardware_is_resolved_at_parse_time_and_a_bad_name_names_the_flag(capsys):
    from mcore_flash.pretrain import main
    from mcore_flash.runtime.arguments import parse_config

    assert (
        parse_config([*TINY, "--hardware", "H100-80G"], world_size=1).hardware.peak_bf16_tflops
        == 989.0
    )
    assert parse_config(TINY, world_size=1).hardware is None
    with pytest.raises(
        ValueError, match=r"--hardware h100: unknown profile; choose one of .*h100-80g"
    ):
        parse_config([*TINY, "--hardware", "h100"], world_size=1)
    assert main([*TINY, "--hardware", "h100"]) == 2
    assert "error: --hardware h100: unknown profile" in capsys.readouterr().err
