"""Data layer: tokenizers, ``mcore-flash preprocess``, the synthetic task, build_datasets, errors."""

from __future__ import annotations

import datetime
import gzip
import json
import math
import os
import sys

import numpy
import pytest
import torch

from mcore_flash.data import DataError
from mcore_flash.data.indexed import check_indexed_dataset
from mcore_flash.data.synthetic import (
    QUERY,
    SEP,
    START,
    answer_loss_mask,
    generate_documents,
    make_task,
    synthetic_dataset,
    write_synthetic_dataset,
)
from mcore_flash.data.tokenizers import ByteTokenizer, build_tokenizer, padded_vocab_size
from mcore_flash.preprocess import main as preprocess_main
from mcore_flash.preprocess import preprocess

from _support.dist_utils import free_port


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.index.dtype


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer():
    tok = build_tokenizer()  # default type
    assert isinstance(tok, ByteTokenizer)
    text = "héllo, wörld ✓"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.detokenize(ids + [tok.eod, tok.pad]) == text
    assert (tok.vocab_size, tok.eod, tok.pad, tok.eos) == (258, 256, 257, 256)
    json.dumps(tok.unique_identifiers)
    assert padded_vocab_size(tok.vocab_size) == 384
    assert padded_vocab_size(tok.vocab_size, 8, 2) == 272


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("1 2 99") == [1, 2, 99]
    assert (tok.vocab_size, tok.eod) == (101, 100)
    with pytest.raises(DataError, match="--vocab-size"):
        tok.tokenize("100")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(tokenizer_type="Bytes"), "did you mean ByteTokenizer"),
        (dict(tokenizer_type="GPT2BPETokenizer"), "HuggingFaceTokenizer"),
        (dict(tokenizer_type="NullTokenizer"), "--vocab-size"),
        (dict(tokenizer_type="ByteTokenizer", tokenizer_model="x.json"), "drop"),
        (dict(tokenizer_type="ByteTokenizer", vocab_size=5), "--vocab-size is only used"),
    ],
)
def test_build_tokenizer_errors(kwargs, needle):
    with pytest.raises(DataError, match="--tokenizer-type|--tokenizer-model|--vocab-size") as info:
        build_tokenizer(**kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "tokenizer_type, package",
    [("HuggingFaceTokenizer", "tokenizers"), ("SentencePieceTokenizer", "sentencepiece")],
)
def test_optional_tokenizer_package_missing(monkeypatch, tokenizer_type, package):
    monkeypatch.setitem(sys.modules, package, None)  # makes `import <package>` fail
    with pytest.raises(DataError) as info:
        build_tokenizer(tokenizer_type, "tok.model")
    assert f"--tokenizer-type {tokenizer_type}" in str(info.value)
    assert f"pip install {package}" in str(info.value)


def test_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    with pytest.raises(DataError, match="--tokenizer-model .*no such file"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "nope.json"))
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    corpus = ["the quick brown fox", "jumps over the lazy dog"] * 20
    hf.train_from_iterator(
        corpus, tokenizers.trainers.BpeTrainer(special_tokens=["<unk>", "</s>", "<pad>"])
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))  # a directory with tokenizer.json
    assert (tok.eod, tok.pad) == (1, 2)
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": t} for t in corpus[:2]])
    prefix = preprocess(
        str(src),
        str(tmp_path / "hf"),
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=str(tmp_path / "tokenizer.json"),
        append_eod=True,
        log=sys.stdout,
    )["text"]
    assert _read(prefix)[0] == [tok.tokenize(t) + [1] for t in corpus[:2]]


def test_sentencepiece_tokenizer(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "c.txt").write_text(
        "\n".join(["the quick brown fox", "jumps over the lazy dog"] * 20)
    )
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=30
    )
    tok = build_tokenizer("SentencePieceTokenizer", str(tmp_path / "sp.model"))
    assert tok.detokenize(tok.tokenize("the lazy fox")) == "the lazy fox"
    assert tok.eod == 2 and tok.vocab_size == 30


