"""The fault drill: kill a training run at every fault point, resume it, compare it bit for bit.

    python scripts/fault_drill.py --work-dir /tmp/drill [--write docs/fault-tolerance.md] [--fsdp]

A CI harness, not part of the package: it runs in a checkout with ``mcore_flash`` installed
(``pip install -e .``); ``tests/training/test_fault_tolerance.py`` imports it from this directory.

A tiny model trains for 12 iterations on 2 CPU ranks under ``torchrun`` (data parallel, the
distributed optimizer, dropout 0.1, a checkpoint every iteration). One run is never
interrupted. The other is a chain of launches on one ``--save`` directory: each launch
resumes with ``--load`` and is killed (SIGKILL, :mod:`mcore_flash.faults`) at the
next point of :data:`CHAIN`, until a last launch finishes. After every kill the tracker
must name a checkpoint whose files equal the uninterrupted run's of that iteration, and
the checkpoints written after each resume must equal the uninterrupted run's, byte for
byte: weights, optimizer state, scheduler, counters, every rank's RNG states. Only DCP's
``.metadata`` index is left out of the comparison (it records the directory's path) and
our ``manifest.json`` (it hashes that index). The comparison hashes the files itself.

A full disk is real: the run's ``--save`` is a tmpfs (in a private mount namespace:
``unshare -m``, root) that holds one checkpoint, so the second save fails with ENOSPC;
after the tmpfs is enlarged, the run resumes. Each outcome is one row of the table in
``docs/fault-tolerance.md`` (:func:`markdown`).

``--fsdp`` runs the same drill with ``--use-megatron-fsdp`` (ZeRO-3, ``fsdp_dtensor``
checkpoints) instead of the distributed optimizer: every point of :data:`CHAIN`, no
disk-full row (its table is the second one in the doc).
``--async-save`` runs it with checkpoints written in the background: kills while a write is
in flight, in the writer itself and in the publishing after it (:data:`ASYNC_DRILL`, the
third table).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from typing import NamedTuple, Optional

from mcore_flash import faults
from mcore_flash.checkpoint.directory import MARKER, checkpoint_dir


def _tests_module(name: str):
    """``tests/_support/<name>.py`` of this checkout (the drill runs in one), loaded by its path:
    the drill's model is the tests' tiny model (:mod:`pretrain_flags`, standard library only)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(root, "tests", "_support", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pretrain_flags = _tests_module("pretrain_flags")

ITERATIONS = 12
# (point, iteration, rank): each kill lands after the previous resume has made progress
CHAIN = (
    ("forward", 2, 0),
    ("backward", 3, 1),
    ("grad-reduce", 4, 1),
    ("optimizer-step", 5, 0),
    ("save-begin", 6, 1),
    ("save-shards", 7, 1),
    ("save-rng", 8, 0),
    ("save-manifest", 9, 0),
    ("save-renamed", 10, 0),
    ("save-tracker", 11, 0),
)
FLAGS = (
    *pretrain_flags.tiny_flags(vocab_multiple=None),
    "--train-iters",
    str(ITERATIONS),
    "--save-interval",
    "1",
    "--use-distributed-optimizer",
    "--attention-dropout",
    "0.1",
    "--hidden-dropout",
    "0.1",
)
# ZeRO-3 (Megatron-FSDP, fsdp_dtensor checkpoints): the drill's model, data and chain
FSDP_FLAGS = tuple(
    "--use-megatron-fsdp" if flag == "--use-distributed-optimizer" else flag for flag in FLAGS
)
NOT_COMPARED = (".metadata", "manifest.json")
DOCS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "fault-tolerance.md"
)
_TOKEN = "MCORE_FLASH_DRILL_LAUNCH"  # marks every process of one launch


class Drill(NamedTuple):
    """One drill: the pretrain flags, the chain of kills, the iterations the runs train."""

    flags: tuple
    chain: tuple
    iterations: int
    begin: str  # the markers of its table in the doc
    end: str


class Row(NamedTuple):
    fault: str  # point@iteration:rank, or the disk-full case
    where: str
    killed: bool  # the launch died at that point (non-zero exit, the point's message)
    tracker: Optional[int]  # what latest_checkpointed_iteration.txt said afterwards
    tracker_complete: bool  # that checkpoint equals the uninterrupted run's
    resumed_from: Optional[int]  # what the next launch said it resumed from (0: from scratch)
    equal_after: bool  # every checkpoint the next launch wrote equals the uninterrupted run's

    @property
    def ok(self) -> bool:
        return (
            self.killed
            and self.tracker_complete
            and self.equal_after
            and self.resumed_from == (self.tracker or 0)
        )


