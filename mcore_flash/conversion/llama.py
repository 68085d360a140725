"""Where each Hugging Face Llama / Qwen2 / Qwen3 tensor lives in megatron's checkpoint, and how
it is laid out.

megatron's ``dist_checkpointing`` stores tensors in their global (TP = PP = 1) layout, so one
mapping serves every parallel layout: per-layer tensors share a key with a leading layer
axis (``decoder.layers.<module>`` ``[num_layers, ...]``), and

* ``linear_qkv.weight`` is laid out per KV group: ``[ng, (np/ng) query heads + key + value, hn, h]``
  (Hugging Face: ``q_proj`` ``[np*hn, h]``, ``k_proj``/``v_proj`` ``[ng*hn, h]``), and so is
  Qwen2's ``linear_qkv.bias`` (``q_proj``/``k_proj``/``v_proj.bias``); ``hn`` is ``kv_channels``
  (Qwen3's ``head_dim``) or hidden / heads;
* Qwen3's ``q_norm``/``k_norm`` (``[hn]``, one per layer, shared by the heads) are
  ``self_attention.q_layernorm``/``k_layernorm``;
* ``linear_fc1.weight`` is ``[gate; up]`` (``gate_proj``, ``up_proj``);
* the embedding (and an untied output layer) has ``padded_vocab_size`` rows; the padding
  rows are zero on import and dropped on export.

megatron's rotary embedding is rotate-half, as Hugging Face stores these models (no q/k
permutation).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One megatron tensor (``key``; ``layer`` on its layer axis, or None) and the Hugging Face
    tensors it is made of, with the two layout transforms."""

    key: str
    layer: Optional[int]
    hf_names: tuple[str, ...]
    to_mcore: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]


def tensor_maps(model_args: dict, padded_vocab_size: int) -> list[TensorMap]:
    """Every tensor of the model, embedding first, then layer by layer, then the head."""
    heads, groups = model_args["num_attention_heads"], model_args["num_query_groups"]
    head_dim = model_args.get("kv_channels") or model_args["hidden_size"] // heads
    vocab = model_args["vocab_size"]

    def qkv(key, layer, prefix, suffix):
        return TensorMap(
            key,
            layer,
            tuple(f"{prefix}{p}_proj.{suffix}" for p in "qkv"),
            lambda t: qkv_to_mcore(*t, heads, groups, head_dim),
            lambda t: qkv_to_hf(t, heads, groups, head_dim),
        )

    def copy(key, layer, name):
        return TensorMap(key, layer, (name,), lambda t: t[0], lambda t: [t])

    def vocab_rows(key, name):
        return TensorMap(
            key, None, (name,), lambda t: pad_vocab(t[0], padded_vocab_size), lambda t: [t[:vocab]]
        )

    maps = [vocab_rows("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(model_args["num_layers"]):
        hf, mc = f"model.layers.{i}.", "decoder.layers."
        maps += [
            copy(
                mc + "self_attention.linear_qkv.layer_norm_weight", i, hf + "input_layernorm.weight"
            ),
            qkv(mc + "self_attention.linear_qkv.weight", i, hf + "self_attn.", "weight"),
        ]
        if model_args.get("add_qkv_bias"):  # Qwen2
            maps.append(qkv(mc + "self_attention.linear_qkv.bias", i, hf + "self_attn.", "bias"))
        if model_args.get("qk_layernorm"):  # Qwen3
            maps += [
                copy(
                    mc + f"self_attention.{p}_layernorm.weight",
                    i,
                    hf + f"self_attn.{p}_norm.weight",
                )
                for p in "qk"
            ]
        maps += [
            copy(mc + "self_attention.linear_proj.weight", i, hf + "self_attn.o_proj.weight"),
            copy(
                mc + "mlp.linear_fc1.layer_norm_weight", i, hf + "post_attention_layernorm.weight"
            ),
            TensorMap(
                mc + "mlp.linear_fc1.weight",
                i,
                (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                lambda t: torch.cat(t),
                lambda t: list(t.chunk(2)),
            ),
            copy(mc + "mlp.linear_fc2.weight", i, hf + "mlp.down_proj.weight"),
        ]
    maps.append(copy("decoder.final_layernorm.weight", None, "model.norm.weight"))
    if model_args["untie_embeddings_and_output_weights"]:
        maps.append(vocab_rows("output_layer.weight", "lm_head.weight"))
    return maps


def hf_shape(name: str, model_args: dict) -> tuple[int, ...]:
    """The shape of the Hugging Face tensor ``name`` for ``model_args``."""
    h, ffn, vocab = (
        model_args["hidden_size"],
        model_args["ffn_hidden_size"],
        model_args["vocab_size"],
    )
    head_dim = model_args.get("kv_channels") or h // model_args["num_attention_heads"]
    q = model_args["num_attention_heads"] * head_dim
    kv = model_args["num_query_groups"] * head_dim
    by_suffix = {
        "embed_tokens.weight": (vocab, h),
        "lm_head.weight": (vocab, h),
        "q_proj.weight": (q, h),
        "k_proj.weight": (kv, h),
        "v_proj.weight": (kv, h),
        "q_proj.bias": (q,),
        "k_proj.bias": (kv,),
        "v_proj.bias": (kv,),
        "q_norm.weight": (head_dim,),
        "k_norm.weight": (head_dim,),
        "o_proj.weight": (h, q),
        "gate_proj.weight": (ffn, h),
        "up_proj.weight": (ffn, h),
        "down_proj.weight": (h, ffn),
    }
    return next(
        (shape for suffix, shape in by_suffix.items() if name.endswith(suffix)), (h,)
    )  # else a norm


def qkv_to_mcore(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, head_dim: int
):
    """``[np*hn, h]``, ``[ng*hn, h]`` x2 -> megatron's ``[ng*(np/ng + 2)*hn, h]`` (biases alike,
    without the ``h``)."""
    rest = q.shape[1:]
    per_group = [
        q.reshape(groups, heads // groups * head_dim, *rest),
        k.reshape(groups, head_dim, *rest),
        v.reshape(groups, head_dim, *rest),
    ]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def qkv_to_hf(qkv: torch.Tensor, heads: int, groups: int, head_dim: int) -> list[torch.Tensor]:
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, -1, *rest).split(
        [heads // groups * head_dim, head_dim, head_dim], dim=1
    )
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows up to ``padded_rows`` (megatron pads the vocabulary for TP)."""
    if weight.shape[0] > padded_rows:
        raise ValueError(
            f"{weight.shape[0]} vocabulary rows do not fit the padded size {padded_rows}"
        )
    return torch.cat([weight, weight.new_zeros(padded_rows - weight.shape[0], *weight.shape[1:])])