# --------------------------------------------------------------------------- preprocess


def test_preprocess_roundtrip(tmp_path, capsys):
    texts = ["hello world", "ünïcödé ✓ text", "", "third\ndocument with a newline"]
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": t, "other": 1} for t in texts] + [""])  # trailing blank line
    out = tmp_path / "out" / "corpus"
    rc = preprocess_main(
        [
            "--input",
            str(src),
            "--output-prefix",
            str(out),
            "--json-keys",
            "text",
            "--append-eod",
            "--log-interval",
            "1",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert (
        "processed 1 documents" in err
        and "done: 3 documents" in err
        and "1 empty documents skipped" in err
    )
    prefix = str(out) + "_text_document"
    docs, dtype = _read(prefix)
    assert dtype == numpy.uint16
    assert docs == [list(t.encode("utf-8")) + [256] for t in texts if t]
    assert sorted(os.listdir(out.parent)) == [
        "corpus_text_document.bin",
        "corpus_text_document.idx",
    ]
    assert check_indexed_dataset(prefix, vocab_size=258).num_tokens == sum(len(d) for d in docs)

    # gzip input, two workers, no eod: same token ids
    gz = tmp_path / "in.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    prefixes = preprocess(str(gz), str(tmp_path / "w2"), ["text"], workers=2, log=sys.stdout)
    docs2, _ = _read(prefixes["text"])
    assert docs2 == [list(t.encode("utf-8")) for t in texts if t]


@pytest.mark.parametrize(
    "rows, needle",
    [
        ([{"text": "a"}, {"text": "b"}, '{"text": "c",'], "line 3: invalid JSON"),
        (
            [{"text": "a"}, {"body": "b"}],
            "line 2: no key 'text' (keys present: 'body'); name the text field with --json-keys",
        ),
        ([{"text": 5}], "line 1: key 'text' holds a int, expected a string"),
        ([[1, 2]], "line 1: expected a JSON object"),
        (["", ""], "no non-empty documents"),
    ],
)
def test_preprocess_bad_input(tmp_path, rows, needle, capsys):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, rows)
    rc = preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--input" in err and needle in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # atomic: nothing left behind


def test_preprocess_missing_input_and_bad_utf8(tmp_path):
    with pytest.raises(DataError, match=r"--input .*nope.jsonl: no such file"):
        preprocess(str(tmp_path / "nope.jsonl"), str(tmp_path / "o"))
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(DataError, match="line 2: not valid UTF-8"):
        preprocess(str(src), str(tmp_path / "o"))


# --------------------------------------------------------------------------- synthetic task


def test_synthetic_structure(tmp_path):
    s = 64
    task = write_synthetic_dataset(str(tmp_path / "syn"), num_docs=50, seq_length=s, seed=3)
    k = task.key_length
    assert (k, task.distance) == (4, s - k - 2) and task.distance >= 3 * s // 4
    docs, dtype = _read(str(tmp_path / "syn"))
    assert dtype == numpy.uint16 and len(docs) == 50
    keys = set()
    for doc in docs:
        assert len(doc) == s
        assert (
            doc[0] == START
            and doc[1 + k] == SEP
            and doc[task.query_position] == QUERY
            and doc[-1] == 256
        )
        key = doc[1 : 1 + k]
        assert all(ord("a") <= t <= ord("z") for t in key)
        assert all(ord("0") <= t <= ord("9") for t in doc[2 + k : task.query_position])
        assert doc[task.answer_start : task.answer_start + k] == key
        # each answer token is the key token exactly `distance` back
        assert all(
            doc[task.answer_start + j] == doc[task.answer_start + j - task.distance]
            for j in range(k)
        )
        keys.add(tuple(key))
    assert len(keys) > 45  # random keys
    # floors: the answer part is the only gap between them
    assert task.local_floor - task.perfect_floor == pytest.approx(k * math.log(26) / s)
    t256 = make_task(256)
    assert (t256.key_length, t256.distance) == (16, 238)
    assert (round(t256.local_floor, 3), round(t256.perfect_floor, 3)) == (2.386, 2.182)
    # shorter distance: the rest becomes lead filler
    t = make_task(64, key_length=4, distance=40)
    d = generate_documents(t, 2, seed=0)
    assert t.lead_length == 18 and (d[:, t.lead_length] == START).all()
    assert (d[:, t.answer_start : t.answer_start + 4] == d[:, t.key_start : t.key_start + 4]).all()
    with pytest.raises(DataError, match="distance"):
        make_task(64, key_length=4, distance=70)


def test_synthetic_deterministic_and_cached(tmp_path):
    write_synthetic_dataset(str(tmp_path / "a"), 4000, 256, seed=7)
    write_synthetic_dataset(str(tmp_path / "b"), 4000, 256, seed=7)
    write_synthetic_dataset(str(tmp_path / "c"), 4000, 256, seed=8)
    read = lambda n: (tmp_path / n).read_bytes()  # noqa: E731
    assert read("a.bin") == read("b.bin") and read("a.idx") == read("b.idx")
    assert read("a.bin") != read("c.bin")
    with pytest.raises(DataError, match="every rank shares"):  # a reader never writes
        synthetic_dataset(str(tmp_path / "cache"), 100, 64, seed=1, create=False)
    prefix, task = synthetic_dataset(str(tmp_path / "cache"), 100, 64, seed=1)
    mtime = os.path.getmtime(prefix + ".bin")
    assert synthetic_dataset(str(tmp_path / "cache"), 100, 64, seed=1)[0] == prefix
    assert synthetic_dataset(str(tmp_path / "cache"), 100, 64, seed=1, create=False)[0] == prefix
    assert os.path.getmtime(prefix + ".bin") == mtime  # reused, not rewritten


def _uniform_docs_checked(docs, s, k):
    """Check each document of the varied-depth task position by position, without the task's
    own layout code; returns the lead (digits before ``@``) of each document."""
    f = s - 2 * k - 4
    leads = []
    for doc in numpy.asarray(docs).tolist():
        assert len(doc) == s
        assert doc.count(START) == 1 and doc.count(QUERY) == 1 and doc.count(SEP) == 1
        lead = doc.index(START)
        assert 0 <= lead <= f
        key = doc[lead + 1 : lead + 1 + k]
        assert all(ord("a") <= t <= ord("z") for t in key)
        assert doc[lead + 1 + k] == SEP
        assert doc[s - k - 2] == QUERY  # the query never moves
        assert doc[s - k - 1 : s - 1] == key  # the answer is the key, copied exactly
        assert doc[s - 1] == 256  # eod
        digits = doc[:lead] + doc[lead + k + 2 : s - k - 2]
        assert len(digits) == f and all(ord("0") <= t <= ord("9") for t in digits)
        leads.append(lead)
    return leads


def test_synthetic_uniform_key_depth(tmp_path):
    s, k = 64, 4
    f = s - 2 * k - 4  # 52 digits per document
    task = make_task(s, key_length=k, key_depth="uniform")
    n = 2000
    docs = generate_documents(task, n, seed=5)
    leads = _uniform_docs_checked(docs, s, k)
    # every lead 0..F occurs (P(one of 53 values missing in 2000 draws) < 53 * e^-37.7)
    assert set(leads) == set(range(f + 1))
    # uniform: the mean lead is F/2 within 5 standard errors (sd of U{0..F} is sqrt((53^2-1)/12))
    assert abs(numpy.mean(leads) - f / 2) < 5 * math.sqrt(((f + 1) ** 2 - 1) / 12 / n)
    # the needle evaluation's layout: needle_samples at depth lead/F with the same digits and
    # key rebuilds each document exactly
    from mcore_flash.evaluation.needle import needle_samples

    class KeyRng:  # hands needle_samples the document's own key
        def __init__(self, letters):
            self.letters = letters

        def integers(self, low, high, size):
            return self.letters.reshape(size)

    for doc, lead in list(zip(docs, leads))[:40]:
        digits = numpy.concatenate([doc[:lead], doc[lead + k + 2 : s - k - 2]])[None]
        rng = KeyRng(doc[lead + 1 : lead + 1 + k] - ord("a"))
        tokens, _ = needle_samples(s, lead / f, k, digits, rng)
        assert tokens[0].tolist() == doc.tolist()
    # floors by hand: F digits, the key, the answer (no-copy floor only) and where the @ sits
    t256 = make_task(256, key_depth="uniform")
    at = math.log(221)  # lead ~ U{0..220}
    assert t256.local_floor == pytest.approx((220 * math.log(10) + 32 * math.log(26) + at) / 256)
    assert t256.perfect_floor == pytest.approx((220 * math.log(10) + 16 * math.log(26) + at) / 256)
    assert (round(t256.local_floor, 3), round(t256.perfect_floor, 3)) == (2.407, 2.204)
    assert (t256.query_position, t256.answer_start, t256.distance) == (238, 239, 238)
    with pytest.raises(ValueError, match="varies per document"):
        _ = t256.lead_length
    with pytest.raises(DataError, match="give no distance"):
        make_task(64, key_length=4, distance=40, key_depth="uniform")
    with pytest.raises(DataError, match="--synthetic-key-depth"):
        make_task(64, key_depth="random")
    # deterministic in the seed, and written to disk as generated
    a = write_synthetic_dataset(
        str(tmp_path / "a"), 30, s, seed=5, key_length=k, key_depth="uniform"
    )
    b = write_synthetic_dataset(
        str(tmp_path / "b"), 30, s, seed=5, key_length=k, key_depth="uniform"
    )
    assert a == b == task
    assert _read(str(tmp_path / "a"))[0] == generate_documents(task, 30, seed=5).tolist()
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    assert generate_documents(task, 30, seed=6).tolist() != _read(str(tmp_path / "a"))[0]


def test_synthetic_cache_records_the_key_depth(tmp_path):
    """A fixed dataset in the cache is never taken for a varied-depth one, or back."""
    cache = str(tmp_path / "cache")
    fixed, _ = synthetic_dataset(cache, 100, 64, seed=1)
    with pytest.raises(
        DataError, match="every rank shares"
    ):  # not there: the fixed one is no match
        synthetic_dataset(cache, 100, 64, seed=1, key_depth="uniform", create=False)
    uniform, task = synthetic_dataset(cache, 100, 64, seed=1, key_depth="uniform")
    assert uniform != fixed and os.path.basename(uniform) == "longrange_s64_k4_duniform_n100_seed1"
    assert os.path.basename(fixed) == "longrange_s64_k4_d58_n100_seed1"  # the name it always had
    leads = _uniform_docs_checked(_read(uniform)[0], 64, 4)
    assert len(set(leads)) > 1
    assert {doc.index(START) for doc in _read(fixed)[0]} == {0}
    assert (
        synthetic_dataset(cache, 100, 64, seed=1, key_depth="uniform", create=False)[0] == uniform
    )
    assert synthetic_dataset(cache, 100, 64, seed=1, create=False)[0] == fixed


def test_synthetic_key_depth_flag(tmp_path, good_prefix, gloo_group):
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training.batches import build_train_valid_datasets

    base = ["--seq-length", "64", "--micro-batch-size", "2", "--train-iters", "4"]
    save = str(tmp_path / "run")
    assert parse_config([*base, "--save", save]).synthetic_key_depth == "fixed"
    assert parse_config([*base, "--save", save, "--mock-data"]).synthetic_key_depth is None
    config = parse_config([*base, "--save", save, "--synthetic-key-depth", "uniform"])
    train, valid = build_train_valid_datasets(config, ByteTokenizer())
    assert valid is None
    names = sorted(os.listdir(os.path.join(save, "data")))
    assert [n for n in names if n.endswith(".bin")] == [
        "longrange_s64_k4_duniform_n4096_seed1234.bin"
    ]
    leads = _uniform_docs_checked(torch.stack([train[i]["tokens"] for i in range(8)]), 64, 4)
    assert len(set(leads)) > 1  # the trainer's samples are the varied documents
    for argv in (["--data-path", good_prefix], ["--mock-data"]):
        with pytest.raises(ValueError, match="--synthetic-key-depth.*" + argv[0]):
            parse_config([*base, "--save", save, "--synthetic-key-depth", "fixed", *argv])
    with pytest.raises(SystemExit):  # argparse: not a choice
        parse_config([*base, "--save", save, "--synthetic-key-depth", "random"])


def test_a_resume_on_the_other_key_depth_is_refused(tmp_path):
    """The placement a checkpoint's run trained on (its provenance) must be this resume's:
    refused naming the flag otherwise; a fine-tune, other data, or a checkpoint without the
    record (written before it) go on."""
    from mcore_flash.runtime.arguments import parse_config
    from mcore_flash.training.loop import _check_built_in_data

    base = ["--seq-length", "64", "--micro-batch-size", "2", "--train-iters", "4"]
    load = ["--save", str(tmp_path), "--load", str(tmp_path)]
    fixed = parse_config([*base, *load])
    uniform = parse_config([*base, *load, "--synthetic-key-depth", "uniform"])
    with pytest.raises(ValueError, match="pass --synthetic-key-depth uniform"):
        _check_built_in_data(fixed, {"synthetic_key_depth": "uniform"})
    with pytest.raises(ValueError, match="pass --synthetic-key-depth fixed"):
        _check_built_in_data(uniform, {"synthetic_key_depth": "fixed"})
    _check_built_in_data(uniform, {"synthetic_key_depth": "uniform"})
    _check_built_in_data(uniform, {})
    _check_built_in_data(
        parse_config([*base, *load, "--finetune"]), {"synthetic_key_depth": "uniform"}
    )
    _check_built_in_data(
        parse_config([*base, *load, "--mock-data"]), {"synthetic_key_depth": "fixed"}
    )


# --------------------------------------------------------------------------- build_datasets


@pytest.fixture(scope="module")
def gloo_group():
    """A single-process gloo group (megatron's dataset builder is collective when one exists)."""
    if torch.distributed.is_initialized():
        yield
        return
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        world_size=1,
        rank=0,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def test_build_datasets_synthetic(tmp_path, gloo_group):
    from mcore_flash.data.datasets import SAMPLE_KEYS, build_datasets

    s = 64
    data_dir = tmp_path / "data"
    prefix, task = synthetic_dataset(str(data_dir), 200, s, seed=0)
    cache = tmp_path / "cache"
    train, valid, test = build_datasets(
        [prefix], False, "90,5,5", s, 1234, ByteTokenizer(), 300, 20, 20, cache_dir=str(cache)
    )
    assert len(train) >= 300 and len(valid) >= 20 and len(test) >= 20
    for ds in (train, valid, test):
        for i in (0, len(ds) - 1):
            sample = ds[i]
            assert set(sample) == set(SAMPLE_KEYS)  # no attention_mask
            assert all(sample[key].shape == (s,) for key in SAMPLE_KEYS)
            assert torch.equal(sample["position_ids"], torch.arange(s))
            assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
            assert sample["loss_mask"].sum() == s
            # documents are seq_length long, so each sample is one whole document
            assert sample["tokens"][0] == START and sample["tokens"][-1] == 256
            mask = answer_loss_mask(sample["tokens"], task.key_length)
            answer = sample["labels"][mask.bool()]
            key = sample["tokens"][task.key_start : task.key_start + task.key_length]
            assert torch.equal(answer, key)
    assert os.listdir(cache) and sorted(os.listdir(data_dir)) == sorted(
        os.path.basename(prefix) + ext for ext in (".bin", ".idx")
    )  # megatron's index cache went to cache_dir, not next to the data

    # weighted blend of two prefixes; valid split switched off
    prefix2, _ = synthetic_dataset(str(data_dir), 100, s, seed=1)
    train, valid, test = build_datasets(
        ["0.7", prefix, "0.3", prefix2],
        False,
        "9,0,1",
        s,
        1,
        ByteTokenizer(),
        50,
        0,
        10,
        cache_dir=str(cache),
    )
    assert valid is None and len(train) == 50 and len(test) == 10
    assert set(train[3]) == set(SAMPLE_KEYS) | {
        "dataset_id"
    }  # BlendedDataset adds the source index


def test_build_datasets_mock(tmp_path, gloo_group):
    from mcore_flash.data.datasets import SAMPLE_KEYS, build_datasets

    train, valid, test = build_datasets(None, True, "1,1,1", 32, 0, ByteTokenizer(), 8, 4, 4)
    sample = train[0]
    assert set(sample) == set(SAMPLE_KEYS) and sample["tokens"].shape == (32,)


# --------------------------------------------------------------------------- bad data paths


@pytest.fixture
def good_prefix(tmp_path):
    prefix = str(tmp_path / "syn")
    write_synthetic_dataset(prefix, 20, 32, seed=0)
    return prefix


def _build(prefix, tmp_path, tokenizer=None, split="8,1,1", sizes=(10, 2, 2)):
    from mcore_flash.data.datasets import build_datasets

    return build_datasets(
        [prefix],
        False,
        split,
        32,
        0,
        tokenizer or ByteTokenizer(),
        *sizes,
        cache_dir=str(tmp_path / "c"),
    )


def _corrupt_idx(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    elif how == "garbage":
        data[:64] = numpy.random.default_rng(0).integers(0, 256, 64, dtype=numpy.uint8).tobytes()
    elif how == "pointers":  # same size, garbage in the middle (sequence offsets)
        data[34 + 20 * 4 : 34 + 20 * 4 + 16] = b"\xff" * 16
    elif how == "empty":
        data = b""
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "garbage", "pointers", "empty"])
def test_corrupt_idx(good_prefix, tmp_path, how):
    _corrupt_idx(good_prefix + ".idx", how)
    with pytest.raises(DataError) as info:
        _build(good_prefix, tmp_path)
    msg = str(info.value)
    assert f"--data-path {good_prefix}" in msg and good_prefix + ".idx is corrupt" in msg
    assert "mcore-flash preprocess" in msg


