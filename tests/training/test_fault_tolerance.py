"""Training survives faults: kills at every fault point, a full disk, damaged and forged checkpoints.

Oracles: an uninterrupted run's checkpoints, compared byte for byte by hashing the files
(`scripts/fault_drill.py`, not our manifests); for damaged files, the byte this
test flipped; for forged pickles, a side effect that must not happen; for resharding, the
one-process run (tests/training/test_pretrain.py).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import re
import shutil
import sys

import pytest
import torch

from mcore_flash import faults
from mcore_flash.checkpoint.directory import MARKER, checkpoint_dir

from _support.dist_utils import free_port, run_distributed

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
fault_drill = importlib.import_module(
    "fault_drill"
)  # scripts/fault_drill.py: a CI harness, not in the package

LAST = fault_drill.ITERATIONS


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The drill's uninterrupted run: 12 iterations, DP2, distributed optimizer, dropout 0.1."""
    return fault_drill.run_uninterrupted(str(tmp_path_factory.mktemp("drill") / "uninterrupted"))


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory) -> str:
    """The FSDP drill's uninterrupted run: DP2, --use-megatron-fsdp (fsdp_dtensor checkpoints)."""
    return fault_drill.run_uninterrupted(
        str(tmp_path_factory.mktemp("drill-fsdp") / "uninterrupted"), fault_drill.FSDP_DRILL
    )


@pytest.fixture(params=["torch_dist", "fsdp_dtensor"])
def saved(request) -> tuple[str, int, tuple]:
    """``(reference run, its last iteration, the flags that load it in one process)`` for each
    checkpoint format; an FSDP checkpoint's weights load into the one-process run without FSDP
    (megatron-core 0.16 refuses FSDP at DP1), every file verified first as for torch_dist."""
    if request.param == "torch_dist":
        return request.getfixturevalue("reference"), LAST, ()
    fsdp = request.getfixturevalue("fsdp_reference")
    return fsdp, fault_drill.ITERATIONS, ("--no-load-optim",)


@pytest.mark.parametrize("free,full", [(1000, True), (2 << 30, False)])
def test_a_failed_save_without_an_errno_is_a_full_disk_below_1_mib_free(
    tmp_path, monkeypatch, free, full
):
    """torch's C++ writer reports a full disk as "unexpected pos" without an errno: under 1 MiB
    free that is said to be a full disk, with more free space the error is passed on as is;
    either way the message names the checkpoint that is intact and how to resume."""
    from mcore_flash.checkpoint import failures

    (tmp_path / MARKER).write_text("2")
    os.makedirs(checkpoint_dir(str(tmp_path), 2))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(failures.shutil, "disk_usage", lambda path: usage._replace(free=free))
    message = failures.save_failure(str(tmp_path), 4, RuntimeError("unexpected pos 512 vs 256"))
    assert ("No space left on device" in message) == full
    assert ("RuntimeError: unexpected pos 512 vs 256" in message) != full
    assert "the checkpoint of iteration 2 is intact" in message and f"--load {tmp_path}" in message


@pytest.mark.slow  # the chain's 12 launches: CI's Python 3.12 job runs the tests below (tests/conftest.py)
def test_fault_drill_table(reference, tmp_path):
    """Every fault point and (as root) the full disk: killed there, the tracker names a complete
    checkpoint, the next launch resumes from it and writes the uninterrupted run's bytes.
    docs/fault-tolerance.md holds exactly this table."""
    disk_full = fault_drill.can_fill_a_disk()  # root only
    rows = fault_drill.run_drill(str(tmp_path), reference, disk_full=disk_full)
    chain = rows[:-1] if disk_full else rows
    assert [row.fault.split("@")[0] for row in chain] == list(faults.POINTS)
    assert fault_drill.failures(rows, str(tmp_path)) == []
    assert [row.resumed_from for row in chain] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11]
    table = fault_drill.documented_table(fault_drill.DRILL)
    if not disk_full:  # the table's other rows still match; the skip says what did not run
        assert table.rsplit("\n", 1)[0] == fault_drill.markdown(rows)
        pytest.skip(fault_drill.NO_DISK_FULL)
    assert rows[-1].fault.startswith("disk full") and rows[-1].resumed_from == 2
    assert rows[-1].ok, (rows[-1], (tmp_path / "disk_full" / "first.log").read_text()[-2000:])
    assert table == fault_drill.markdown(rows)  # regenerate: python scripts/fault_drill.py --write


