"""``--async-save``: checkpoints written in the background by megatron-core's asynchronous
dist-checkpoint writer, published (manifest, rename, tracker) once every rank's writer is done.

Oracles: the synchronous save's files (the same bytes), and the fault drill's uninterrupted
``--async-save`` run (every kill resumes to its bytes; ``scripts/fault_drill.py``).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
fault_drill = importlib.import_module("fault_drill")  # a CI harness, not in the package

from mcore_flash import faults  # noqa: E402
from mcore_flash.checkpoint.directory import checkpoint_dir  # noqa: E402

from _support.dist_utils import run_distributed  # noqa: E402
from _support.recipe_runs import TINY  # noqa: E402

SHORT = ("--train-iters", "3")


def test_background_saves_write_the_synchronous_saves_bytes_and_say_what_training_waited(tmp_path):
    """Three iterations, a save after each, DP2 with the distributed optimizer and dropout:
    every checkpoint the background writer publishes equals the synchronous save's file for
    file (DCP's path-bearing index aside, as in the drill), and the log says how long each
    save stopped training and when each was published."""
    sync, background = str(tmp_path / "sync"), str(tmp_path / "async")
    code, _ = fault_drill.launch(sync, extra=SHORT)
    assert code == 0
    code, output = fault_drill.launch(background, extra=SHORT, drill=fault_drill.ASYNC_DRILL)
    assert code == 0, output[-3000:]
    for iteration in (1, 2, 3):
        assert fault_drill.same_files(
            checkpoint_dir(background, iteration), checkpoint_dir(sync, iteration)
        ), iteration
        assert (
            f"writing checkpoint {checkpoint_dir(background, iteration)} in the background"
            in output
        )
        assert (
            f"saved checkpoint {checkpoint_dir(background, iteration)} (written in the background)"
            in output
        )
    assert not [name for name in os.listdir(background) if name.endswith(".tmp")]


def test_async_save_is_refused_with_fsdp(tmp_path):
    from mcore_flash.runtime.arguments import parse_config

    with pytest.raises(ValueError, match="--async-save writes --ckpt-format torch_dist"):
        parse_config(
            [
                "--use-megatron-fsdp",
                "--async-save",
                "--global-batch-size",
                "16",
                "--save",
                str(tmp_path),
            ],
            world_size=2,
        )


@pytest.mark.slow  # 8 launches of 2 ranks: CI's Python 3.11 job
def test_async_save_drill_table(tmp_path):
    """Killed while a background write is in flight, in the writer, or in the publishing after
    it: the tracker names a complete checkpoint, the next launch resumes from it and writes
    the uninterrupted --async-save run's bytes. docs/fault-tolerance.md holds this table."""
    drill = fault_drill.ASYNC_DRILL
    reference = fault_drill.run_uninterrupted(str(tmp_path / "uninterrupted"), drill)
    rows = fault_drill.run_drill(str(tmp_path / "chain"), reference, disk_full=False, drill=drill)
    assert fault_drill.failures(rows, str(tmp_path / "chain")) == []
    assert [row.fault.split("@")[0] for row in rows] == [point for point, _, _ in drill.chain]
    assert set(faults.BACKGROUND_POINTS) <= {point for point, _, _ in drill.chain}
    table = fault_drill.documented_table(drill)
    assert _timeless(table) == _timeless(
        fault_drill.markdown(rows)
    )  # regenerate: --async-save --write
    for row in rows:  # a kill in the model: the previous save published, or still in flight
        if row.fault.split("@")[0] in faults.MODEL_POINTS:
            iteration = int(row.fault.split("@")[1].split(":")[0])
            assert row.tracker in (iteration - 1, iteration - 2 or None), row


def _timeless(table: str) -> list[list[str]]:
    """The drill table's cells, but for the rows of a kill in the model (forward, backward)
    the tracker and resume cells: whether the previous save's background write had been
    published by then depends on timing (the test bounds them instead)."""
    rows = [line.split(" | ") for line in table.splitlines()]
    for cells in rows[2:]:
        if cells[0].strip("| `").split("@")[0] in faults.MODEL_POINTS:
            cells[3] = cells[5] = "(timing)"
    return rows


def _w_save_once(rank, world_size, save):
    """Worker: two iterations, then a synchronous save (torch_dist); then whether megatron's
    writer made its results queue (``filesystem_async._results_queue``), and the names of this
    process's live children."""
    import multiprocessing

    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from mcore_flash.runtime import distributed
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training import loop

    config = parse_config([*TINY, "--train-iters", "2", "--save", save])
    distributed.init_distributed(config)
    try:
        loop.train(config)
    finally:
        parallel_state.destroy_model_parallel()
    made = filesystem_async._results_queue is not None
    return made, [child.name for child in multiprocessing.active_children()]


def test_a_synchronous_save_starts_no_process_that_outlives_it(tmp_path):
    """megatron's torch_dist writer makes its results queue in a spawned Manager process on a
    process's first save (a new interpreter: seconds, and a process a SIGKILL leaves behind);
    a synchronous save collects in this process instead
    (``mcore_flash/platform/megatron_sync_save_queue.py``): no queue made, no child alive."""
    from mcore_flash.checkpoint.directory import latest_iteration

    for made, children in run_distributed(_w_save_once, 2, str(tmp_path), timeout=300):
        assert not made and children == []
    assert latest_iteration(str(tmp_path)) == 2