def run_uninterrupted(reference: str, drill: Optional[Drill] = None) -> str:
    """The reference run into ``reference`` (its ``--save``); returns ``reference``."""
    code, output = launch(reference, drill=drill)
    if code != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{output[-3000:]}")
    return reference


def run_drill(
    work_dir: str,
    reference: Optional[str] = None,
    disk_full: bool = True,
    log=print,
    drill: Optional[Drill] = None,
) -> list[Row]:
    """The chain of kills and the full disk, one row each, against ``reference`` (a run of
    :func:`run_uninterrupted`; made under ``work_dir`` when not given)."""
    drill = drill or DRILL
    reference = reference or run_uninterrupted(os.path.join(work_dir, "uninterrupted"), drill)
    kills = drill.chain
    chain = os.path.join(work_dir, "chain")
    logs = os.path.join(
        work_dir, "launches"
    )  # each launch's output, kept: a failed row names its two
    os.makedirs(logs, exist_ok=True)
    rows = []
    killed_log = _launch_log(logs, 0, _spec(*kills[0]))
    code, output = launch(chain, fault=_spec(*kills[0]), load=True, log=killed_log, drill=drill)
    if "starting from scratch" not in output:  # --load of an empty directory
        raise RuntimeError(f"the first launch did not start from scratch:\n{output[-3000:]}")
    for index, (point, iteration, rank) in enumerate(kills):
        killed = (
            code != 0
            and f"fault injection: SIGKILL at {point}, iteration {iteration}, rank {rank}" in output
        )
        tracker = _tracker(chain)
        complete = tracker is None or same_files(
            checkpoint_dir(chain, tracker), checkpoint_dir(reference, tracker)
        )
        following = _spec(*kills[index + 1]) if index + 1 < len(kills) else None
        next_log = _launch_log(logs, index + 1, following)
        code, output = launch(chain, fault=following, load=True, log=next_log, drill=drill)
        resumed = _resumed_from(output)
        written = [
            i for i in _checkpoints(chain) if i > (resumed or 0)
        ]  # renamed into place, tracked or not
        equal = len(written) > 0 and all(
            same_files(checkpoint_dir(chain, i), checkpoint_dir(reference, i)) for i in written
        )
        rows.append(
            Row(
                _spec(point, iteration, rank),
                faults.KILL_POINTS[point],
                killed,
                tracker,
                complete,
                resumed,
                equal,
            )
        )
        log(
            f"fault drill: {rows[-1].fault}: "
            + ("ok" if rows[-1].ok else f"FAILED (see {killed_log}, {next_log})")
        )
        killed_log = next_log
    if code != 0 or _tracker(chain) != drill.iterations:
        raise RuntimeError(f"the last launch of the chain did not finish:\n{output[-3000:]}")
    if disk_full:
        rows.append(_disk_full(work_dir, reference))
        log(f"fault drill: disk full: {'ok' if rows[-1].ok else 'FAILED'}")
    return rows


def failures(rows: list[Row], work_dir: str) -> list[str]:
    """The rows of a :func:`run_drill` into ``work_dir`` that are not ok, each with the end of
    its two launches' output (the launch killed at the row's point, and the next one)."""
    logs = sorted(os.listdir(os.path.join(work_dir, "launches")))
    chain = [row for row in rows if not row.fault.startswith("disk full")]
    return [
        f"{row}\n"
        + "\n".join(
            f"{name}: ...{_read(os.path.join(work_dir, 'launches', name))[-2000:]}"
            for name in logs[index : index + 2]
        )
        for index, row in enumerate(chain)
        if not row.ok
    ]


def documented_table(drill: Drill, path: str = DOCS) -> str:
    """The drill's table as ``path`` (docs/fault-tolerance.md) holds it, between its markers."""
    with open(path) as f:
        return f.read().split(drill.begin)[1].split(drill.end)[0].strip()