@pytest.mark.slow  # each chain's 11 launches: CI's Python 3.11 job
@pytest.mark.parametrize("kind", ["fsdp", "offload", "fsdp2"])
def test_fault_drill_tables_of_zero3_fsdp2_and_the_offloaded_optimizer(kind, tmp_path, request):
    """The drill at every fault point with --use-megatron-fsdp (fsdp_dtensor checkpoints), with
    --optimizer-cpu-offload on the emulated NPU (the optimizer state and step on the host), and
    with --use-torch-fsdp2 --fsdp2-offload-to-cpu there (weights, gradients and optimizer state
    on the host): docs/fault-tolerance.md holds these tables (regenerate: ... --fsdp /
    --offload / --fsdp2 --write)."""
    if kind == "fsdp":
        drill, reference = fault_drill.FSDP_DRILL, request.getfixturevalue("fsdp_reference")
    else:
        drill = {"offload": fault_drill.OFFLOAD_DRILL, "fsdp2": fault_drill.FSDP2_DRILL}[kind]
        reference = fault_drill.run_uninterrupted(str(tmp_path / "uninterrupted"), drill)
    rows = fault_drill.run_drill(str(tmp_path / "chain"), reference, disk_full=False, drill=drill)
    assert fault_drill.failures(rows, str(tmp_path / "chain")) == []
    assert [row.fault.split("@")[0] for row in rows] == list(faults.POINTS)
    assert fault_drill.documented_table(drill) == fault_drill.markdown(rows)


@pytest.mark.parametrize("ok", [True, False])
def test_the_drill_cli_keeps_its_work_dir_only_when_a_row_failed(tmp_path, monkeypatch, capsys, ok):
    work_dir = tmp_path / "drill"

    def drill(path, disk_full, log, drill=None):
        os.makedirs(os.path.join(path, "launches"))
        return [fault_drill.Row("forward@2:0", "somewhere", ok, 1, True, 1, True)]

    monkeypatch.setattr(fault_drill, "run_drill", drill)
    assert fault_drill.main(["--work-dir", str(work_dir)]) == (0 if ok else 1)
    assert work_dir.exists() != ok
    assert (f"kept {work_dir} (each launch's output: launches/)" in capsys.readouterr().err) != ok


def test_fault_spec_errors_name_the_variable():
    assert faults.parse("save-rng@4:1") == faults.Fault("save-rng", 4, 1)
    for bad in ("explode@3", "backward", "backward@x", "backward@3:r"):
        with pytest.raises(ValueError, match=faults.ENV):
            faults.parse(bad)


def _w_mains(rank, world_size, argvs):
    """``mcore_flash.pretrain.main(argv)`` for each argv: (exit code, stderr). The first runs in
    run_distributed's process group; main() ends it, so later ones (one rank only) get a
    fresh port, picked just before use."""
    from mcore_flash.pretrain import main

    results = []
    for argv in argvs:
        if not torch.distributed.is_initialized():
            assert world_size == 1, "one main() per run_distributed call at world size > 1"
            os.environ["MASTER_PORT"] = str(free_port())
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        results.append((code, err.getvalue()))
    return results


def _mains(argvs):
    """One process, ``main(argv)`` for each: rank 0's (exit code, stderr) per argv."""
    return run_distributed(_w_mains, 1, argvs, timeout=400)[0]


def _copy_checkpoint(reference: str, iteration: int, target) -> str:
    """``target`` holding the reference's checkpoint ``iteration`` and a tracker naming it."""
    os.makedirs(target)
    shutil.copytree(checkpoint_dir(reference, iteration), checkpoint_dir(str(target), iteration))
    with open(os.path.join(target, MARKER), "w") as f:
        f.write(str(iteration))
    return str(target)


