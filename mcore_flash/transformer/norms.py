"""RMSNorm and LayerNorm modules for Megatron specs that work under sequence parallel.

Megatron's local spec builds norms from ``WrappedTorchNorm``, which refuses sequence
parallel (Megatron-LM issue 1448), and TE/apex norms are not available on Ascend or CPU.
These norms are built the way Megatron builds any norm
(``build_module(spec, config=..., hidden_size=..., eps=...)``) and:

* mark their parameters ``sequence_parallel = config.sequence_parallel`` so that
  ``finalize_model_grads`` all-reduces their gradients over the tensor-parallel group
  (each TP rank sees a different slice of the sequence);
* support ``config.layernorm_zero_centered_gamma`` (weight stored as ``gamma - 1``);
* inherit ``MegatronModule.sharded_state_dict``: replicated over TP in dist checkpoints;
* use the device's fused kernel via :mod:`mcore_flash.ops.norms` (``npu_rms_norm`` on NPU).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_flash.ops import norms


class _Norm(MegatronModule):
    """Shared parameter handling of :class:`RMSNorm` and :class:`LayerNorm`."""

    has_bias = False

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(config=config)
        self.eps = eps
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = (
            torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
            if self.has_bias
            else None
        )
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)

    def gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight


class RMSNorm(_Norm):
    """RMSNorm over the hidden dim: ``[s, b, h] -> [s, b, h]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norms.rms_norm(x, self.gamma(), self.eps)


class LayerNorm(_Norm):
    """LayerNorm (with bias) over the hidden dim: ``[s, b, h] -> [s, b, h]``."""

    has_bias = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norms.layer_norm(x, self.gamma(), self.bias, self.eps)


NORMS = {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}


def norm_class(normalization: str) -> type[_Norm]:
    """The norm module for Megatron's ``normalization`` setting."""
    if normalization not in NORMS:
        raise ValueError(
            f"normalization={normalization!r} is not supported; choose one of {list(NORMS)}"
        )
    return NORMS[normalization]