def test_bad_data_paths(good_prefix, tmp_path):
    with pytest.raises(DataError, match=r"\.idx not found; run `mcore-flash preprocess` first"):
        _build(str(tmp_path / "missing"), tmp_path)
    with pytest.raises(DataError, match="without .bin"):
        _build(good_prefix + ".bin", tmp_path)
    # preprocess output named without the _text_document suffix
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": "abc"}])
    preprocess(str(src), str(tmp_path / "corpus"), log=sys.stdout)
    with pytest.raises(DataError, match="did you mean --data-path .*corpus_text_document"):
        _build(str(tmp_path / "corpus"), tmp_path)
    # data from another tokenizer
    with pytest.raises(DataError, match="token id .* outside the vocabulary .*--tokenizer-type"):
        _build(good_prefix, tmp_path, tokenizer=build_tokenizer("NullTokenizer", vocab_size=50))
    # an empty split would make megatron loop forever
    with pytest.raises(
        DataError, match="--split 98,1,1: the valid split .* gets none of its 20 documents"
    ):
        _build(good_prefix, tmp_path, split="98,1,1")
    train, valid, test = _build(good_prefix, tmp_path, split="98,1,1", sizes=(10, 0, None))
    assert len(train) >= 10 and len(valid) == 0 and len(test) == 0
    with pytest.raises(DataError, match="--split"):
        _build(good_prefix, tmp_path, split="train")
    # truncated .bin
    with open(good_prefix + ".bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"syn\.bin is truncated"):
        _build(good_prefix, tmp_path)
