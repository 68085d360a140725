"""The planner's HCCL communicators of layouts too large to launch, counted by hand from the
rules in ``mcore_flash/planning/communicators.py`` (the small layouts are measured on the
emulated NPU: tests/emulation/test_hccl_communicators.py)."""

from __future__ import annotations

import pytest

from mcore_flash.planning import Layout, get_model
from mcore_flash.planning.communicators import hccl_communicators, stage_communicators
from mcore_flash.planning.units import MiB


def hccl_buffer_bytes(layout, model, hccl_buffsize=200 * MiB, p2p_buffsize=20 * MiB) -> int:
    """The fullest stage's HCCL bytes at these buffer sizes (defaults: torch_npu's)."""
    return max(
        stage_communicators(layout, model, stage).buffer_bytes(hccl_buffsize, p2p_buffsize)
        for stage in range(layout.pp)
    )


UNTIED = get_model("llama3-70b")
TIED = get_model("llama3.2-1b")


def test_70b_recipe_style_tp8_cp2_dp2_opens_six_collective_communicators():
    # one pipeline stage (first and last): the world (stop agreement), the 1-rank pipeline
    # group (token-count broadcast), data x context (4 ranks), the distributed optimizer's
    # instance (grad norm), tensor (8), context (ring) = 6; no point-to-point at pp 1.
    layout = Layout(tp=8, cp=2, dp=2)
    worst = hccl_communicators(layout, UNTIED)
    assert (worst.num_collective, worst.num_p2p) == (6, 0)
    assert worst.collective == (
        "CONTEXT_PARALLEL_GROUP",
        "DATA_PARALLEL_GROUP_WITH_CP",
        "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
        "PIPELINE_MODEL_PARALLEL_GROUP",
        "TENSOR_MODEL_PARALLEL_GROUP",
        "default_pg",
    )
    # the defaults, 200 MiB and 20 MiB: 2 x 6 x 200 MiB
    assert hccl_buffer_bytes(layout, UNTIED) == 2400 * MiB


def test_tied_pp4_stages_differ_and_the_bytes_take_the_fullest():
    # TP8 PP4 CP2, no distributed optimizer, tied embeddings. Every stage: world, pipeline,
    # data x context (dp 1 x cp 2), model parallel (grad norm), tensor (tp 8), context = 6;
    # the first and last add the embedding group = 7. Point-to-point: the ends one
    # neighbour each, the middle stages two.
    layout = Layout(tp=8, pp=4, cp=2, distributed_optimizer=False)
    counts = [
        (c.num_collective, c.num_p2p)
        for c in (stage_communicators(layout, TIED, stage) for stage in range(4))
    ]
    assert counts == [(7, 1), (6, 2), (6, 2), (7, 1)]
    assert "EMBEDDING_GROUP" not in stage_communicators(layout, UNTIED, 0).collective
    worst = hccl_communicators(layout, TIED)
    assert (worst.stage, worst.num_collective, worst.num_p2p) == (0, 7, 1)
    # defaults: ends 2 x (7 x 200 + 20) = 2840 MiB > middle 2 x (6 x 200 + 2 x 20) = 2480
    assert hccl_buffer_bytes(layout, TIED) == 2840 * MiB
    # 10 MiB collective, 200 MiB p2p buffers: ends 2 x (70 + 200) = 540, middle 2 x (60 + 400) = 920
    assert hccl_buffer_bytes(layout, TIED, 10 * MiB, 200 * MiB) == 920 * MiB
    # P2P_HCCL_BUFFSIZE=0: no point-to-point communicators, 2 x 7 x 200 MiB
    assert hccl_buffer_bytes(layout, TIED, 200 * MiB, 0) == 2800 * MiB


def test_pipeline_point_to_point_pairs():
    # pp 2: the pipeline group's pair and the world's (megatron sends one direction over the
    # world group when the pipeline group has 2 ranks); pp 4 interleaved: both neighbours on
    # every stage (the first receives from the last); the last stage alone all-reduces the
    # cross entropy over its (1-rank) tensor group: 5 collective against 4.
    pp2 = [stage_communicators(Layout(pp=2), UNTIED, s) for s in range(2)]
    assert [c.p2p for c in pp2] == [("PIPELINE_MODEL_PARALLEL_GROUP", "default_pg")] * 2
    vp = Layout(pp=4, vp=2)
    assert [stage_communicators(vp, UNTIED, s).num_p2p for s in range(4)] == [2, 2, 2, 2]
    assert [stage_communicators(vp, UNTIED, s).num_collective for s in range(4)] == [4, 4, 4, 5]
    for layout in (Layout(pp=2), vp, Layout(tp=8, pp=4, cp=2)):
        for stage in range(layout.pp):
            communicators = stage_communicators(layout, TIED, stage)
            assert set(communicators.p2p) <= set(communicators.collective)


def test_a_stage_outside_the_pipeline_is_refused():
    with pytest.raises(ValueError, match="stage 2: a pipeline stage of pp 2 is 0 .. 1"):
        stage_communicators(Layout(pp=2), UNTIED, 2)