def launch(
    save: str,
    fault: Optional[str] = None,
    load: bool = False,
    extra: tuple = (),
    log: Optional[str] = None,
    drill: Optional[Drill] = None,
    torchrun_flags: tuple = (),
) -> tuple[int, str]:
    """``torchrun`` 2 CPU ranks of ``mcore_flash.pretrain`` with ``drill``'s flags (and
    ``torchrun_flags``, torchrun's own); returns (exit code, stdout + stderr), which ``log``
    (a file path) keeps."""
    env = _environment(fault)
    with open(log, "w+") if log else tempfile.TemporaryFile("w+") as output:
        try:
            code = subprocess.run(
                _torchrun_command(save, load, extra, drill, torchrun_flags),
                stdout=output,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=600,
            ).returncode
        finally:
            _kill_leftovers(env[_TOKEN])
        output.seek(0)
        return code, output.read()


def _kill_leftovers(token: str) -> None:
    """SIGKILL what a launch left running. megatron's checkpoint writer starts a helper
    process (a ``multiprocessing`` manager); a rank killed by SIGKILL cannot stop it, so it
    lives on, holding the launch's output pipes. Found by the token in its environment."""
    mark = f"{_TOKEN}={token}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue  # gone already, or not ours


def same_files(one: str, other: str) -> bool:
    """Both checkpoint directories hold the same files with the same bytes (but
    :data:`NOT_COMPARED`), hashed here, not read from their manifests."""
    if not (os.path.isdir(one) and os.path.isdir(other)):
        return False
    digests = [_digests(one), _digests(other)]
    return digests[0] == digests[1] and len(digests[0]) > 0


