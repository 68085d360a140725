"""Training with the sequence-tiled loss and MLP equals training without them.

Oracle: the same tiny run (fp32, same seed and data) with megatron's whole-sequence loss and
untiled MLP: the loss and grad norm of every iteration agree to 1e-5 relative, on the CPU under
TP2 + SP with packed documents and the EOD loss mask, under PP2 and with activation offload,
and on the emulated NPU (HCCL-strict collectives) under TP2 + SP, also with full recompute and
activation offload. Tile sizes leave a ragged last tile.
"""

from __future__ import annotations

import pytest

from _support.dist_utils import run_distributed
from _support.recipe_runs import w_recipe_runs

TILED = ["--loss-compute-mode", "chunk", "--loss-chunk-size", "24", "--mlp-chunk-size", "20"]
PACKED = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", *PACKED]
PP2 = ["--pipeline-model-parallel-size", "2"]
OFFLOAD = [
    "--activation-offload-layers",
    "1",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
]
REL = 1e-5


def _nothing(recipe, baseline) -> dict:
    return {}


def _assert_same_steps(runs: dict, layouts) -> None:
    for layout in layouts:
        ref, tiled = runs[layout]["steps"], runs[f"{layout} tiled"]["steps"]
        assert len(ref) == len(tiled) > 0
        for step, ((loss, norm), (t_loss, t_norm)) in enumerate(zip(ref, tiled)):
            if loss is None:  # a pipeline stage before the last reports no loss
                assert t_loss is None, (layout, step)
            else:
                assert t_loss == pytest.approx(loss, rel=REL), (layout, step)
            assert t_norm == pytest.approx(norm, rel=REL), (layout, step)


def _runs(layouts: dict, extra=()) -> list:
    return [
        (name + suffix, [*flags, *more, *extra])
        for name, flags in layouts.items()
        for suffix, more in (("", []), (" tiled", TILED))
    ]


def test_tiled_training_equals_untiled_on_the_cpu(tmp_path):
    layouts = {"tp2 sp packed": TP2_SP, "pp2": PP2, "offload": ["--activation-offload-layers", "1"]}
    for runs in run_distributed(
        w_recipe_runs, 2, _runs(layouts), str(tmp_path), _nothing, timeout=600
    ):
        _assert_same_steps(runs, layouts)


def test_tiled_training_equals_untiled_on_the_emulated_npu(tmp_path):
    layouts = {"tp2 sp packed": TP2_SP, "offload full recompute": [*TP2_SP, *OFFLOAD]}
    per_rank = run_distributed(
        w_recipe_runs,
        2,
        _runs(layouts, ["--emulate-npu"]),
        str(tmp_path),
        _nothing,
        timeout=600,
        emulate_npu=True,
    )
    for runs in per_rank:
        _assert_same_steps(runs, layouts)
