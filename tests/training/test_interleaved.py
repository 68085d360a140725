"""The interleaved 1F1B schedule (Megatron-LM's ``--virtual-pipeline-model-parallel-size`` /
``--num-layers-per-virtual-pipeline-stage``) trains what one process trains.

Oracle: the one-process run (PP 1, no interleaving) continuing from the same checkpoint; for
resume, the uninterrupted interleaved run. Every run starts from ``start``: a PP 1 checkpoint
at iteration 3 (the layouts draw different initial weights: megatron seeds each pipeline
rank apart), then trains iterations 4-6. Losses and grad norms are read from each run's
``metrics.jsonl``; fp32, 1e-5 relative. The model has 8 layers, so PP 2 x VP 4 holds one
layer per chunk and PP 2 x VP 2 two.
"""

from __future__ import annotations

import json
import os

import pytest

from mcore_flash.planning.parallel_layout import RECOMPUTE_FLAGS

from _support.dist_utils import run_distributed
from _support.pretrain_flags import tiny_flags

# global batch 4 at micro-batch 1: 4 micro-batches, which the interleaved schedule takes in
# groups of PP 2
BASE = tiny_flags(num_layers=8, micro_batch_size=1, train_iters=6)
PP2 = ["--pipeline-model-parallel-size", "2"]
VP2 = [*PP2, "--virtual-pipeline-model-parallel-size", "2"]
VP4 = [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"]
DISTRIBUTED = ["--use-distributed-optimizer"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]


def _w_runs(rank, world_size, root, runs):
    """Worker: train each ``(name, flags)`` in turn with ``--save ROOT/name`` (and ``--load
    ROOT/start`` unless the flags name another checkpoint or the run is ``start``); returns
    ``{name: message}`` of the runs refused with a ValueError."""
    from megatron.core import parallel_state

    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training import loop

    refusals = {}
    for name, flags in runs:
        load = [] if "--load" in flags or name == "start" else ["--load", f"{root}/start"]
        config = parse_config([*BASE, *load, *flags, "--save", f"{root}/{name}"])
        distributed.init_distributed(config)
        try:
            loop.train(config)
        except ValueError as error:
            refusals[name] = str(error)
        finally:
            parallel_state.destroy_model_parallel()
    return refusals


def _steps(root, name) -> dict[int, tuple[float, float]]:
    """``{iteration: (loss, grad norm)}`` of run ``name``'s ``metrics.jsonl``."""
    with open(os.path.join(root, name, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


def _assert_same(root, name, oracle, iterations=(4, 5, 6)):
    got, want = _steps(root, name), _steps(root, oracle)
    for i in iterations:
        assert got[i] == pytest.approx(want[i], rel=1e-5), f"{name} vs {oracle}, iteration {i}"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """``start`` (PP 1 to iteration 3) and the oracle ``pp1`` (4-6 from it), one process."""
    root = str(tmp_path_factory.mktemp("interleaved"))
    runs = [("start", ["--exit-interval", "3"]), ("pp1", [])]
    assert run_distributed(_w_runs, 1, root, runs, timeout=300) == [{}]
    return root


def test_vp2_and_vp4_train_as_pp1_with_recompute_resume_exactly_and_reload_anywhere(root):
    """At PP 2: VP 2, VP 4 (by layers per stage), VP 2 with qkv and with full recompute equal
    PP 1; a VP 2 run stopped at 4 and resumed equals the uninterrupted one bit for bit; its
    checkpoint at 4 (weights and plain Adam state) loads at PP 1 x DP 2 and trains on equally;
    the distributed optimizer with both overlaps under VP 2 equals it at plain PP 2, and its
    state is refused at another virtual pipeline size, naming the flag."""
    runs = [
        ("vp2", VP2),
        ("vp4", VP4),
        ("vp2-qkv", [*VP2, *RECOMPUTE_FLAGS["qkv"]]),
        ("vp2-full", [*VP2, *RECOMPUTE_FLAGS["full"]]),
        ("vp2-cut", [*VP2, "--exit-interval", "4"]),
        ("dp2-from-vp2", ["--load", f"{root}/vp2-cut"]),
        ("vp2-cut", [*VP2, "--load", f"{root}/vp2-cut"]),  # the resume
        ("pp2-distopt", [*PP2, *DISTRIBUTED, "--no-load-optim"]),
        (
            "vp2-distopt",
            [*VP2, *DISTRIBUTED, *OVERLAP, "--no-load-optim"],
        ),
        ("pp2-from-vp2-distopt", [*PP2, *DISTRIBUTED, "--load", f"{root}/vp2-distopt"]),
    ]
    refusals = run_distributed(_w_runs, 2, root, runs, timeout=600)
    for name in ("vp2", "vp4", "vp2-qkv", "vp2-full"):
        _assert_same(root, name, "pp1")
    assert _steps(root, "vp2-cut") == _steps(root, "vp2")  # exact, every iteration 4-6
    _assert_same(root, "dp2-from-vp2", "vp2", iterations=(5, 6))
    _assert_same(root, "vp2-distopt", "pp2-distopt")
    for rank_refusals in refusals:
        assert list(rank_refusals) == ["pp2-from-vp2-distopt"]
        assert "--virtual-pipeline-model-parallel-size 2" in rank_refusals["pp2-from-vp2-distopt"]


@pytest.mark.slow
def test_vp2_with_cp2_trains_as_pp1(root):
    """PP 2 x VP 2 x CP 2 (ring attention inside every chunk), four ranks, equals PP 1."""
    assert (
        run_distributed(
            _w_runs, 4, root, [("vp2-cp2", [*VP2, "--context-parallel-size", "2"])], timeout=600
        )
        == [{}] * 4
    )
    _assert_same(root, "vp2-cp2", "pp1")


def test_vp2_on_the_emulated_npu_trains_as_pp1(root):
    """The interleaved schedule's device path (HCCL-strict groups, npu tensors): PP 2 x VP 2,
    plain and with qkv recompute, from the CPU's checkpoint, equal PP 1 on the CPU."""
    runs = [("vp2-npu", VP2), ("vp2-qkv-npu", [*VP2, *RECOMPUTE_FLAGS["qkv"]])]
    assert run_distributed(_w_runs, 2, root, runs, timeout=600, emulate_npu=True) == [{}, {}]
    _assert_same(root, "vp2-npu", "pp1")
    _assert_same(root, "vp2-qkv-npu", "pp1")


@pytest.mark.parametrize(
    "tool, required",
    [
        ("mcore_flash.generate", ["--prompt-ids", "1"]),
        ("mcore_flash.evaluation.cli", ["--task", "needle"]),
    ],
)
def test_generate_and_evaluate_refuse_the_interleaved_flags_by_name(tool, required):
    """They run one model chunk per stage (an interleaved checkpoint loads at any layout,
    above): the flags are refused with that reason, not with a training error."""
    import importlib

    from mcore_flash.runtime.arguments import parse_args

    parser = importlib.import_module(tool).build_parser()
    for flags in (VP2, VP4):
        with pytest.raises(ValueError, match="one model chunk per pipeline stage; drop the flag"):
            parse_args(["--load", "ckpt", *required, *flags], world_size=2, parser=parser)
