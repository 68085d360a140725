"""`mcore-flash generate`: megatron's KV cache, sampling, `--chat` and the launcher's layout.

Oracles: the no-cache path (the whole sequence every step) and `transformers` (greedy
`generate`, which uses its own KV cache; teacher-forced logits, which a plain-Python float64
filter for temperature, top-k and top-p turns into draws with the same seeded generator;
`apply_chat_template`) on a random 2-layer Llama with a byte-level BPE tokenizer of 300 tokens
whose chat template uses trim_blocks, special tokens, `raise_exception` and `{% generation %}`.
The checkpoint pads the vocabulary to 512 rows (`--make-vocab-size-divisible-by 256`, the same
at TP1 and TP2): 212 rows a sampler must never choose.
"""

from __future__ import annotations

import math

import pytest
import torch

from _support.cli_runs import convert
from _support.dist_utils import run_distributed
from _support.hf_models import hf_greedy, make_hf_llama, make_hf_tokenizer

VOCAB = 300
PADDING = ["--make-vocab-size-divisible-by", "256"]
PROMPT = [1, 17, 99, 4, 250, 31, 140, 7]
GREEDY = ["--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12"]
SAMPLED = [*GREEDY, "--ignore-eos", "--temperature", "0.7", "--top-k", "40", "--top-p", "0.9"]
CHAT_TEXT = "  hello world, the quick fox!  "
CHAT_TEMPLATE = """{{ bos_token }}{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('unknown role: ' + message['role']) }}
{% endif %}
<|{{ message['role'] }}|>
{% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | trim }}{% endgeneration %}
{% else %}
{{ message['content'] | trim }}
{% endif %}
{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The Hugging Face directory (model, tokenizer with CHAT_TEMPLATE) and its conversion."""
    root = tmp_path_factory.mktemp("generate")
    src = root / "hf"
    ids = make_hf_tokenizer(src, vocab=VOCAB)
    (src / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    make_hf_llama(src, vocab=VOCAB, layers=2, **ids)
    convert("hf-to-mcore", "--hf-dir", src, "--save", root / "mc", *PADDING)
    return {"hf": str(src), "mc": str(root / "mc"), "root": root}


def _w_generate(rank, world_size, load, runs):
    """`generate` for each ``runs`` entry (name -> flags) in one process group: ``{name:
    (prompt ids, output ids, calls)}`` as this rank has them; ``calls``: ``(query length, key
    length, attn_mask_type)`` of each call megatron makes to core attention in this rank's
    first layer."""
    from mcore_flash.generate import generate, parse_generate_args
    from mcore_flash.runtime.distributed import init_distributed
    from mcore_flash.transformer.attention import FlashDotProductAttention

    calls = []
    forward = FlashDotProductAttention.forward

    def recording(self, query, key, *args, **kwargs):
        mask_type = kwargs["attn_mask_type"].name
        calls.append((self.layer_number, query.shape[0], key.shape[0], mask_type))
        return forward(self, query, key, *args, **kwargs)

    FlashDotProductAttention.forward = recording
    parsed = {
        name: parse_generate_args(["--load", load, *PADDING, *map(str, argv)])
        for name, argv in runs.items()
    }
    init_distributed(next(iter(parsed.values())).run)
    results = {}
    for name, args in parsed.items():
        calls.clear()
        prompt, output, _ = generate(args)
        first = min(layer for layer, *_ in calls)
        results[name] = (prompt, output, [call[1:] for call in calls if call[0] == first])
    return results


def _generate(source, runs, world_size=1, layout=()):
    """``({name: output ids}, {name: (prompt ids, output ids, calls)})`` of
    :func:`_w_generate`; the ranks must agree."""
    runs = {name: [*layout, *argv] for name, argv in runs.items()}
    results = run_distributed(_w_generate, world_size, source["mc"], runs, timeout=300)
    assert all(result == results[0] for result in results), "the ranks disagree"
    return {name: output for name, (_, output, _) in results[0].items()}, results[0]


def _cache_calls(prompt_length, new_tokens):
    """What megatron's static KV cache passes to core attention: the prompt (causal), then
    each new token's query against the keys so far (megatron's no_mask)."""
    decode = [(1, n, "no_mask") for n in range(prompt_length + 1, prompt_length + new_tokens)]
    return [(prompt_length, prompt_length, "causal"), *decode]


def _hf_logits(src, tokens):
    """transformers' float64 next-token logits ``[len(tokens), VOCAB]`` after each prefix."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].double()


def _oracle_draw(logits, temperature, top_k, top_p, generator):
    """One draw, written apart from the code under test: plain Python float64 for the filter
    (top-k: the scores at least the K-th largest; top-p: the most probable tokens, one by one,
    until their mass reaches P), then ``torch.multinomial`` with ``generator``."""
    scores = [value / temperature for value in logits.tolist()]
    kth = sorted(scores, reverse=True)[top_k - 1]
    weights = [math.exp(s - max(scores)) if s >= kth else 0.0 for s in scores]
    total = sum(weights)
    probabilities = [w / total for w in weights]
    mass, nucleus = 0.0, set()
    for token in sorted(range(len(scores)), key=lambda t: -probabilities[t]):
        if mass >= top_p:
            break
        nucleus.add(token)
        mass += probabilities[token]
    kept = torch.tensor([p if t in nucleus else 0.0 for t, p in enumerate(probabilities)])
    return int(torch.multinomial(kept.double() / kept.sum(), 1, generator=generator))


def _oracle_sampled(src, prompt, output, seed, temperature=0.7, top_k=40, top_p=0.9):
    """The oracle's draws, step by step, given the same earlier tokens as ``output``."""
    logits = _hf_logits(src, prompt + output[:-1])[len(prompt) - 1 :]
    generator = torch.Generator().manual_seed(seed)
    return [_oracle_draw(step, temperature, top_k, top_p, generator) for step in logits]


def test_kv_cache_and_sampling_at_tp1_equal_transformers_and_float64(source):
    """At TP1: the KV cache (the prompt once, then one token a step) gives transformers' greedy
    tokens (its `generate` with its own cache) and the no-cache path's; `--temperature 0`, `--top-k 1` (Megatron-LM's `--top_k`
    spelling) and a tiny `--top-p` are greedy; a seeded sample equals the float64 oracle's
    draws, with and without the cache, and another seed draws other tokens; at temperature 100
    (near-uniform) 48 draws over the real vocabulary never hit the 212 padding rows (if they
    could, (300/512)^48 < 1e-11 of such runs would miss them all); `--chat` encodes the prompt
    as transformers' `apply_chat_template(add_generation_prompt=True)` and continues it as
    transformers does."""
    from transformers import AutoTokenizer

    hot = [*SAMPLED[:3], "48", "--ignore-eos", "--temperature", "100", "--seed", "3"]
    outputs, full = _generate(
        source,
        {
            "greedy": GREEDY,
            "no-cache": [*GREEDY, "--no-kv-cache"],
            "temperature-0": [*GREEDY, "--temperature", "0", "--seed", "5"],
            "top-k-1": [*GREEDY, "--temperature", "1", "--top_k", "1"],
            "top-p-tiny": [*GREEDY, "--temperature", "1", "--top-p", "1e-9"],
            "sampled": [*SAMPLED, "--seed", "7"],
            "sampled-no-cache": [*SAMPLED, "--seed", "7", "--no-kv-cache"],
            "other-seed": [*SAMPLED, "--seed", "8"],
            "hot": hot,
            "chat": ["--prompt", CHAT_TEXT, "--chat", "--max-new-tokens", "6"],
        },
    )
    src = source["hf"]
    expected = hf_greedy(src, PROMPT, 12)
    assert len(expected) == 12  # no end-of-sequence token cuts the comparison short
    for name in ("greedy", "no-cache", "temperature-0", "top-k-1", "top-p-tiny"):
        assert outputs[name] == expected, name
    n = len(PROMPT)
    assert full["greedy"][2] == _cache_calls(n, 12)
    assert full["no-cache"][2] == [(length, length, "causal") for length in range(n, n + 12)]

    sampled = outputs["sampled"]
    assert sampled == _oracle_sampled(src, PROMPT, sampled, seed=7)
    assert outputs["sampled-no-cache"] == sampled
    assert outputs["other-seed"] != sampled and sampled != expected
    assert outputs["other-seed"] == _oracle_sampled(src, PROMPT, outputs["other-seed"], seed=8)

    assert len(outputs["hot"]) == 48 and max(outputs["hot"]) < VOCAB
    assert len(set(outputs["hot"])) > 30  # near-uniform draws, not a stuck argmax

    chat_ids = AutoTokenizer.from_pretrained(src).apply_chat_template(
        [{"role": "user", "content": CHAT_TEXT}], add_generation_prompt=True
    )["input_ids"]
    assert full["chat"][:2] == (chat_ids, hf_greedy(src, chat_ids, 6))


@pytest.mark.parametrize(
    "layout", [("--tensor-model-parallel-size", "2"), ("--pipeline-model-parallel-size", "2")]
)
def test_kv_cache_and_sampling_agree_across_ranks_and_layouts(source, layout):
    """At TP2 and PP2 (two processes, as torchrun starts them): every rank returns the same
    tokens; greedy with the cache (the prompt once, then one token a step on every stage)
    equals the no-cache path and transformers; a seeded sample equals the float64 oracle's
    draws (and so TP1's)."""
    outputs, full = _generate(
        source,
        {
            "greedy": GREEDY,
            "no-cache": [*GREEDY, "--no-kv-cache"],
            "sampled": [*SAMPLED, "--seed", "7"],
        },
        world_size=2,
        layout=layout,
    )
    expected = hf_greedy(source["hf"], PROMPT, 12)
    assert outputs["greedy"] == outputs["no-cache"] == expected
    assert full["greedy"][2] == _cache_calls(len(PROMPT), 12)  # on each rank's first layer
    assert outputs["sampled"] == _oracle_sampled(source["hf"], PROMPT, outputs["sampled"], seed=7)


def _run_main(capsys, *argv):
    """`generate`'s main in this process (flags refused before any process group):
    ``(exit code, stderr)``."""
    from mcore_flash.generate import main

    code = main([*map(str, argv)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top-k", "5"], "--top-k restrict sampling: give --temperature > 0"),
        (["--top-p", "0.5"], "--top-p restrict sampling: give --temperature > 0"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--temperature", "1", "--top-k", "0"], "--top-k must be >= 1"),
        (["--temperature", "1", "--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
        (["--chat"], "--chat puts --prompt TEXT in the chat template"),
        (["--sequence-parallel"], "--sequence-parallel: generate runs without it"),
        (["--context-parallel-size", "2"], "generate runs with --context-parallel-size 1"),
    ],
)
def test_bad_flags_are_refused_by_name(source, capsys, monkeypatch, flags, message):
    """(At TP2 on two processes, so that --sequence-parallel is a valid training flag.)"""
    import re

    monkeypatch.setenv("WORLD_SIZE", "2")
    layout = ["--tensor-model-parallel-size", "2"]
    code, err = _run_main(capsys, "--load", source["mc"], "--prompt-ids", "1,2", *layout, *flags)
    assert code == 2 and re.search(message, err), err


def test_processes_without_the_layout_flags_get_an_error_naming_them(source, capsys, monkeypatch):
    """Two processes (torchrun --nproc-per-node 2) and no layout flag: not a training error
    about the global batch and data parallelism, but the flags that say the layout."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, err = _run_main(capsys, "--load", source["mc"], "--prompt-ids", "1,2")
    assert code == 2
    assert "--tensor-model-parallel-size x --pipeline-model-parallel-size must be 2" in err, err
    assert "batch" not in err


def test_chat_without_a_template_or_with_a_failing_one_names_chat(source):
    """`--chat` with the byte-level tokenizer (no template), and with a template that raises
    for the message: errors that name `--chat`."""
    from mcore_flash.generate import parse_generate_args, prompt_ids
    from mcore_flash.runtime.tokenizer import run_tokenizer

    failing = source["root"] / "failing-template"
    make_hf_tokenizer(failing, vocab=VOCAB)
    (failing / "chat_template.jinja").write_text("{{ raise_exception('system message first') }}")
    cases = [
        (
            ["--tokenizer-type", "ByteTokenizer"],
            r"the tokenizer \(ByteTokenizer\) has no chat template",
        ),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", failing],
            "the tokenizer's chat template failed: system message first",
        ),
    ]
    for flags, message in cases:
        args = parse_generate_args(
            ["--load", source["mc"], "--prompt", "hi", "--chat", *map(str, flags)]
        )
        with pytest.raises(ValueError, match="--chat: " + message):
            prompt_ids(args, run_tokenizer(args.run))
