"""`mcore-flash evaluate`: needle retrieval and loss by position of real checkpoints.

Oracles: the main job's checkpoint (trained here with the README's command) must retrieve
the key at the trained length and gap, a model that has not trained must score at chance;
`mcore-flash generate`'s greedy decoding decides, sample by sample, what one teacher-forced
pass scores; megatron's own cross-entropy (`GPTModel(..., labels=...)`) gives the per-token
losses; TP2, CP2 and PP2 must reproduce TP1's numbers (but near-tie argmaxes); the PNGs are
read back by matplotlib.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import numpy as np
import pytest
import torch

from _support.dist_utils import run_distributed

# The main job trains 1000 steps: CI's Python 3.12 job leaves this file out (tests/conftest.py: slow);
# evaluate's megatron calls (load_weights, GPTModel's forward under TP/PP/CP) run there in
# tests/conversion/test_convert.py's generate tests and the trainer's tests.
pytestmark = pytest.mark.slow


def _w_main(rank, world_size, module, argv):
    import importlib

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = importlib.import_module(module).main(argv)
    return code, out.getvalue(), err.getvalue()


def _run(module, argv, world_size=1, threads=1):
    results = run_distributed(
        _w_main, world_size, module, [*map(str, argv)], timeout=400, threads=threads
    )
    assert [r[0] for r in results] == [0] * world_size, results[0][2][-3000:]
    return results[0]


def _evaluate(load, *argv, world_size=1) -> dict:
    return json.loads(
        _run("mcore_flash.evaluation.cli", ["--load", load, *argv, "--json"], world_size)[1]
    )


@pytest.fixture(scope="module")
def main_job_run(tmp_path_factory) -> tuple[str, str]:
    """The README's main job (`mcore-flash pretrain`: tiny, 1000 steps of 8 x 256 tokens):
    (its --save directory, its stdout and stderr)."""
    save = str(tmp_path_factory.mktemp("main_job"))
    _, out, err = _run(
        "mcore_flash.pretrain", ["--save", save], threads=2
    )  # both cores, as the README's command runs
    return save, out + err


@pytest.fixture(scope="module")
def main_job(main_job_run) -> str:
    return main_job_run[0]


def test_main_job_learns_the_long_range_copy_as_the_readme_says(main_job_run):
    """Oracle: the task's analytic floors (tests/data/test_data.py): below 2.386 nats/token only a
    model that copies the key 238 tokens back, 2.182 for perfect copying. Also the figures of
    the README and docs/pretrain.md: 467,584 parameters, 5.92 -> 2.18, on the local floor's
    plateau at step 100 and copying by step 300. The steps between are not asserted: the run is deterministic on one
    machine, but CPUs whose kernels differ move them (2.24 and 2.27 at step 200 on two of ours)."""
    from mcore_flash.data.synthetic import make_task

    save, log = main_job_run
    task = make_task(256)
    assert "training tiny (2 layers, hidden 128): 467,584 parameters" in log
    first, last = map(
        float, re.search(r"done: 1000 iterations, loss ([\d.]+) -> ([\d.]+)", log).groups()
    )
    assert (round(first, 2), round(last, 2)) == (5.92, 2.18)
    with open(f"{save}/metrics.jsonl") as f:
        loss = {r["iteration"]: r["loss"] for r in map(json.loads, f)}
    assert (
        task.local_floor < loss[100] < task.local_floor + 0.05
    )  # not yet attending 238 tokens back
    assert loss[300] < task.local_floor  # copying
    assert task.perfect_floor < loss[1000] < task.perfect_floor + 0.01 < task.local_floor


@pytest.fixture(scope="module")
def untrained(tmp_path_factory) -> str:
    """The same model after one step at lr 1e-12: its random initialisation."""
    save = str(tmp_path_factory.mktemp("untrained"))
    _run(
        "mcore_flash.pretrain",
        ["--save", save, "--train-iters", "1", "--lr", "1e-12", "--min-lr", "1e-13"],
    )
    return save


def test_main_job_retrieves_the_needle_at_the_trained_length_and_gap_only(main_job, untrained):
    """The README's grid (lengths 128, 256, 512; depths 0-1; 100 samples a cell): every key at
    length 256, depth 0 (gap 238 = the training task's), none anywhere else."""
    grid = _evaluate(
        main_job, "--task", "needle", "--lengths", "128,256,512", "--max-position-embeddings", "512"
    )
    cells = {(c["length"], c["depth"]): c for c in grid["cells"]}
    assert len(cells) == 15 and {c["samples"] for c in cells.values()} == {100}
    assert {key: c["exact"] for key, c in cells.items()} == {
        key: float(key == (256, 0.0)) for key in cells
    }
    # a model that cannot have learned the key scores at chance: 26**-16 exact, <= 1/26 per
    # token in expectation (1600 key tokens: 4 standard deviations above it is still chance)
    chance = _evaluate(untrained, "--task", "needle", "--depths", "0,1", "--num-samples", "100")
    bound = 1 / 26 + 4 * math.sqrt((1 / 26) * (25 / 26) / 1600)
    for cell in chance["cells"]:
        assert cell["exact"] == 0.0
        assert cell["token_accuracy"] <= bound


def _w_teacher_forced_vs_greedy(rank, world_size, load, depth):
    """Per sample: (one teacher-forced pass says 'retrieved', greedy decoding retrieves)."""
    from mcore_flash.evaluation.model_runner import LoadedModel
    from mcore_flash.evaluation.needle import digit_filler, needle_samples, score_needles
    from mcore_flash.generate import decode
    from mcore_flash.runtime.arguments import parse_args
    from mcore_flash.runtime.distributed import init_distributed

    args = parse_args(["--load", load, "--use-checkpoint-args"])
    init_distributed(args)
    model = LoadedModel(args)
    rng = np.random.default_rng(7)
    tokens, mask = needle_samples(256, depth, 16, digit_filler(rng, 12, 256 - 36), rng)
    pairs = []
    for row, row_mask in zip(tokens, mask):
        scored, _ = score_needles(model, row[None], row_mask[None])
        prompt = row[: 256 - 16 - 1].tolist()  # up to and including '?'
        greedy = decode(model.model, prompt, 16, model.vocab_size, kv_cache=False)
        pairs.append((scored == 1, greedy == row[len(prompt) : len(prompt) + 16].tolist()))
    return pairs


@pytest.mark.parametrize("depth", [0.0, 1.0])
def test_one_teacher_forced_pass_scores_exactly_what_greedy_decoding_retrieves(main_job, depth):
    (pairs,) = run_distributed(_w_teacher_forced_vs_greedy, 1, main_job, depth, timeout=300)
    assert all(scored == greedy for scored, greedy in pairs)
    # depth 0 is the trained layout (all retrieved), depth 1 an untrained gap (none): both branches seen
    assert {greedy for _, greedy in pairs} == ({True} if depth == 0.0 else {False})


def _w_losses_against_megatron(rank, world_size, load):
    from mcore_flash.data.synthetic import generate_documents, make_task
    from mcore_flash.evaluation.model_runner import LoadedModel
    from mcore_flash.runtime.arguments import parse_args
    from mcore_flash.runtime.distributed import init_distributed

    args = parse_args(["--load", load, "--use-checkpoint-args"])
    init_distributed(args)
    model = LoadedModel(args)
    tokens = torch.from_numpy(generate_documents(make_task(256), 4, seed=99))
    labels = torch.roll(tokens, -1, dims=1)
    _, ours = model.predict(tokens, labels)
    with torch.no_grad():
        positions = torch.arange(256).expand(4, 256)
        megatron = model.model(
            tokens, positions, None, labels=labels
        ).float()  # [b, s] per-token loss
    return ours, megatron


def test_per_token_losses_equal_megatrons_cross_entropy(main_job):
    ((ours, megatron),) = run_distributed(_w_losses_against_megatron, 1, main_job, timeout=300)
    # megatron's log(sum exp) - logit cancels where the loss is ~0: fp32 rounding of logits ~ 50
    torch.testing.assert_close(ours, megatron, rtol=1e-5, atol=1e-4)


def test_loss_by_position_table_and_plot(main_job, tmp_path, capsys):
    import matplotlib.image

    from mcore_flash.data.synthetic import make_task

    png = tmp_path / "loss.png"
    result = _evaluate(main_job, "--task", "loss-by-position", "--num-samples", "40", "--plot", png)
    buckets = result["buckets"]
    assert [(b["start"], b["end"]) for b in buckets] == [
        (0, 1),
        (1, 2),
        (2, 4),
        (4, 8),
        (8, 16),
        (16, 32),
        (32, 64),
        (64, 128),
        (128, 256),
    ]
    assert (
        sum(b["tokens"] for b in buckets) == 40 * 255
    )  # the last label belongs to the next document
    # the copy task's expected loss per position is known: digits log 10, key letters log 26,
    # answers ~0 for a model that copies; the late bucket holds the answers
    task = make_task(256)
    late = buckets[-1]
    digits = (
        task.query_position - 129
    )  # labels at positions 129..255: digits up to '?', then '?', key, eod
    assert late["loss"] == pytest.approx(digits * math.log(10) / 127, rel=0.05)
    assert buckets[-3]["loss"] == pytest.approx(
        math.log(10), rel=0.01
    )  # positions 32..63: digits only
    image = matplotlib.image.imread(str(png))
    assert image.shape[:2] == (400, 640)
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 50


def _same_cells_but_near_ties(
    ours: list[dict], theirs: list[dict], samples: int, key_length: int
) -> None:
    """The layouts sum in other orders (the losses agree to 1e-5): an argmax between two
    letters within rounding may flip, one key token of the grid, no more."""

    def grid(cells):
        return [(c["length"], c["depth"], c["samples"]) for c in cells]

    assert grid(ours) == grid(theirs)
    flipped = sum(
        abs(a["token_accuracy"] - b["token_accuracy"]) * samples * key_length
        for a, b in zip(ours, theirs)
    )
    assert round(flipped, 6) <= 1 and all(
        abs(a["exact"] - b["exact"]) * samples <= 1 for a, b in zip(ours, theirs)
    )


def test_tp2_cp2_and_pp2_give_tp1s_numbers(main_job):
    needle = [
        "--task",
        "needle",
        "--depths",
        "0,1",
        "--num-samples",
        "20",
        "--eval-batch-size",
        "10",
        "--needle-length",
        "16",
    ]
    losses = ["--task", "loss-by-position", "--num-samples", "10"]
    reference = _evaluate(main_job, *needle), _evaluate(main_job, *losses)
    assert (
        0 < reference[0]["cells"][1]["token_accuracy"] < 1
    )  # a cell where the numbers are not trivial
    # TP2 pads the 257-token vocabulary to a multiple of 64 x 2 = 384 rows, as the checkpoint has
    for layout in (
        ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
        ["--context-parallel-size", "2"],
        ["--pipeline-model-parallel-size", "2"],
    ):
        cells = _evaluate(main_job, *needle, *layout, world_size=2)["cells"]
        _same_cells_but_near_ties(cells, reference[0]["cells"], samples=20, key_length=16)
        buckets = _evaluate(main_job, *losses, *layout, world_size=2)["buckets"]
        for ours, theirs in zip(buckets, reference[1]["buckets"]):
            assert ours["tokens"] == theirs["tokens"]
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6), layout


