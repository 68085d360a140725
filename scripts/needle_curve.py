"""The varied-depth needle curve: does the main job learn to retrieve a key at any depth?

    python scripts/needle_curve.py --work-dir /tmp/needle-curve [--iters 2700] [--save-interval 900]
    python scripts/needle_curve.py --ceiling        # the induction-ceiling table only

A harness, not part of the package: it runs in a checkout with ``mcore_flash`` installed
(``pip install -e .``). Everything it measures goes through the real commands:

1. ``mcore-flash pretrain --synthetic-key-depth uniform`` (the main job, ``tiny`` preset,
   8 x 256 tokens, every other flag its default but ``--train-iters``, ``--save-interval`` and
   ``--log-interval 1``, so that ``metrics.jsonl`` holds every iteration's loss), the key of
   each document at a uniformly random depth (the needle evaluation's layout).
2. The untrained model: the same command at learning rate 0 (``--lr 0 --min-lr 0
   --lr-warmup-iters 0``) stopped after its first iteration (``--exit-interval 1``), whose
   checkpoint holds the initial weights unchanged (Adam's update is lr x ... = 0;
   ``tests/conversion/test_convert.py::lr0_step`` relies on the same). ``pretrain`` saves
   nothing before its first iteration. Its loss, the initial weights' on the first batch, must
   equal the trained run's first loss bit for bit (same seed, same weights, same batch): the
   harness checks it.
3. ``mcore-flash evaluate --task needle --lengths 256 --depths 0,0.25,0.5,0.75,1
   --num-samples 100 --needle-length K`` (K = the task's key, 16) of the untrained checkpoint
   and of every checkpoint the run saved, each loaded from a directory that names only it.

It prints one markdown table: per checkpoint the mean of the losses ``metrics.jsonl`` records
in the ``--window`` iterations up to it, the task's no-copy floor, and per depth the exact
retrieval and the token accuracy. Results are kept in ``--work-dir`` (``results.json``); a
second call resumes the run (``--load``) and skips what is done. Progress goes to stderr.

``--ceiling`` prints the exact-retrieval ceiling of an ideal n-token induction copier on
random keys (:func:`induction_ceiling`), the reason K = 16 needs more than a plain induction
head (docs/evaluate.md, "The varied-depth task").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy

from mcore_flash.checkpoint.directory import MARKER, checkpoint_dir
from mcore_flash.data.synthetic import make_task

SEQ_LENGTH = 256  # the tiny preset's, which the main job trains at
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
PLACEMENT = ("--synthetic-key-depth", "uniform")


def _log(text: str) -> None:
    print(f"[needle_curve {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _mcore_flash(*argv) -> list[str]:
    return [sys.executable, "-m", "mcore_flash.cli", *map(str, argv)]


def _pretrain(save: str, flags: tuple, every: int) -> float:
    """Run ``mcore-flash pretrain --save save --load save`` with ``flags``; relay every
    ``every``-th iteration line (and every other line) to stderr; returns the wall seconds."""
    command = _mcore_flash("pretrain", "--save", save, "--load", save, *PLACEMENT, *flags)
    _log("$ " + " ".join(command[2:]).replace("mcore_flash.cli", "mcore-flash", 1))
    start = time.monotonic()
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        for line in proc.stdout:
            words = line.split()
            if words[:1] == ["iteration"] and "/" in words[1]:
                if int(words[1].split("/")[0]) % every:
                    continue
            sys.stderr.write("    " + line)
            sys.stderr.flush()
    if proc.returncode:
        raise SystemExit(f"pretrain exited with {proc.returncode}")
    return time.monotonic() - start


def _evaluate(root: str, iteration: int, work: str, key_length: int, samples: int) -> dict:
    """``mcore-flash evaluate --task needle`` of checkpoint ``iteration`` of ``root``, loaded
    from a directory of its own (``--load`` takes the latest checkpoint of a directory)."""
    view = os.path.join(work, "views", f"{os.path.basename(root)}_{iteration}")
    os.makedirs(view, exist_ok=True)
    link = checkpoint_dir(view, iteration)
    if not os.path.islink(link):
        os.symlink(os.path.abspath(checkpoint_dir(root, iteration)), link)
    with open(os.path.join(view, MARKER), "w") as f:
        f.write(str(iteration))
    command = _mcore_flash(
        "evaluate",
        "--load",
        view,
        "--task",
        "needle",
        "--lengths",
        SEQ_LENGTH,
        "--depths",
        ",".join(f"{d:g}" for d in DEPTHS),
        "--num-samples",
        samples,
        "--needle-length",
        key_length,
        "--json",
    )
    _log(f"evaluating {root} iteration {iteration}")
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["iteration"] == iteration, result
    return result


def _window_loss(metrics: str, iteration: int, window: int) -> tuple[float, int]:
    """Mean of the losses ``metrics.jsonl`` records for iterations in (iteration - window,
    iteration], and how many there are."""
    with open(metrics) as f:
        records = [json.loads(line) for line in f if line.strip()]
    losses = [r["loss"] for r in records if iteration - window < r["iteration"] <= iteration]
    return float(numpy.mean(losses)), len(losses)


def _ms_per_iteration(metrics: str) -> float:
    with open(metrics) as f:
        times = [json.loads(line)["iteration_time_s"] for line in f if line.strip()]
    return 1000 * float(numpy.median(times))


def markdown(results: dict) -> str:
    """The table of ``results`` (what :func:`run` stores in ``results.json``)."""
    floor = results["floor"]
    head = " | ".join(f"depth {d:g}" for d in DEPTHS)
    lines = [
        f"| iteration | loss (mean of the last {results['window']}) | no-copy floor | {head} | mean exact |",
        "|---" * (4 + len(DEPTHS)) + "|",
    ]
    for row in results["rows"]:
        cells = row["cells"]
        assert [c["depth"] for c in cells] == list(DEPTHS)
        loss = "–" if row["loss"] is None else f"{row['loss']:.3f}"
        depth = " | ".join(f"{c['exact']:.2f} / {c['token_accuracy']:.3f}" for c in cells)
        mean = numpy.mean([c["exact"] for c in cells])
        label = f"{row['iteration']} ({row['label']})" if row.get("label") else row["iteration"]
        lines.append(f"| {label} | {loss} | {floor:.3f} | {depth} | {mean:.2f} |")
    return "\n".join(lines)


def run(args) -> dict:
    work = os.path.abspath(args.work_dir)
    os.makedirs(work, exist_ok=True)
    task = make_task(SEQ_LENGTH, key_depth="uniform")
    path = os.path.join(work, "results.json")
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    settings = dict(iters=args.iters, save_interval=args.save_interval, samples=args.num_samples)
    if results.get("settings", settings) != settings:
        raise SystemExit(
            f"{path} holds other settings ({results['settings']}); use another --work-dir"
        )
    results.update(
        settings=settings,
        window=args.window,
        floor=task.local_floor,
        perfect_floor=task.perfect_floor,
        key_length=task.key_length,
    )
    evaluated = results.setdefault("evaluated", {})

    def save():
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(path + ".tmp", path)

    flags = (
        "--train-iters",
        args.iters,
        "--save-interval",
        args.save_interval,
        "--log-interval",
        1,
    )
    untrained = os.path.join(work, "untrained")
    trained = os.path.join(work, "run")
    if "untrained" not in evaluated:
        _log(
            "the untrained model: the run's first iteration at learning rate 0 (its initial weights)"
        )
        at_lr_0 = ("--lr", 0, "--min-lr", 0, "--lr-warmup-iters", 0, "--exit-interval", 1)
        _pretrain(untrained, (*flags, *at_lr_0), every=1)
        evaluated["untrained"] = _evaluate(untrained, 1, work, task.key_length, args.num_samples)
        save()

    if "wall_s" not in results:
        _log(f"training {args.iters} iterations, a checkpoint every {args.save_interval}")
        results["wall_s"] = _pretrain(trained, flags, every=100)
        results["command"] = "mcore-flash pretrain --save RUN --load RUN " + " ".join(
            map(str, (*PLACEMENT, *flags))
        )
        save()
    metrics = os.path.join(trained, "metrics.jsonl")
    results["ms_per_iteration_median"] = _ms_per_iteration(metrics)
    checkpoints = sorted(
        int(name[len("iter_") :])
        for name in os.listdir(trained)
        if name.startswith("iter_") and name[len("iter_") :].isdigit()
    )
    for iteration in checkpoints:
        if str(iteration) not in evaluated:
            evaluated[str(iteration)] = _evaluate(
                trained, iteration, work, task.key_length, args.num_samples
            )
            save()

    loss0, _ = _window_loss(os.path.join(untrained, "metrics.jsonl"), 1, 1)
    first, _ = _window_loss(metrics, 1, 1)
    if loss0 != first:
        raise SystemExit(
            f"the lr-0 run's first loss {loss0} is not the run's {first}: not its initial weights"
        )
    rows = [
        dict(
            iteration=0,
            label="untrained",
            loss=loss0,
            cells=evaluated["untrained"]["cells"],
        )
    ]
    for iteration in checkpoints:
        loss, count = _window_loss(metrics, iteration, args.window)
        assert count == min(args.window, iteration), (iteration, count)
        rows.append(dict(iteration=iteration, loss=loss, cells=evaluated[str(iteration)]["cells"]))
    results["rows"] = rows
    save()
    return results


def induction_ceiling(key_length: int, context: int, trials: int, seed: int = 0) -> float:
    """Monte Carlo estimate of the exact-retrieval rate of an ideal ``context``-token induction
    copier on keys of ``key_length`` i.i.d. uniform letters: answer token ``j`` is predicted from
    the ``context`` tokens before it (the answer so far, ``?`` standing for ``@``) by copying the
    token that follows that context in ``@ key``, ties between different followers broken
    uniformly at random; a sample counts when all ``key_length`` tokens are right (teacher-forced,
    as the needle evaluation scores). Returns the mean over ``trials`` random keys of the
    probability that every step is right."""
    rng = numpy.random.default_rng([seed, key_length, context])
    total = 0.0
    for _ in range(trials):
        key = rng.integers(0, 26, key_length).tolist()
        seq = [-1] + key  # -1: the marker before the key (@) and before the answer (?)
        contexts = [tuple(seq[max(0, i + 1 - context) : i + 1]) for i in range(key_length)]
        p = 1.0
        for j in range(key_length):
            followers = [key[i] for i in range(key_length) if contexts[i] == contexts[j]]
            p *= followers.count(key[j]) / len(followers)
        total += p
    return total / trials


def ceiling_table(trials: int) -> str:
    lines = [
        "| K | 1-token context | 2-token context | 3-token context |",
        "|---|---|---|---|",
    ]
    for k in (4, 8, 16):
        rates = [induction_ceiling(k, n, trials) for n in (1, 2, 3)]
        lines.append(f"| {k} | " + " | ".join(f"{r:.3f}" for r in rates) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/needle_curve.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--work-dir", help="where the runs, evaluations and results.json go")
    parser.add_argument(
        "--iters", type=int, default=2700, help="training iterations (default 2700)"
    )
    parser.add_argument(
        "--save-interval",
        type=int,
        default=900,
        help="a checkpoint every N iterations (default 900)",
    )
    parser.add_argument("--num-samples", type=int, default=100, help="needle samples per depth")
    parser.add_argument(
        "--window", type=int, default=100, help="iterations the loss column averages (default 100)"
    )
    parser.add_argument(
        "--ceiling", action="store_true", help="print the induction-ceiling table only"
    )
    parser.add_argument(
        "--ceiling-trials", type=int, default=20000, help="random keys per ceiling cell"
    )
    args = parser.parse_args(argv)
    if args.ceiling:
        print(ceiling_table(args.ceiling_trials))
        return 0
    if not args.work_dir:
        parser.error("--work-dir is required (or --ceiling)")
    results = run(args)
    print(markdown(results))
    print(
        f"\n{args.iters} iterations in {results['wall_s']:.0f} s of wall time, median "
        f"{results['ms_per_iteration_median']:.0f} ms/iteration; floors: no-copy "
        f"{results['floor']:.3f}, perfect copy {results['perfect_floor']:.3f} nats/token"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
