"""The fused SwiGLU as a Megatron MLP activation module.

megatron-core (0.16) builds ``MLPSubmodules.activation_func`` and applies it to the whole
fc1 output when ``config.use_te_activation_func`` is True (the flag's name is historical:
any module can be plugged in). :func:`mcore_flash.ops.activations.swiglu` then keeps only
the fc1 output for backward (``npu_swiglu`` on Ascend). With the flag False, Megatron's own
unfused SwiGLU runs and this module is never built.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from mcore_flash.ops.activations import swiglu


class SwiGLU(MegatronModule):
    """``[s, b, 2 * ffn/tp] -> [s, b, ffn/tp]`` (no parameters; a MegatronModule so that
    megatron's MLP can ask it for its (empty) sharded state dict)."""

    def __init__(self, config, **kwargs):
        super().__init__(config=config)
        if not config.gated_linear_unit or config.activation_func is not torch.nn.functional.silu:
            raise ValueError(
                "the fused SwiGLU needs gated_linear_unit=True and activation_func=F.silu (--swiglu)"
            )
        if getattr(config, "activation_func_clamp_value", None) is not None or getattr(
            config, "glu_linear_offset", 0.0
        ):
            raise ValueError(
                "the fused SwiGLU supports neither activation_func_clamp_value nor glu_linear_offset"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x)
