"""What an exported checkpoint must hold: the saving run's weights under Hugging Face's names."""

from __future__ import annotations

import torch


def assert_exports(load: str, save_hf: str, weights: dict, iteration: int) -> None:
    """``convert mcore-to-hf`` of the checkpoint in ``load`` (saved at ``iteration``) gives the
    saving run's ``weights`` (:func:`.recipe_runs.full_weights`) under Hugging Face Llama's
    names, mapped here by hand (q, k, v per KV group; gate then up), bit for bit."""
    from mcore_flash.conversion.mcore_to_hf import mcore_to_hf
    from mcore_flash.conversion.safetensors_io import HFCheckpointReader

    result = mcore_to_hf(load, save_hf, log=lambda *args: None)
    assert result["iteration"] == iteration
    config, hf = result["config"], HFCheckpointReader(save_hf)
    vocab, heads = config["vocab_size"], config["num_attention_heads"]
    groups, head_dim = config["num_key_value_heads"], config["hidden_size"] // heads
    expected = {
        "model.embed_tokens.weight": weights["embedding.word_embeddings.weight"][:vocab],
        "model.norm.weight": weights["decoder.final_layernorm.weight"],
        "lm_head.weight": weights["output_layer.weight"][:vocab],
    }
    for i in range(config["num_hidden_layers"]):
        mc, name = f"decoder.layers.{i}.", f"model.layers.{i}."
        per_group = weights[mc + "self_attention.linear_qkv.weight"].reshape(
            groups, (heads // groups + 2) * head_dim, -1
        )
        q = per_group[:, : heads // groups * head_dim]
        k = per_group[:, heads // groups * head_dim : -head_dim]
        gate, up = weights[mc + "mlp.linear_fc1.weight"].chunk(2)
        expected |= {
            name + "input_layernorm.weight": weights[mc + "input_layernorm.weight"],
            name + "post_attention_layernorm.weight": weights[mc + "pre_mlp_layernorm.weight"],
            name + "self_attn.q_proj.weight": q.reshape(-1, q.shape[-1]),
            name + "self_attn.k_proj.weight": k.reshape(-1, k.shape[-1]),
            name + "self_attn.v_proj.weight": per_group[:, -head_dim:].reshape(-1, q.shape[-1]),
            name + "self_attn.o_proj.weight": weights[mc + "self_attention.linear_proj.weight"],
            name + "mlp.gate_proj.weight": gate,
            name + "mlp.up_proj.weight": up,
            name + "mlp.down_proj.weight": weights[mc + "mlp.linear_fc2.weight"],
        }
    assert hf.names() == set(expected), sorted(hf.names() ^ set(expected))
    for name, tensor in expected.items():
        assert torch.equal(hf.get(name), tensor), name