def can_fill_a_disk() -> bool:
    """Whether the disk-full row can run here: it needs ``unshare -m`` and a tmpfs mount,
    which need root (tried in a throw-away mount namespace, on a throw-away directory)."""
    with tempfile.TemporaryDirectory() as probe:
        try:
            subprocess.run(
                ["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe],
                check=True,
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):
            return False
    return True


NO_DISK_FULL = (
    "the disk-full row needs root (unshare -m and a tmpfs mount, refused here): skipped; "
    "every other row ran. Run the drill as root for the whole table"
)


def _disk_full(work_dir: str, reference: str) -> Row:
    """Train with ``--save-interval 2`` on a tmpfs that holds one checkpoint: the save of
    iteration 4 fails with ENOSPC (killed there: exit code 1, the message names the full
    disk and the intact checkpoint, and no partial ``.tmp`` directory is left); enlarge the
    tmpfs and resume."""
    out = os.path.join(work_dir, "disk_full")
    os.makedirs(out)
    data = _bytes(os.path.join(reference, "data"))
    one_checkpoint = _bytes(checkpoint_dir(reference, 2))
    size_kib = (data + one_checkpoint * 3 // 2 + (256 << 10)) // 1024
    mount_point = os.path.join(out, "tmpfs")
    os.makedirs(mount_point)
    extra = ("--save-interval", "2")
    script = "\n".join(
        [
            "set -u",
            f"mount -t tmpfs -o size={size_kib}k tmpfs {mount_point}",
            f"{shlex.join(_torchrun_command(mount_point, False, extra))} > {out}/first.log 2>&1; echo $? > {out}/first.code",
            f"cat {mount_point}/{MARKER} > {out}/tracker 2>/dev/null",
            f"ls -a {mount_point} > {out}/after_failure.ls",
            f"mount -o remount,size=1g {mount_point}",
            f"{shlex.join(_torchrun_command(mount_point, True, extra))} > {out}/second.log 2>&1; echo $? > {out}/second.code",
            f"cp -a {mount_point}/. {out}/after/",
            f"umount {mount_point}",
        ]
    )
    env = _environment(None)
    try:
        subprocess.run(["unshare", "-m", "bash", "-c", script], check=True, timeout=1200, env=env)
    finally:
        _kill_leftovers(env[_TOKEN])
    first, second = (_read(os.path.join(out, name)) for name in ("first.log", "second.log"))
    tracker_text = _read(os.path.join(out, "tracker")).strip()
    tracker = int(tracker_text) if tracker_text.isdigit() else None
    partial_left = any(
        name.endswith(".tmp") for name in _read(os.path.join(out, "after_failure.ls")).split()
    )
    killed = (
        _read(os.path.join(out, "first.code")).strip() == "1"
        and "No space left on device" in first
        and f"the checkpoint of iteration {tracker} is intact" in first
        and not partial_left
    )
    after = os.path.join(out, "after")
    complete = tracker is not None and same_files(
        checkpoint_dir(after, tracker), checkpoint_dir(reference, tracker)
    )
    resumed = _resumed_from(second)
    finished = _read(os.path.join(out, "second.code")).strip() == "0"
    written = range((resumed or 0) + 2, ITERATIONS + 1, 2)
    equal = finished and all(
        same_files(checkpoint_dir(after, i), checkpoint_dir(reference, i)) for i in written
    )
    where = "the save of iteration 4 on a tmpfs that holds one checkpoint (ENOSPC), then the tmpfs enlarged"
    return Row("disk full@4", where, killed, tracker, complete, resumed, equal)


def _torchrun_command(
    save: str, load: bool, extra: tuple, drill: Optional[Drill] = None, torchrun_flags: tuple = ()
) -> list[str]:
    """torchrun's ``--standalone``: its store binds a free port itself (a port picked here and
    bound by torchrun seconds later could be taken in between, and the launch fail)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--local-addr",
        "127.0.0.1",
        "--nproc-per-node",
        "2",
        *torchrun_flags,
        "-m",
        "mcore_flash.pretrain",
        *(drill or DRILL).flags,
        *extra,
        "--save",
        save,
    ]
    return command + (["--load", save] if load else [])


def _environment(fault: Optional[str]) -> dict:
    env = {key: value for key, value in os.environ.items() if key != faults.ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **{_TOKEN: uuid.uuid4().hex})
    if fault:
        env[faults.ENV] = fault
    return env


def _launch_log(logs: str, number: int, fault: Optional[str]) -> str:
    """``logs/NN-POINT@ITERATION:RANK.log`` (``NN-no-fault.log`` for the launch that finishes)."""
    return os.path.join(logs, f"{number:02d}-{fault or 'no-fault'}.log")


def _spec(point: str, iteration: int, rank: int) -> str:
    return f"{point}@{iteration}:{rank}"


def _tracker(save: str) -> Optional[int]:
    path = os.path.join(save, MARKER)
    text = _read(path).strip() if os.path.exists(path) else ""
    return int(text) if text.isdigit() else None


def _checkpoints(save: str) -> list[int]:
    """The iterations of the finished (renamed) checkpoint directories under ``save``."""
    return sorted(int(name[5:]) for name in os.listdir(save) if re.fullmatch(r"iter_\d{7}", name))


def _resumed_from(output: str) -> Optional[int]:
    """The iteration a launch said it resumed from; 0 when it started from scratch."""
    if "starting from scratch" in output:
        return 0
    found = re.search(r"resumed from \S+ at iteration (\d+)", output)
    return int(found.group(1)) if found else None


def _digests(directory: str) -> dict[str, str]:
    result = {}
    for name in sorted(os.listdir(directory)):
        if name not in NOT_COMPARED:
            with open(os.path.join(directory, name), "rb") as f:
                result[name] = hashlib.sha256(f.read()).hexdigest()
    return result


def _bytes(directory: str) -> int:
    """Bytes of every file under ``directory``, each rounded up to whole 4 KiB pages (tmpfs)."""
    total = 0
    for root, _, files in os.walk(directory):
        total += sum(-(-os.path.getsize(os.path.join(root, name)) // 4096) * 4096 for name in files)
    return total


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


COLUMNS = (
    "fault (point@iteration:rank)",
    "where the rank dies",
    "killed there",
    "tracker after",
    "tracker's checkpoint complete",
    "next launch resumed from",
    "checkpoints after the resume bit-equal",
)


def markdown(rows: list[Row]) -> str:
    """The table: one row per fault, every cell measured by :func:`run_drill`."""

    def yes(value: bool) -> str:
        return "yes" if value else "**no**"

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        resumed = "scratch" if row.resumed_from == 0 else row.resumed_from
        cells = (
            f"`{row.fault}`",
            row.where,
            yes(row.killed),
            row.tracker if row.tracker is not None else "none",
            yes(row.tracker_complete),
            resumed,
            yes(row.equal_after),
        )
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


BEGIN, END = "<!-- fault-table:begin -->", "<!-- fault-table:end -->"
DRILL = Drill(FLAGS, CHAIN, ITERATIONS, BEGIN, END)
FSDP_DRILL = Drill(
    FSDP_FLAGS,
    CHAIN,
    ITERATIONS,
    "<!-- fault-table-fsdp:begin -->",
    "<!-- fault-table-fsdp:end -->",
)
# the optimizer offload (megatron's HybridDeviceOptimizer: Adam state and step on the host) on the
# emulated NPU (the CPU path has no device to offload from), bf16 parameters as it requires:
# every point of the chain
OFFLOAD_DRILL = Drill(
    (
        *FLAGS,
        "--emulate-npu",
        "--bf16",
        "--use-precision-aware-optimizer",
        "--optimizer-cpu-offload",
    ),
    CHAIN,
    ITERATIONS,
    "<!-- fault-table-offload:begin -->",
    "<!-- fault-table-offload:end -->",
)
# torch FSDP2 with its host offload (--use-torch-fsdp2 --fsdp2-offload-to-cpu: weights,
# gradients and Adam state on the host) on the emulated NPU (the CPU path refuses the offload):
# every point of the chain
FSDP2_DRILL = Drill(
    (
        *(flag for flag in FLAGS if flag != "--use-distributed-optimizer"),
        "--emulate-npu",
        "--use-torch-fsdp2",
        "--fsdp2-offload-to-cpu",
    ),
    CHAIN,
    ITERATIONS,
    "<!-- fault-table-fsdp2:begin -->",
    "<!-- fault-table-fsdp2:end -->",
)
# --async-save: kills while a background write is in flight (the model points of the iteration
# after a save, whose writer may still be running), in the background writer itself, and in the
# publishing that follows it. Spaced so that each resumed launch publishes a checkpoint before
# its kill (a save is published at the latest when the next save starts)
ASYNC_DRILL = Drill(
    (*FLAGS, "--async-save"),
    (
        ("forward", 2, 0),
        ("save-scheduled", 4, 1),
        ("save-writing", 6, 0),
        ("backward", 8, 1),
        ("save-manifest", 9, 0),
        ("save-renamed", 10, 0),
        ("save-tracker", 11, 0),
    ),
    ITERATIONS,
    "<!-- fault-table-async:begin -->",
    "<!-- fault-table-async:end -->",
)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/fault_drill.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--work-dir", required=True, help="an empty or missing directory for the runs"
    )
    parser.add_argument(
        "--write",
        default=None,
        help="replace the table between the fault-table markers of this file",
    )
    parser.add_argument(
        "--no-disk-full", action="store_true", help="skip the tmpfs case (it needs root)"
    )
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument(
        "--fsdp",
        action="store_true",
        help="the drill with --use-megatron-fsdp (its chain, no disk-full row, its own table)",
    )
    kind.add_argument(
        "--async-save",
        action="store_true",
        help="the drill with --async-save (its own chain and table, no disk-full row)",
    )
    kind.add_argument(
        "--offload",
        action="store_true",
        help="the drill with --optimizer-cpu-offload on the emulated NPU (its own table, no disk-full row)",
    )
    kind.add_argument(
        "--fsdp2",
        action="store_true",
        help="the drill with --use-torch-fsdp2 --fsdp2-offload-to-cpu on the emulated NPU (its own "
        "table, no disk-full row)",
    )
    args = parser.parse_args(argv)
    chosen = [
        (args.fsdp, FSDP_DRILL),
        (args.async_save, ASYNC_DRILL),
        (args.offload, OFFLOAD_DRILL),
    ]
    chosen.append((args.fsdp2, FSDP2_DRILL))
    drill = next((drill for asked, drill in chosen if asked), DRILL)
    if os.path.exists(args.work_dir) and os.listdir(args.work_dir):
        parser.error(f"--work-dir {args.work_dir} is not empty")
    disk_full = not (args.no_disk_full or drill is not DRILL)
    if disk_full and not can_fill_a_disk():
        if args.write:
            parser.error(
                f"--write: {NO_DISK_FULL.split(': ')[0]}; add --no-disk-full to print the rest"
            )
        print(f"fault drill: {NO_DISK_FULL}", file=sys.stderr)
        disk_full = False
    rows = run_drill(
        args.work_dir,
        disk_full=disk_full,
        log=lambda line: print(line, file=sys.stderr),
        drill=drill,
    )
    table = markdown(rows)
    print(table)
    if args.write:
        with open(args.write) as f:
            text = f.read()
        if drill.begin not in text or drill.end not in text:
            parser.error(
                f"--write {args.write}: add the lines {drill.begin} and {drill.end} where the table goes"
            )
        head, rest = text.split(drill.begin, 1)
        with open(args.write, "w") as f:
            f.write(f"{head}{drill.begin}\n{table}\n{drill.end}{rest.split(drill.end, 1)[1]}")
    if not all(row.ok for row in rows):
        print(
            f"fault drill: kept {args.work_dir} (each launch's output: launches/)", file=sys.stderr
        )
        return 1
    shutil.rmtree(args.work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