def test_needle_heatmap_is_a_real_png(main_job, tmp_path):
    import matplotlib.image

    png = tmp_path / "needle.png"
    _evaluate(
        main_job,
        "--task",
        "needle",
        "--lengths",
        "128,256",
        "--depths",
        "0,0.5,1",
        "--num-samples",
        "10",
        "--plot",
        png,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(str(png))
    rgb = (image[..., :3] * 255).round()
    green = (rgb[..., 1] > 90) & (rgb[..., 0] < 40)  # RdYlGn at 1.0: the retrieved cell
    red = (rgb[..., 0] > 140) & (rgb[..., 1] < 40)  # RdYlGn at 0.0: the others
    # one retrieved cell of six (length 256, depth 0: bottom left), five cells at 0
    assert green.sum() > 1000 and 4 < red.sum() / green.sum() < 6
    green_rows, green_cols = np.nonzero(green)
    red_rows, red_cols = np.nonzero(red)
    assert np.median(green_rows) > np.median(red_rows) and np.median(green_cols) < np.median(
        red_cols
    )


def _evaluate_error(*argv) -> str:
    from mcore_flash.evaluation.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([*map(str, argv)]) == 2
    return err.getvalue()


def test_bad_input_errors_name_the_flag(main_job, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "--load" in _evaluate_error("--load", empty, "--task", "needle")
    assert "no latest_checkpointed_iteration.txt" in _evaluate_error(
        "--load", empty, "--task", "needle"
    )
    beyond = _evaluate_error("--load", main_job, "--task", "needle", "--lengths", "512")
    assert (
        "--lengths 512 is beyond the model's 256 positions" in beyond
        and "--use-rope-scaling" in beyond
    )
    short = _evaluate_error("--load", main_job, "--task", "needle", "--lengths", "32")
    assert "--needle-length 16 takes 36 tokens" in short and "longer than the haystack" in short
    assert "--depths" in _evaluate_error(
        "--load", main_job, "--task", "needle", "--depths", "0,1.5"
    )
    assert "--num-samples" in _evaluate_error(
        "--load", main_job, "--task", "needle", "--num-samples", "0"
    )
    tokenizer = _evaluate_error(
        "--load", main_job, "--task", "needle", "--tokenizer-type", "GPT2BPETokenizer"
    )
    assert (
        "--tokenizer-type GPT2BPETokenizer is not supported" in tokenizer
        and "--task loss-by-position" in tokenizer
    )
    depth = ["--synthetic-key-depth", "uniform"]  # the built-in documents of loss-by-position only
    assert "--synthetic-key-depth" in _evaluate_error(
        "--load", main_job, "--task", "needle", *depth
    )
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it: the layout's own check is reached
    cp2 = ["--context-parallel-size", "2", "--lengths", "250"]
    assert "--lengths 250 must be divisible by 4" in _evaluate_error(
        "--load", main_job, "--task", "needle", *cp2
    )
    tp2_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--lengths", "255"]
    assert "--lengths 255 must be divisible by 2" in _evaluate_error(
        "--load", main_job, "--task", "needle", *tp2_sp
    )


def test_lengths_beyond_positions_run_when_positions_are_raised(main_job):
    """The error's own advice works: unscaled extrapolation to 512 runs. It fails to retrieve
    at depth 0 (a 494-token gap, twice the trained one) and mostly retrieves at depth 0.5378,
    where the gap is the trained 238 tokens (0.87 in docs/evaluate.md's run)."""
    result = _evaluate(
        main_job,
        "--task",
        "needle",
        "--lengths",
        "512",
        "--depths",
        "0,0.5378",
        "--max-position-embeddings",
        "512",
        "--num-samples",
        "100",
    )
    far, trained_gap = result["cells"]
    assert far["exact"] == 0.0
    assert trained_gap["exact"] > 0.5


def test_held_out_data_path_feeds_both_tasks(main_job, tmp_path):
    """``--data-path``: loss by position over the validation split, needles in its tokens."""
    import glob

    from mcore_flash.evaluation.needle import stream_filler

    (bin_file,) = glob.glob(f"{main_job}/data/longrange_*.bin")  # the main job's own documents
    data = [
        "--data-path",
        bin_file[: -len(".bin")],
        "--split",
        "50,50,0",
        "--data-cache-path",
        tmp_path / "cache",
    ]
    buckets = _evaluate(main_job, "--task", "loss-by-position", "--num-samples", "8", *data)[
        "buckets"
    ]
    assert (
        sum(b["tokens"] for b in buckets) == 8 * 256
    )  # GPTDataset samples: 256 labels each, none masked
    assert buckets[-3]["loss"] == pytest.approx(math.log(10), rel=0.02)
    (cell,) = _evaluate(
        main_job, "--task", "needle", "--depths", "0", "--num-samples", "10", *data
    )["cells"]
    assert cell["samples"] == 10 and 0.0 <= cell["token_accuracy"] <= 1.0
    stream = np.arange(1000)
    windows = stream_filler(stream)(np.random.default_rng(0), 5, 220)
    assert windows.shape == (5, 220) and (np.diff(windows, axis=1) == 1).all()  # consecutive tokens
    with pytest.raises(ValueError, match="fewer than one haystack"):
        stream_filler(stream[:100])(np.random.default_rng(0), 1, 220)
