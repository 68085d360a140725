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
