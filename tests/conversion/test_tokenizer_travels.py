"""The tokenizer travels with the checkpoint (issue 33): `convert hf-to-mcore` stores the
source's tokenizer files beside the checkpoint, `generate`, `pretrain`, `evaluate` and
`preprocess` use them when no tokenizer flag is given, a fine-tuning run carries them into its
own `--save`, and `convert mcore-to-hf` writes them back with `generation_config.json` and the
special-token ids.

Oracle: `transformers` (`AutoTokenizer`, `AutoModelForCausalLM`, `pipeline`, greedy
`generate`) on a random Llama whose byte-level BPE tokenizer is trained by the `tokenizers`
library and saved by `PreTrainedTokenizerFast.save_pretrained`. The model has 313 embedding
rows for the tokenizer's 300 tokens, as Qwen2.5's 152064 rows hold 151665 tokens.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import pytest
import torch
from test_convert import TRAIN, _generate_ids, finetune

from _support.hf_models import hf_greedy, make_hf_llama, make_hf_tokenizer

TOKENIZER_VOCAB, MODEL_VOCAB = 300, 313
TEXT = "hello world, the quick fox: a tokenizer travels é!"
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def _convert(*argv):
    """`mcore-flash convert ...` in this process: ``(exit code, stdout, stderr)``."""
    from mcore_flash.conversion.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*map(str, argv)])
    return code, out.getvalue(), err.getvalue()


def _common(load):
    from mcore_flash.checkpoint import directory

    return directory.read_latest(str(load))[1]


def _json(path):
    with open(path) as f:
        return json.load(f)


def _run_tokenizer(*argv):
    from mcore_flash.runtime.arguments import parse_args
    from mcore_flash.runtime.tokenizer import run_tokenizer

    return run_tokenizer(parse_args([*map(str, argv)]))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The Hugging Face directory (model + tokenizer), its special-token ids, transformers'
    tokenizer of it, and its conversion."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("travels")
    src = root / "hf"
    ids = make_hf_tokenizer(src, vocab=TOKENIZER_VOCAB)
    make_hf_llama(src, vocab=MODEL_VOCAB, **ids)
    code, out, err = _convert("hf-to-mcore", "--hf-dir", src, "--save", root / "mc")
    assert code == 0, err
    assert "tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja)" in out, out
    return {
        "root": root,
        "hf": str(src),
        "ids": ids,
        "mc": str(root / "mc"),
        "oracle": AutoTokenizer.from_pretrained(str(src)),
    }


def _same_files(a, b, names):
    for name in names:
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name


def corpus_from(root, texts: list[str], load) -> dict:
    """``texts`` as ``root/corpus.jsonl``, tokenized by ``preprocess --load load`` (the
    checkpoint's own tokenizer, an end of document after each) into ``root/corpus``; returns
    the output prefixes by JSON key."""
    from mcore_flash.preprocess import preprocess

    with open(root / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    return preprocess(
        str(root / "corpus.jsonl"),
        str(root / "corpus"),
        tokenizer_type=None,
        append_eod=True,
        log=io.StringIO(),
        load=str(load),
    )


def test_converted_checkpoint_generates_finetunes_and_exports_with_its_tokenizer(source):
    """No tokenizer flag anywhere: the converted checkpoint holds the source's tokenizer files
    (byte-identical, recorded in its common state); `generate --prompt` tokenizes as
    AutoTokenizer does and equals transformers' greedy `generate`; `preprocess --load` gives
    AutoTokenizer's ids; `pretrain --finetune` trains on them into a new --save, which carries
    the tokenizer and generation config; its `mcore-to-hf` export loads in AutoTokenizer (same
    ids and special tokens as the source), AutoModelForCausalLM and pipeline, with the
    source's special-token ids in config.json and its generation_config.json."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    root, src, mc, oracle = source["root"], source["hf"], source["mc"], source["oracle"]
    files = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    _same_files(src, os.path.join(mc, "tokenizer"), files)
    record = _common(mc)["tokenizer"]
    assert record["type"] == "HuggingFaceTokenizer" and sorted(record["files"]) == sorted(files)
    assert not any(name.startswith("iter_") for name in os.listdir(os.path.join(mc, "tokenizer")))

    expected = oracle(TEXT)["input_ids"]
    assert expected == oracle.encode(TEXT, add_special_tokens=False)  # no BOS template
    prompt, output = _generate_ids(mc, "--prompt", TEXT, "--max-new-tokens", 8)
    assert prompt == expected
    assert output == hf_greedy(src, prompt, 8)

    documents = [f"{line} ({i})" for i, line in enumerate([TEXT, "the lazy dog"] * 20)]
    prefixes = corpus_from(root, documents, mc)
    dataset = IndexedDataset(prefixes["text"])
    eos = source["ids"]["eos_token_id"]  # </s>: the tokenizer's end of document
    assert [list(dataset[i]) for i in (0, 1)] == [
        oracle.encode(text, add_special_tokens=False) + [eos] for text in documents[:2]
    ]

    ft = root / "ft"
    finetune(1, mc, ft, "--train-iters", 1, *TRAIN, "--data-path", prefixes["text"])
    _same_files(src, ft / "tokenizer", files)
    common = _common(ft)
    assert common["tokenizer"] == record and common["model_args"]["vocab_size"] == MODEL_VOCAB
    assert common["generation_config"] == _json(os.path.join(src, "generation_config.json"))

    code, out, err = _convert("mcore-to-hf", "--load", ft, "--save-hf", root / "out")
    assert code == 0 and "+ tokenizer (chat_template.jinja, tokenizer.json" in out, err
    exported = AutoTokenizer.from_pretrained(str(root / "out"))
    assert exported(TEXT)["input_ids"] == expected and len(exported) == TOKENIZER_VOCAB
    for name in TOKEN_IDS:
        assert getattr(exported, name) == getattr(oracle, name) == source["ids"].get(name), name
    chat = [{"role": "user", "content": TEXT}]
    assert exported.apply_chat_template(chat) == oracle.apply_chat_template(chat)
    config, original = _json(root / "out" / "config.json"), _json(os.path.join(src, "config.json"))
    assert {k: config[k] for k in TOKEN_IDS} == {k: original[k] for k in TOKEN_IDS}
    assert {k: config[k] for k in TOKEN_IDS} == source["ids"]
    assert _json(root / "out" / "generation_config.json") == _json(
        os.path.join(src, "generation_config.json")
    )
    model = AutoModelForCausalLM.from_pretrained(str(root / "out"), dtype=torch.float32)
    assert model.config.vocab_size == MODEL_VOCAB
    generated = pipeline("text-generation", model=str(root / "out"))(
        "hello world", max_new_tokens=4, do_sample=False
    )
    assert generated[0]["generated_text"].startswith("hello world")


def test_explicit_flags_win_and_checkpoints_without_a_tokenizer_behave_as_before(source, tmp_path):
    """`--tokenizer-type` given: that tokenizer, not the stored one. A source without tokenizer
    files: nothing stored, the byte-level default as before, an export without tokenizer files,
    and `preprocess --load` says what to pass. The stored tokenizer carries the model's
    vocabulary (313 > its 300 tokens); `evaluate --task perplexity` encodes with it and
    `--task needle` refuses it. A changed stored file is an error naming it (the flags still
    work), and `mcore-to-hf` refuses to copy it."""
    from mcore_flash.data.errors import DataError
    from mcore_flash.data.tokenizers import ByteTokenizer, HFTokenizer
    from mcore_flash.evaluation.cli import resolve
    from mcore_flash.preprocess import preprocess
    from mcore_flash.runtime.arguments import parse_args
    from mcore_flash.runtime.tokenizer import tokenizer_and_vocab

    mc, oracle = source["mc"], source["oracle"]
    stored = _run_tokenizer("--load", mc, "--use-checkpoint-args")
    assert isinstance(stored, HFTokenizer) and stored.vocab_size == MODEL_VOCAB
    assert stored.tokenize(TEXT) == oracle.encode(TEXT, add_special_tokens=False)
    assert tokenizer_and_vocab(parse_args(["--load", mc, "--use-checkpoint-args"]))[1] == 384
    explicit = _run_tokenizer("--load", mc, "--tokenizer-type", "ByteTokenizer")
    assert isinstance(explicit, ByteTokenizer)

    (tmp_path / "doc.txt").write_text(TEXT)
    args = resolve(
        ["--load", mc, "--task", "perplexity", "--input", str(tmp_path / "doc.txt")]
        + ["--seq-length", "32"]
    )
    assert args.texts.documents == (tuple(oracle(TEXT)["input_ids"]),)
    with pytest.raises(ValueError, match="stored with the checkpoint"):
        resolve(["--load", mc, "--task", "needle", "--seq-length", "64"])

    plain = make_hf_llama(tmp_path / "plain", vocab=258)
    code, out, err = _convert("hf-to-mcore", "--hf-dir", plain, "--save", tmp_path / "plain_mc")
    assert code == 0 and "has no tokenizer files" in out, err
    assert not os.path.exists(tmp_path / "plain_mc" / "tokenizer")
    assert _common(tmp_path / "plain_mc")["tokenizer"] is None
    assert isinstance(_run_tokenizer("--load", tmp_path / "plain_mc"), ByteTokenizer)
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    with pytest.raises(DataError, match="no checkpoint there stores a tokenizer"):
        preprocess(
            str(tmp_path / "docs.jsonl"),
            str(tmp_path / "d"),
            tokenizer_type=None,
            log=io.StringIO(),
            load=str(tmp_path / "plain_mc"),
        )
    code, out, err = _convert(
        "mcore-to-hf", "--load", tmp_path / "plain_mc", "--save-hf", tmp_path / "plain_out"
    )
    assert code == 0 and "(no tokenizer stored)" in out, err
    assert sorted(n for n in os.listdir(tmp_path / "plain_out") if "safetensors" not in n) == [
        "config.json",
        "generation_config.json",
    ]

    shutil.copytree(mc, tmp_path / "changed")
    with open(tmp_path / "changed" / "tokenizer" / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(DataError, match="tokenizer.json has changed since the checkpoint"):
        _run_tokenizer("--load", tmp_path / "changed")
    given = _run_tokenizer(
        "--load",
        tmp_path / "changed",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        source["hf"],
    )
    assert given.tokenize(TEXT) == stored.tokenize(TEXT) and given.vocab_size == TOKENIZER_VOCAB
    code, _, err = _convert(
        "mcore-to-hf", "--load", tmp_path / "changed", "--save-hf", tmp_path / "changed_out"
    )
    assert code == 2 and "tokenizer.json has changed" in err, err
    assert not os.path.exists(tmp_path / "changed_out")
