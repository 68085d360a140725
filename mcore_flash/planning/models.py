"""Model shapes the planner knows by name (pure Python: no torch, no megatron)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

__all__ = ["ModelShape", "MODELS", "get_model"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only GPT shape as megatron-core's ``GPTModel`` builds it.

    ``kv_channels`` defaults to ``hidden_size // num_attention_heads``. ``gated_linear_unit``
    makes ``linear_fc1`` ``h -> 2 * ffn`` (SwiGLU); ``activation`` is ``"swiglu"`` or
    ``"gelu"`` (the plain 2-matrix MLP). ``add_qkv_bias`` gives ``linear_qkv`` alone a bias
    (Qwen2/Qwen2.5; ``add_bias_linear`` gives every linear one). ``rope_scaling`` is Llama-3.1's frequency scaling
    (``rope_scaling_factor`` over 8192 original positions, low/high frequency factors 1 and
    4: megatron's ``RotaryEmbedding``); ``norm_epsilon`` the norms' epsilon.
    """

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    kv_channels: Optional[int] = None
    normalization: str = "RMSNorm"  # or "LayerNorm" (weight + bias)
    activation: str = "swiglu"  # or "gelu"
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = True
    position_embedding_type: str = "rope"  # or "learned_absolute"
    max_position_embeddings: int = 4096
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"{self.name}: num_query_groups ({self.num_query_groups}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{self.name}: hidden_size must be divisible by num_attention_heads (or give kv_channels)"
            )
        if self.activation not in ("swiglu", "gelu"):
            raise ValueError(
                f"{self.name}: activation {self.activation!r}: choose 'swiglu' or 'gelu'"
            )
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(
                f"{self.name}: normalization {self.normalization!r}: choose 'RMSNorm' or 'LayerNorm'"
            )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    def with_(self, **changes) -> "ModelShape":
        """A copy with some fields changed (``name`` kept unless given)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


MODELS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        # Llama-2-70B: 80 layers, hidden 8192, FFN 28672, 64 heads, 8 KV groups, vocab 32000.
        ModelShape("llama2-70b", 80, 8192, 28672, 64, 8, 32000),
        ModelShape("llama2-13b", 40, 5120, 13824, 40, 40, 32000),
        ModelShape("llama2-7b", 32, 4096, 11008, 32, 32, 32000),
        # Llama-3-70B: same body, 128K vocabulary, RoPE base 500000, 8K positions.
        ModelShape(
            "llama3-70b",
            80,
            8192,
            28672,
            64,
            8,
            128256,
            max_position_embeddings=8192,
            rotary_base=500000,
        ),
        ModelShape(
            "llama3-8b",
            32,
            4096,
            14336,
            32,
            8,
            128256,
            max_position_embeddings=8192,
            rotary_base=500000,
        ),
        # Llama-3.1: the Llama-3 bodies at 131072 positions with the "llama3" RoPE scaling
        # (factor 8 over 8192 original positions, low/high frequency factors 1 and 4).
        ModelShape(
            "llama3.1-70b",
            80,
            8192,
            28672,
            64,
            8,
            128256,
            max_position_embeddings=131072,
            rotary_base=500000,
            rope_scaling=True,
            rope_scaling_factor=8.0,
        ),
        ModelShape(
            "llama3.1-8b",
            32,
            4096,
            14336,
            32,
            8,
            128256,
            max_position_embeddings=131072,
            rotary_base=500000,
            rope_scaling=True,
            rope_scaling_factor=8.0,
        ),
        # Llama-3.2-1B: tied embeddings, the llama3 RoPE scaling with factor 32.
        ModelShape(
            "llama3.2-1b",
            16,
            2048,
            8192,
            32,
            8,
            128256,
            untie_embeddings_and_output_weights=False,
            max_position_embeddings=131072,
            rotary_base=500000,
            rope_scaling=True,
            rope_scaling_factor=32.0,
        ),
        # Qwen2.5-72B (huggingface.co/Qwen/Qwen2.5-72B, config.json): 80 layers, hidden 8192,
        # FFN 29568, 64 heads, 8 KV groups, vocab 152064, untied, q/k/v biases (no o_proj bias),
        # rope_theta 1e6, 131072 positions, rms_norm_eps 1e-5.
        ModelShape(
            "qwen2.5-72b",
            80,
            8192,
            29568,
            64,
            8,
            152064,
            add_qkv_bias=True,
            max_position_embeddings=131072,
            rotary_base=1000000,
        ),
        # Qwen3-32B (huggingface.co/Qwen/Qwen3-32B, config.json): 64 layers, hidden 5120,
        # FFN 25600, 64 heads of head_dim 128 (64 x 128 = 8192, not 5120: kv_channels), 8 KV
        # groups, vocab 151936, untied, per-head q/k RMSNorm, no biases, rope_theta 1e6,
        # 40960 positions, rms_norm_eps 1e-6.
        ModelShape(
            "qwen3-32b",
            64,
            5120,
            25600,
            64,
            8,
            151936,
            kv_channels=128,
            qk_layernorm=True,
            max_position_embeddings=40960,
            rotary_base=1000000,
            norm_epsilon=1e-6,
        ),
        # Qwen3-8B (huggingface.co/Qwen/Qwen3-8B, config.json): 36 layers, hidden 4096, FFN
        # 12288, 32 heads (head_dim 128 = 4096 / 32), 8 KV groups, vocab 151936, untied,
        # per-head q/k RMSNorm, rope_theta 1e6, 40960 positions, rms_norm_eps 1e-6.
        ModelShape(
            "qwen3-8b",
            36,
            4096,
            12288,
            32,
            8,
            151936,
            qk_layernorm=True,
            max_position_embeddings=40960,
            rotary_base=1000000,
            norm_epsilon=1e-6,
        ),
        # The model `mcore-flash pretrain --model tiny` trains (its default CPU job): 2 layers,
        # h 128, ffn 352, 4 heads, 2 groups, 256 positions; the byte-level tokenizer's 258 ids
        # padded to 384 rows (--make-vocab-size-divisible-by 128 at TP 1).
        ModelShape("tiny", 2, 128, 352, 4, 2, 384, max_position_embeddings=256),
    )
}


def get_model(name_or_shape) -> ModelShape:
    """A preset by name (``llama2-70b``, ``llama3-70b``, ``tiny`` ...) or a ModelShape as is:
    resolve a ``--model`` once, at the edge, and pass the shape down."""
    if isinstance(name_or_shape, ModelShape):
        return name_or_shape
    key = str(name_or_shape).lower()
    if key not in MODELS:
        raise ValueError(f"unknown model {name_or_shape!r}; choose one of {', '.join(MODELS)}")
    return MODELS[key]
