"""Megatron ``ModuleSpec``s whose core attention is the fused kernel and whose norms are ours.

``get_gpt_layer_flash_spec`` mirrors megatron-core's ``get_gpt_layer_local_spec`` (same
modules, same checkpoint key map) with four substitutions: ``core_attention`` is
:class:`FlashDotProductAttention`, every norm is :mod:`mcore_flash.transformer.norms`
(sequence-parallel capable, fused on NPU), the MLP is megatron's computed in optional sequence
tiles (:class:`TiledMLP`), and the layer is :class:`FlashTransformerLayer`
(``selective`` + ``core_attn`` recompute covers the whole attention sub-block). ``get_gpt_decoder_block_flash_spec`` also
replaces the final norm, which Megatron otherwise builds from apex or its SP-refusing
torch norm; pass it to ``GPTModel(transformer_layer_spec=...)``.

Fusions: attention (all devices) and RMSNorm (``npu_rms_norm`` on NPU; a save-input-only
autograd function elsewhere) always. SwiGLU when ``config.use_te_activation_func=True``
(megatron-core's MLP activation hook, 0.16+; ``npu_swiglu`` on NPU): it keeps only the fc1
output for backward. RoPE uses megatron-core's own code (``apply_rope_fusion`` needs TE or
apex kernels, which do not exist on Ascend or CPU).
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from mcore_flash.compat import mlp_spec

from .activations import SwiGLU
from .attention import FlashDotProductAttention
from .layer import FlashTransformerLayer
from .norms import norm_class
from .tiled_mlp import TiledMLP


def get_gpt_layer_flash_spec(
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
    attention_backend: Optional[str] = None,
    layer_recompute_modules: Sequence[str] = (),
    mlp_chunk_size: Optional[int] = None,
) -> ModuleSpec:
    """A ``TransformerLayer`` spec: our norms, Megatron's projections and MLP, fused attention.

    Args:
        normalization: ``"RMSNorm"`` or ``"LayerNorm"`` (match ``config.normalization``).
        qk_layernorm: normalise queries and keys per head (``config.qk_layernorm``).
        attention_backend: ``"npu" | "cuda" | "cpu" | "reference"`` or None (by device).
        layer_recompute_modules: selective recompute modules the layer applies itself, beyond the
            config's (:class:`FlashTransformerLayer`): ``qkv`` (keep the attention output,
            re-run norm -> QKV -> RoPE), and under full/block recompute the modules of the
            layers the block does not recompute whole.
        mlp_chunk_size: tokens per MLP tile (:class:`TiledMLP`); None: the whole sequence.
    """
    norm = norm_class(normalization)
    return ModuleSpec(
        module=FlashTransformerLayer,
        params={"layer_recompute_modules": tuple(layer_recompute_modules)},
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=ModuleSpec(
                        module=FlashDotProductAttention, params={"backend": attention_backend}
                    ),
                    linear_proj=RowParallelLinear,
                    q_layernorm=norm if qk_layernorm else IdentityOp,
                    k_layernorm=norm if qk_layernorm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=_mlp(mlp_chunk_size),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def _mlp(chunk_size: Optional[int]):
    """Megatron's MLP with our fused SwiGLU in its activation hook; tiled with ``chunk_size``
    (megatron-core 0.16-0.17 then log "Unknown MLP type" per layer: they compare the class)."""
    submodules = MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear, activation_func=SwiGLU
    )
    if chunk_size is None:
        return mlp_spec(submodules)
    return mlp_spec(submodules, TiledMLP, {"chunk_size": chunk_size})


def get_gpt_decoder_block_flash_spec(
    config: TransformerConfig,
    normalization: Optional[str] = None,
    qk_layernorm: Optional[bool] = None,
    attention_backend: Optional[str] = None,
    vp_stage: Optional[int] = None,
    layer_recompute_modules: Sequence[str] = (),
    mlp_chunk_size: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """Submodules of this pipeline stage's ``TransformerBlock``, final norm included.

    ``normalization`` and ``qk_layernorm`` default to the config's settings.
    ``layer_recompute_modules`` (:func:`get_gpt_layer_flash_spec`) go to every layer, except under
    ``recompute_method="block"`` to the first ``recompute_num_layers`` of the stage (chunk),
    which megatron's block recomputes whole (partial recompute). ``mlp_chunk_size``: tokens
    per MLP tile in every layer (None: untiled).
    """
    normalization = normalization or config.normalization
    qk_layernorm = config.qk_layernorm if qk_layernorm is None else qk_layernorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    whole = 0
    if config.recompute_granularity == "full" and config.recompute_method == "block":
        whole = min(num_layers, config.recompute_num_layers)
    whole_spec, layer_spec = (
        get_gpt_layer_flash_spec(
            normalization, qk_layernorm, attention_backend, modules, mlp_chunk_size
        )
        for modules in ((), layer_recompute_modules)
    )
    return TransformerBlockSubmodules(
        layer_specs=[whole_spec] * whole + [layer_spec] * (num_layers - whole),
        layer_norm=norm_class(normalization),
    )
