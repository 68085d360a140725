"""Fused attention ops behind one flash-attn-style API (knows nothing of Megatron).

    from mcore_flash.ops import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)          # q [b, s, hq, d], k/v [b, s, hkv, d]

Backends: ``npu`` (torch_npu.npu_fusion_attention), ``cuda`` (torch's flash kernel),
``cpu`` (torch's fused CPU kernel), ``reference`` (pure PyTorch FlashAttention-2).
"""

from .api import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .backends import (
    AttentionBackend,
    AttentionParams,
    BackendUnavailableError,
    available_backends,
    backend_names,
    get_backend,
    last_used_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionParams",
    "BackendUnavailableError",
    "available_backends",
    "backend_names",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "get_backend",
    "last_used_backend",
]
