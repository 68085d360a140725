"""`mcore-flash evaluate --task perplexity`: loss and perplexity of a checkpoint on a text.

Oracle: `transformers`. A random Llama written by transformers (`_support/hf_models.py`,
258 tokens: the byte tokenizer's vocabulary) is converted with `mcore-flash convert
hf-to-mcore`; the expected numbers are transformers' `model(input_ids, labels=target_ids).loss`
in the windows of its perplexity guide (https://huggingface.co/docs/transformers/perplexity:
windows of `max_length` moving by `stride`, labels of the context -100), each window's mean
times the number of labels it averages, summed over the windows and divided by their total:
the exact token-weighted mean (the guide's own `trg_len - 1` weights are an approximation).
The token ids are the text's UTF-8 bytes (the byte tokenizer has no BOS) or what transformers'
own tokenizer (`PreTrainedTokenizerFast`) gives, BOS included. For `--data-path` the samples
are those of the trainer's validation split (megatron's GPTDataset), scored by transformers.

Tolerance, fixed before any run: loss and perplexity to 1e-5 relative (fp32 weights and
activations on both sides), token and window counts exact.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from _support.dist_utils import run_distributed
from _support.hf_models import make_hf_llama

RTOL = 1e-5
WINDOW = 32  # --seq-length of every run: the texts are several windows long
WORDS = "the model reads a long text in windows of tokens; perplexité, über, naïve".split()


def _text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"


def _byte_level_tokenizer_with_bos(path) -> str:
    """A `tokenizers` tokenizer.json of 258 ids (the 256 byte-level symbols, `<s>` = 256,
    `</s>` = 257) whose post-processor prepends `<s>`, as Llama 3's prepends <|begin_of_text|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 256)]
    )
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """The transformers Llama, its converted checkpoint, the input files and a preprocessed
    dataset (paths as strings)."""
    from mcore_flash import preprocess

    root = tmp_path_factory.mktemp("perplexity")
    src = make_hf_llama(root / "hf", vocab=258)
    run = subprocess.run(
        [sys.executable, "-m", "mcore_flash.cli", "convert", "hf-to-mcore"]
        + ["--hf-dir", src, "--save", str(root / "mc")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (root / "long.txt").write_text(_text(0, 36), encoding="utf-8")  # ~200 bytes: 6+ windows
    documents = [
        {"text": _text(1, 30), "id": 1},  # several windows
        {"text": "a short text", "id": 2},  # one window, shorter than --seq-length: padded
        {"text": "é", "id": 3},  # two bytes: one scored token
        {"text": "a", "id": 4},  # one token: nothing to score
        {"text": "", "id": 5},
    ]
    with open(root / "docs.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in documents)
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": _text(10 + i, 15)}) + "\n" for i in range(40))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = preprocess.main(
            ["--input", str(root / "corpus.jsonl"), "--output-prefix", str(root / "corpus")]
            + ["--append-eod"]
        )
    assert code == 0, err.getvalue()
    return {
        "hf": src,
        "load": str(root / "mc"),
        "txt": str(root / "long.txt"),
        "jsonl": str(root / "docs.jsonl"),
        "texts": [d["text"] for d in documents],
        "tokenizer": _byte_level_tokenizer_with_bos(root / "tokenizer.json"),
        "data": [
            "--data-path",
            str(root / "corpus_text_document"),
            "--split",
            "50,50,0",
            "--data-cache-path",
            str(root / "cache"),
        ],
    }


def _transformers_model(src):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def _guide(hf, ids: list[int], max_length: int, stride: int) -> tuple[float, int, int]:
    """The perplexity guide's loop on one text: (sum of the scored tokens' NLL, their number,
    windows that score a token). transformers' loss is a window's mean over the labels left
    after its internal shift by one: times their number it is the window's NLL sum."""
    ids = torch.tensor([ids])
    seq_len = ids.size(1)
    nll, tokens, windows, prev_end_loc = 0.0, 0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = ids[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        scored = int((target_ids[:, 1:] != -100).sum())
        if scored:
            with torch.no_grad():
                loss = hf(input_ids, labels=target_ids).loss
            nll += loss.double().item() * scored
            tokens += scored
            windows += 1
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll, tokens, windows


def _expected(hf, documents: list[list[int]], max_length: int, stride: int) -> dict:
    parts = [_guide(hf, ids, max_length, stride) for ids in documents]
    nll, tokens, windows = (sum(p[i] for p in parts) for i in range(3))
    return {
        "loss": nll / tokens,
        "perplexity": math.exp(nll / tokens),
        "tokens": tokens,
        "windows": windows,
    }


def _assert_matches(result: dict, expected: dict, where: str = "") -> None:
    counts = (result["tokens"], result["windows"])
    assert counts == (expected["tokens"], expected["windows"]), where
    assert result["loss"] == pytest.approx(expected["loss"], rel=RTOL), where
    assert result["perplexity"] == pytest.approx(expected["perplexity"], rel=RTOL), where


def _byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _w_cli(rank, world_size, runs):
    """`mcore-flash evaluate` once per argv, in this one process: (exit code, stdout)."""
    from mcore_flash.evaluation import cli

    out = []
    for argv in runs:
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
            code = cli.main(argv)
        out.append((code, stdout.getvalue()))
    return out


def _w_layouts(rank, world_size, runs):
    """Each argv's result on these ranks. The gloo group of two processes cannot be created
    again after `main` destroys it, so this calls what `main` calls, keeping the group and
    rebuilding megatron's parallel state per layout."""
    from megatron.core import parallel_state

    from mcore_flash.evaluation import cli
    from mcore_flash.runtime.distributed import init_distributed

    results = []
    for argv in runs:
        args = cli.resolve(argv)
        init_distributed(args.run)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                results.append(cli.evaluate(args))
        finally:
            parallel_state.destroy_model_parallel()
    return results


def _argv(setup, *flags) -> list[str]:
    return ["--load", setup["load"], "--task", "perplexity", "--seq-length", str(WINDOW), *flags]


@pytest.fixture(scope="module")
def one_rank(setup) -> dict:
    """Every one-rank case, run by the CLI in one launch: name -> printed result."""
    cases = {
        "overlapping": ["--input", setup["txt"], "--stride", "12", "--json"],
        "table": ["--input", setup["txt"], "--stride", "12"],
        "disjoint": ["--input", setup["txt"], "--json"],  # default stride: --seq-length
        "jsonl": ["--input", setup["jsonl"], "--stride", "20", "--eval-batch-size", "3", "--json"],
        "bos": ["--input", setup["txt"], "--stride", "16", "--json"]
        + ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", setup["tokenizer"]],
        "data": [*setup["data"], "--num-samples", "6", "--eval-batch-size", "4", "--json"],
    }
    runs = [_argv(setup, *flags) for flags in cases.values()]
    [printed] = run_distributed(_w_cli, 1, runs, timeout=400)
    assert [code for code, _ in printed] == [0] * len(cases)
    return {
        name: out if name == "table" else json.loads(out) for name, (_, out) in zip(cases, printed)
    }


def test_windows_are_the_guides():
    """`sliding_windows` scores, window by window, exactly the labels the guide's loop leaves
    after transformers' shift, for every text length, window and stride up to 9."""
    from mcore_flash.evaluation.perplexity import sliding_windows

    for seq_len in range(0, 40):
        for max_length in range(1, 10):
            for stride in range(1, max_length + 1):
                guide, prev_end_loc = [], 0
                for begin_loc in range(0, seq_len, stride):
                    end_loc = min(begin_loc + max_length, seq_len)
                    trg_len = end_loc - prev_end_loc
                    labels = list(range(begin_loc, end_loc))
                    labels[: len(labels) - trg_len] = [-100] * (len(labels) - trg_len)
                    guide.append((begin_loc, end_loc, [t for t in labels[1:] if t != -100]))
                    prev_end_loc = end_loc
                    if end_loc == seq_len:
                        break
                ours = [
                    (b, e, list(range(first, e)))
                    for b, e, first in sliding_windows(seq_len, max_length, stride)
                ]
                assert ours == guide, (seq_len, max_length, stride)
                scored = sorted(t for *_, ts in ours for t in ts)
                if stride < max_length:  # every token but the first, once
                    assert scored == list(range(1, seq_len))


def test_text_in_overlapping_windows_equals_transformers(setup, one_rank):
    """A ~200-token .txt in windows of 32 moving by 12: every token but the first scored once."""
    with open(setup["txt"], encoding="utf-8") as f:
        ids = _byte_ids(f.read())
    expected = _expected(_transformers_model(setup["hf"]), [ids], WINDOW, 12)
    assert expected["windows"] > 10 and expected["tokens"] == len(ids) - 1
    result = one_rank["overlapping"]
    _assert_matches(result, expected)
    assert (result["stride"], result["bos"], result["sequences"]) == (12, False, 1)
    table = one_rank["table"]  # the same run without --json
    assert f"perplexity {expected['perplexity']:.4f}" in table
    assert f"over {expected['tokens']} tokens" in table and "no BOS" in table


def test_disjoint_windows_by_default_equal_transformers(setup, one_rank):
    """Default --stride = --seq-length: the first token of each window has no context and,
    as in the guide, is not scored."""
    with open(setup["txt"], encoding="utf-8") as f:
        ids = _byte_ids(f.read())
    expected = _expected(_transformers_model(setup["hf"]), [ids], WINDOW, WINDOW)
    assert expected["tokens"] == len(ids) - math.ceil(len(ids) / WINDOW)
    _assert_matches(one_rank["disjoint"], expected)
    assert one_rank["disjoint"]["stride"] == WINDOW


def test_jsonl_texts_each_in_their_own_windows_equal_transformers(setup, one_rank):
    """Each line's `text` is its own text: no context crosses texts; a short one is padded, a
    one-token or empty one scores nothing."""
    documents = [_byte_ids(t) for t in setup["texts"]]
    expected = _expected(_transformers_model(setup["hf"]), documents, WINDOW, 20)
    assert expected["tokens"] == sum(max(len(d) - 1, 0) for d in documents)
    _assert_matches(one_rank["jsonl"], expected)
    assert one_rank["jsonl"]["sequences"] == 5


def test_hf_tokenizer_bos_is_prepended_as_transformers_tokenizer_does(setup, one_rank):
    """A HuggingFaceTokenizer whose tokenizer.json prepends <s>: the ids are transformers'
    `PreTrainedTokenizerFast(text)`'s, BOS first (context, never scored)."""
    from transformers import PreTrainedTokenizerFast

    with open(setup["txt"], encoding="utf-8") as f:
        text = f.read()
    ids = PreTrainedTokenizerFast(tokenizer_file=setup["tokenizer"])(text)["input_ids"]
    assert ids[0] == 256 and len(ids) == len(_byte_ids(text)) + 1
    expected = _expected(_transformers_model(setup["hf"]), [ids], WINDOW, 16)
    _assert_matches(one_rank["bos"], expected)
    assert one_rank["bos"]["bos"] is True


def test_data_path_is_the_validation_split_samples_scored_by_transformers(setup, one_rank):
    """--data-path: the first --num-samples samples of the validation split as the trainer
    reads them (GPTDataset: --seq-length tokens + the next as the last label), every label
    scored (the byte tokenizer's pad never occurs), as the trainer's validation loss."""
    from mcore_flash.data.tokenizers import ByteTokenizer
    from mcore_flash.evaluation.cli import _validation_split, resolve

    args = resolve(_argv(setup, *setup["data"]))
    valid = _validation_split(args.run, ByteTokenizer(), WINDOW)
    hf = _transformers_model(setup["hf"])
    nll, tokens = 0.0, 0
    for i in range(6):
        sample = {k: torch.as_tensor(v) for k, v in valid[i].items()}
        ids = torch.cat([sample["tokens"], sample["labels"][-1:]])  # the sample's 33 tokens
        assert torch.equal(ids[1:], sample["labels"])
        target = ids.clone()
        target[1:][sample["loss_mask"] == 0] = -100
        scored = int((target[1:] != -100).sum())
        with torch.no_grad():
            nll += hf(ids[None], labels=target[None]).loss.double().item() * scored
        tokens += scored
    assert tokens == 6 * WINDOW
    expected = {
        "loss": nll / tokens,
        "perplexity": math.exp(nll / tokens),
        "tokens": tokens,
        "windows": 6,
    }
    _assert_matches(one_rank["data"], expected)
    assert one_rank["data"]["sequences"] == 6


def test_tp2_sp_pp2_and_cp2_equal_transformers(setup):
    """The .jsonl case (several windows, a padded short text, empty ones) on two gloo ranks at
    TP2 with sequence parallelism, PP2 and CP2 (one launch): transformers' numbers each time."""
    layouts = {
        "tp2+sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        # the checkpoint's 384 vocabulary rows: a multiple of 64 x 2
        + ["--make-vocab-size-divisible-by", "64"],
        "pp2": ["--pipeline-model-parallel-size", "2"],
        "cp2": ["--context-parallel-size", "2"],
    }
    runs = [
        _argv(setup, "--input", setup["jsonl"], "--stride", "12", *flags)
        for flags in layouts.values()
    ]
    ranks = run_distributed(_w_layouts, 2, runs, timeout=400)
    assert ranks[0] == ranks[1]  # every rank returns the same numbers
    documents = [_byte_ids(t) for t in setup["texts"]]
    expected = _expected(_transformers_model(setup["hf"]), documents, WINDOW, 12)
    for name, result in zip(layouts, ranks[0]):
        _assert_matches(result, expected, name)


def _error(*argv) -> str:
    from mcore_flash.evaluation.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main([*map(str, argv)]) == 2
    return err.getvalue()


def test_bad_inputs_are_refused_by_name(setup, tmp_path):
    """Refused before the model is built, exit status 2, the flag named."""
    argv = _argv(setup)
    missing = tmp_path / "missing.txt"
    assert f"--input {missing}: no such file" in _error(*argv, "--input", missing)
    for stride in (0, WINDOW + 1):
        message = _error(*argv, "--input", setup["txt"], "--stride", stride)
        assert f"--stride {stride} must be in [1, --seq-length {WINDOW}]" in message
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "empty text" in _error(*argv, "--input", empty)
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n\n{"text": ""}\n')
    assert "empty text" in _error(*argv, "--input", blank)
    one = tmp_path / "one.txt"
    one.write_text("a")
    assert "no token to score" in _error(*argv, "--input", one)
    other_key = _error(*argv, "--input", setup["jsonl"], "--json-key", "body")
    assert "line 1: no key 'body'" in other_key and "--json-key" in other_key
    csv = tmp_path / "text.csv"
    csv.write_text("a,b\n")
    assert "give a .txt file" in _error(*argv, "--input", csv)
    assert "needs one source" in _error(*argv)
    both = _error(*argv, "--input", setup["txt"], *setup["data"])
    assert "needs one source" in both and "not both" in both
    assert "--stride applies to --input" in _error(*argv, *setup["data"], "--stride", 8)
    assert "--plot" in _error(*argv, "--input", setup["txt"], "--plot", tmp_path / "p.png")
