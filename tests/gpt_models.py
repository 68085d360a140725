"""Tiny Llama-shaped GPTModels for tests (RMSNorm, SwiGLU, GQA, RoPE), built in workers.

TP-partitioned gradients are gathered back to full tensors so a TP=2 run can be compared
with a TP=1 run of the same weights (megatron initialises the full master weight on the
CPU from the seed and slices it, so both runs start from identical models).
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
            if name.endswith("linear_fc1.weight") and model.config.gated_linear_unit:
                # each rank holds [gate_r; up_r]: the full weight is [gate_0..; up_0..]
                halves = [part.chunk(2, dim=param.partition_dim) for part in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            grad = torch.cat(parts, dim=param.partition_dim)
        grads[name.removeprefix("module.")] = grad
    return grads


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits ``[..., V/tp]`` -> ``[..., V]``."""
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)
