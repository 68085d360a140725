"""Tiny Llama-shaped GPTModels for tests (RMSNorm, SwiGLU, GQA, RoPE), built in workers.

A TP=2 run is compared with a TP=1 run of the same weights by copying them: the TP=1
model's parameters are sliced into each TP rank's shard (``load_full_weights``), and its
TP-partitioned gradients are gathered back to full tensors (``full_grads``). Equal seeds are
not relied on (how megatron slices its initial weights changed across releases).
"""

from __future__ import annotations

import torch

VOCAB = 128
SEQ = 32


def tiny_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def build_gpt(config, spec, seed: int = 0):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=4 * SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )


def flash_gpt(config, seed: int = 0, **spec_kwargs):
    from mcore_flash.transformer import get_gpt_decoder_block_flash_spec

    return build_gpt(config, get_gpt_decoder_block_flash_spec(config, **spec_kwargs), seed)


def batch(batch_size: int = 2, seq: int = SEQ, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, seq + 1), generator=generator)
    positions = torch.arange(seq).expand(batch_size, seq)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), positions


def causal_mask(seq: int = SEQ):
    return torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)


def _glu_fc1(name: str, model) -> bool:
    """Each TP rank holds ``[gate_r; up_r]`` of a gated fc1; the full weight is ``[gate; up]``."""
    return name.endswith("linear_fc1.weight") and model.config.gated_linear_unit


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (``main_grad`` under DDP) as a full, unpartitioned tensor."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    world = parallel_state.get_tensor_model_parallel_world_size()
    grads = {}
    for name, param in model.named_parameters():
        grad = getattr(param, "main_grad", None)
        grad = (param.grad if grad is None else grad).detach().clone()
        if world > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(grad) for _ in range(world)]
            torch.distributed.all_gather(parts, grad.contiguous(), group=group)
            if _glu_fc1(name, model):
                halves = [part.chunk(2, dim=param.partition_dim) for part in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            grad = torch.cat(parts, dim=param.partition_dim)
        grads[name.removeprefix("module.")] = grad
    return grads


def assert_same_bits(loss, grads, ref_loss, ref_grads, what: str) -> None:
    """Loss and every gradient equal the reference's bit for bit (recompute must change nothing)."""
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0, msg=what)
    assert grads.keys() == ref_grads.keys(), what
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=0, rtol=0, msg=f"{what}: {name}")


def full_weights(model) -> dict[str, torch.Tensor]:
    """A TP=1 model's parameters by name (DDP's ``module.`` prefix dropped)."""
    from megatron.core import parallel_state

    assert parallel_state.get_tensor_model_parallel_world_size() == 1, "full_weights needs TP=1"
    return {
        name.removeprefix("module."): p.detach().clone() for name, p in model.named_parameters()
    }


def load_full_weights(model, weights: dict[str, torch.Tensor]) -> None:
    """Copy full (TP=1) ``weights`` into this rank's shard of ``model``: the inverse of
    ``full_grads``' gather (contiguous slices along ``partition_dim``; gate and up halves
    sliced separately for a gated fc1)."""
    from megatron.core import parallel_state

    world = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    names = {name.removeprefix("module.") for name, _ in model.named_parameters()}
    assert names == weights.keys(), names ^ weights.keys()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = weights[name.removeprefix("module.")]
            if world > 1 and getattr(param, "tensor_model_parallel", False):
                dim = param.partition_dim
                halves = full.chunk(2, dim=dim) if _glu_fc1(name, model) else (full,)
                full = torch.cat([half.chunk(world, dim=dim)[rank] for half in halves], dim=dim)
            param.copy_(full)


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits ``[..., V/tp]`` -> ``[..., V]``."""
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)
