"""Build a small Llama-shaped GPTModel with the flash spec and run forward/backward on the CPU.

    python examples/gpt_flash_cpu.py

The same code runs on Ascend or CUDA: ``platform.setup()`` picks the device, and the
attention backend follows the tensors' device.
"""

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_flash import get_gpt_decoder_block_flash_spec, platform
from mcore_flash.measured_memory import measure_activation_bytes


def main():
    device = platform.setup()  # "npu", "cuda" or "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)

    config = TransformerConfig(
        num_layers=2,
        hidden_size=128,
        ffn_hidden_size=344,
        num_attention_heads=8,
        num_query_groups=2,  # GQA: K/V are never expanded
        normalization="RMSNorm",
        gated_linear_unit=True,  # SwiGLU
        activation_func=torch.nn.functional.silu,
        use_te_activation_func=True,  # megatron's activation hook: our fused SwiGLU
        add_bias_linear=False,
        use_cpu_initialization=True,
        recompute_granularity="selective",  # with our spec: the attention sub-block keeps only its input
        recompute_modules=["core_attn"],
    )
    model = GPTModel(
        config,
        get_gpt_decoder_block_flash_spec(config),
        vocab_size=256,
        max_sequence_length=1024,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).to(platform.torch_device())

    seq, batch = 1024, 1
    tokens = torch.randint(0, 256, (batch, seq), device=platform.torch_device())
    positions = torch.arange(seq, device=tokens.device).unsqueeze(0)
    saved = measure_activation_bytes(model, tokens, positions, None, labels=tokens)
    loss = model(
        tokens, positions, None, labels=tokens
    ).mean()  # attention_mask=None: causal, no S x S mask
    loss.backward()
    print(
        f"device={device} loss={loss.item():.4f} saved-for-backward per layer={saved.layer_total() / 2**20:.2f} MiB"
    )
    for name, nbytes in saved.per_layer().items():
        print(f"  {name:<36} {nbytes / 2**20:8.2f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
