"""Random Hugging Face Llama checkpoints written by `transformers` itself (the tests' oracle)."""

from __future__ import annotations

import torch

ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def make_hf_llama(path, vocab=258, tie=False, seed=0, hidden=64, ffn=160, layers=4, **overrides):
    """A small random Llama (GQA: 4 heads, 2 KV heads; llama3 RoPE scaling; eps 1e-6; any
    LlamaConfig field in ``overrides``) saved by transformers in several safetensors shards;
    norms are randomised too so a swapped tensor shows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        rope_theta=500000.0,
        rope_scaling=ROPE_LLAMA3,
    )
    config = LlamaConfig(**{**fields, **overrides})
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
    model.save_pretrained(path, max_shard_size="100KB")
    return str(path)


def make_hf_qwen2(path, vocab=258, tie=False, seed=0, hidden=64, ffn=160, layers=4, **overrides):
    """A small random Qwen2/Qwen2.5 (q/k/v biases, no o_proj bias; GQA: 4 heads, 2 KV heads;
    rope_theta 1e6 as Qwen2.5; eps 1e-6; any Qwen2Config field in ``overrides``) saved by
    transformers in several safetensors shards; norms and biases are randomised so a swapped
    tensor shows."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn)
    fields.update(num_hidden_layers=layers, tie_word_embeddings=tie, rope_theta=1e6)
    return _save_random(Qwen2Config, Qwen2ForCausalLM, path, seed, {**fields, **overrides})


def make_hf_qwen3(
    path, vocab=258, tie=False, seed=0, hidden=64, ffn=160, layers=4, head_dim=32, **overrides
):
    """A small random dense Qwen3 (per-head q/k RMSNorm, no biases; GQA: 4 heads, 2 KV heads;
    ``head_dim`` 32, not hidden / heads = 16, as Qwen3-32B's is not; rope_theta 1e6; eps 1e-6;
    any Qwen3Config field in ``overrides``) saved by transformers in several safetensors
    shards; the norms (q/k norms included) are randomised so a swapped tensor shows."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, head_dim=head_dim)
    fields.update(num_hidden_layers=layers, tie_word_embeddings=tie, rope_theta=1e6)
    return _save_random(Qwen3Config, Qwen3ForCausalLM, path, seed, {**fields, **overrides})


def _save_random(config_class, model_class, path, seed, fields):
    torch.manual_seed(seed)
    defaults = dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_scaling=None,
    )
    model = model_class(config_class(**{**defaults, **fields}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path, max_shard_size="100KB")
    return str(path)


def hf_greedy(src, prompt, n):
    """transformers' ``generate(do_sample=False)`` of at most ``n`` tokens after ``prompt`` by
    the model in ``src`` (any architecture, fp32), stopping where its generation config says."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def hf_padded_token_losses(src, tokens, padded_vocab):
    """Per-token cross-entropy (float64) of transformers' fp32 logits for ``tokens[:, 1:]``
    given ``tokens[:, :-1]`` (model in ``src``, any architecture), with zero logits appended up
    to ``padded_vocab`` rows: what a megatron model with zero padding rows computes."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits.double()
    pad = logits.new_zeros(*logits.shape[:2], padded_vocab - logits.shape[-1])
    return torch.nn.functional.cross_entropy(
        torch.cat([logits, pad], dim=-1).flatten(0, 1), tokens[:, 1:].flatten(), reduction="none"
    )


TOKENIZER_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a long context needs a long memory, and a tokenizer that travels",
    "hello world, hello megatron: checkpoints carry their tokenizers",
] * 20
# the special tokens of make_hf_tokenizer, in id order (ids 0..3)
TOKENIZER_SPECIALS = {
    "pad_token": "<pad>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
}


def make_hf_tokenizer(path, vocab=300):
    """A byte-level BPE tokenizer of ``vocab`` tokens trained by the `tokenizers` library on a
    small corpus (ids 0..3: ``<pad> <s> </s> <unk>``), with a chat template, saved into the
    directory ``path`` by transformers' ``PreTrainedTokenizerFast.save_pretrained``
    (tokenizer.json, tokenizer_config.json, chat_template.jinja). Returns the special-token ids
    as config.json names them (``pad_token_id``, ``bos_token_id``, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(TOKENIZER_SPECIALS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TOKENIZER_CORPUS, trainer)
    assert tokenizer.get_vocab_size() == vocab, tokenizer.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **TOKENIZER_SPECIALS)
    fast.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    fast.save_pretrained(str(path))
    return {
        f"{name}_id": tokenizer.token_to_id(token) for name, token in TOKENIZER_SPECIALS.items()
    }


def make_tokenized_data(root) -> dict[str, str]:
    """Under the directory ``root``: a :func:`make_hf_tokenizer` tokenizer and 50 short
    documents preprocessed with it (an EOD after each). Returns ``{"tokenizer": its
    directory, "data": the indexed dataset's prefix}`` (``--tokenizer-model``, ``--data-path``)."""
    import io
    import json
    import os

    from mcore_flash.preprocess import preprocess

    make_hf_tokenizer(os.path.join(root, "tokenizer"))
    corpus = os.path.join(root, "corpus.jsonl")
    with open(corpus, "w") as f:
        f.writelines(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(50))
    data = preprocess(
        corpus,
        os.path.join(root, "corpus"),
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=os.path.join(root, "tokenizer"),
        append_eod=True,
        log=io.StringIO(),
    )["text"]
    return {"tokenizer": os.path.join(root, "tokenizer"), "data": data}