def _present(reference: str, name: str, last: int = LAST) -> tuple[str, ...]:
    """``(name,)`` if the reference's last checkpoint has that file: megatron-core 0.16 writes
    ``common.pt``, 0.19 keeps the common state as a byte item inside the ``.distcp`` files
    (fsdp_dtensor: ``common.pt`` on both); only torch_dist has ``metadata.json``."""
    return (name,) if os.path.exists(os.path.join(checkpoint_dir(reference, last), name)) else ()


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _resume_argv(load: str, *flags: str) -> list[str]:
    return [*fault_drill.FLAGS, "--save", load, "--load", load, *flags]


def test_a_flipped_byte_in_each_file_kind_is_named_at_load(saved, tmp_path):
    """One bit changed in any file of a checkpoint (or the tracker, or the manifest), or a
    file cut short, fails the load with exit 2 and a message naming that file."""
    reference, last, flags = saved
    cases, runs = [], []
    for kind in (
        *_present(reference, "common.pt", last),
        *_present(reference, "metadata.json", last),
        ".metadata",
        "__0_0.distcp",
        "rng_rank00001.pt",
        "manifest.json",
        MARKER,
        "truncated __1_0.distcp",
    ):
        load = _copy_checkpoint(reference, last, tmp_path / re.sub(r"\W", "_", kind))
        if kind == MARKER:
            path = os.path.join(load, MARKER)
            _flip_byte(path, os.path.getsize(path) - 1)  # "12" -> "13", "9" -> "8": not there
        elif kind.startswith("truncated"):
            path = os.path.join(checkpoint_dir(load, last), kind.split()[1])
            os.truncate(path, os.path.getsize(path) // 2)
        else:
            path = os.path.join(checkpoint_dir(load, last), kind)
            _flip_byte(path, os.path.getsize(path) // 2)
        cases.append((kind, path))
        runs.append(_resume_argv(load, *flags))
    for (kind, path), (code, stderr) in zip(cases, _mains(runs)):
        assert code == 2, (kind, stderr[-2000:])
        assert path in stderr, (kind, stderr[-2000:])
        assert "Traceback" not in stderr, kind


class _RunsCode:
    """Unpickling this runs ``touch MARKER_FILE``: what a forged checkpoint would do."""

    def __init__(self, marker_file: str):
        self.marker_file = marker_file

    def __reduce__(self):
        return os.system, (f"touch {self.marker_file}",)


def test_pickles_that_would_run_code_are_refused(saved, tmp_path):
    """Forged checkpoints whose manifest matches (the forger rewrote it): code planted in
    ``.metadata``, in a byte item inside a ``.distcp`` file, in ``common.pt`` or in an RNG
    file is refused, naming the file, and never runs."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from mcore_flash.checkpoint import manifest

    reference, last, flags = saved
    cases, runs = [], []
    for kind in (
        ".metadata",
        "byte item",
        *_present(reference, "common.pt", last),
        "rng_rank00000.pt",
    ):
        name = re.sub(r"\W", "_", kind)
        load = _copy_checkpoint(reference, last, tmp_path / name)
        path = checkpoint_dir(load, last)
        marker_file = str(tmp_path / f"ran_{name}")
        planted = _RunsCode(marker_file)
        if kind == ".metadata":
            named = os.path.join(path, ".metadata")
            with open(named, "wb") as f:
                pickle.dump(planted, f)
        elif kind == "byte item":  # append a pickle to a .distcp file and point an item at it
            with open(os.path.join(path, ".metadata"), "rb") as f:
                metadata = pickle.load(f)  # our own reference run's: trusted
            index, info = next(
                (i, s)
                for i, s in metadata.storage_data.items()
                if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata)
            )
            named = os.path.join(path, info.relative_path)
            payload = io.BytesIO()
            torch.save(planted, payload)
            info.offset, info.length = os.path.getsize(named), len(payload.getvalue())
            with open(named, "ab") as f:
                f.write(payload.getvalue())
            with open(os.path.join(path, ".metadata"), "wb") as f:
                pickle.dump(metadata, f)
        else:
            named = os.path.join(path, kind)
            state = torch.load(named, weights_only=True)
            state["planted"] = planted
            torch.save(state, named)
        os.remove(os.path.join(path, manifest.MANIFEST))
        manifest.write_manifest(path)  # the forger's manifest matches the forged files
        cases.append((kind, named, marker_file))
        runs.append(_resume_argv(load, *flags))
    for (kind, named, marker_file), (code, stderr) in zip(cases, _mains(runs)):
        assert code == 2, (kind, stderr[-2000:])
        assert named in stderr and "refus" in stderr, (kind, stderr[-2000:])
        assert not os.path.exists(marker_file), f"{kind}: the planted code ran"


def test_stale_tmp_is_reported_and_removed_and_dp2_state_loads_at_dp1(reference, tmp_path):
    """A directory left by a killed save is named at start, never loaded, removed by the
    next save; the DP2 distributed-optimizer checkpoint resumes in one process."""
    load = _copy_checkpoint(reference, LAST - 1, tmp_path / "run")
    stale = checkpoint_dir(load, LAST) + ".tmp"
    os.makedirs(stale)
    open(os.path.join(stale, "common.pt"), "w").write("half a checkpoint")
    ((code, stderr),) = _mains([_resume_argv(load)])
    assert code == 0, stderr[-3000:]
    assert f"ignoring {stale}: a save that did not finish" in stderr
    assert f"resumed from {load} at iteration {LAST - 1}" in stderr
    assert not os.path.exists(stale) and os.path.isdir(checkpoint_dir(load, LAST))


def test_distributed_optimizer_reshards_over_dp_and_refuses_tp_pp(tmp_path):
    """Distributed-optimizer state saved at DP2 resumes at DP2 and DP1, saved at DP1 resumes
    at DP2, each equal to the one-process run; a TP or PP change, a switch between the
    distributed and the plain optimizer, or another vocabulary padding is refused (exit 2)
    with a message naming the flag."""
    from test_pretrain import TINY, _pretrain

    one = _pretrain(tmp_path / "one", "--train-iters", "4")  # plain optimizer, one process
    distributed = ["--train-iters", "4", "--use-distributed-optimizer"]
    _pretrain(tmp_path / "dp2", *distributed, "--exit-interval", "2", world_size=2)
    _pretrain(tmp_path / "dp1", *distributed, "--exit-interval", "2")
    for name in ("dp2_to_dp1", "dp2_refusals"):
        shutil.copytree(
            tmp_path / "dp2", tmp_path / name, ignore=shutil.ignore_patterns("metrics.jsonl")
        )
    resumed = [
        _pretrain(tmp_path / "dp2", *distributed, "--load", str(tmp_path / "dp2"), world_size=2),
        _pretrain(tmp_path / "dp2_to_dp1", *distributed, "--load", str(tmp_path / "dp2_to_dp1")),
        _pretrain(tmp_path / "dp1", *distributed, "--load", str(tmp_path / "dp1"), world_size=2),
    ]
    for losses in resumed:
        assert {k: losses[k] for k in (3, 4)} == pytest.approx(
            {k: one[k] for k in (3, 4)}, abs=2e-5
        )

    def argv(load, *flags):
        return [*TINY, "--train-iters", "4", "--save", str(load), "--load", str(load), *flags]

    refused = tmp_path / "dp2_refusals"
    two_ranks = [
        (argv(refused, "--use-distributed-optimizer", f"--{size}", "2"), f"pass --{size} 1")
        for size in ("tensor-model-parallel-size", "pipeline-model-parallel-size")
    ]
    one_rank = [
        (argv(refused), "with --use-distributed-optimizer"),
        (
            argv(tmp_path / "one", "--use-distributed-optimizer"),
            "without --use-distributed-optimizer",
        ),
        (
            argv(tmp_path / "one", "--make-vocab-size-divisible-by", "128"),
            "--make-vocab-size-divisible-by",
        ),
    ]
    results = [run_distributed(_w_mains, 2, [a], timeout=400)[0][0] for a, _ in two_ranks]
    results += _mains([a for a, _ in one_rank])
    for (_, expected), (code, stderr) in zip(two_ranks + one_rank, results):
        assert code == 2 and expected in stderr and "Traceback" not in stderr, stderr[-2000:]
