"""``FlashTransformerLayer``: Megatron's ``TransformerLayer`` with attention-only and qkv recompute.

With a fused attention kernel, Megatron's ``selective`` + ``core_attn`` recompute re-runs
the kernel and saves nothing: the kernel keeps only q, k, v, out and the logsumexp, and
the output projection keeps the attention output anyway (Megatron-LM issues 464, 1225,
1732). With this layer the same settings (``recompute_granularity="selective"``,
``"core_attn" in recompute_modules``) instead checkpoint the whole attention sub-block:

    input_layernorm -> linear_qkv -> RoPE -> fused attention -> linear_proj -> bias-dropout-add

keeps only the layer input ``[s/tp (SP) or s, b, h]`` for backward and recomputes the rest
in backward through ``tensor_parallel.checkpoint`` (which replays the CPU/device RNG and
the model-parallel RNG tracker, so attention and hidden dropout are identical). The
boundary ends after the residual add so that nothing of the sub-block -- not even the
dropout mask of the bias-dropout-add -- stays alive; measurements in docs/benchmarks.md.

Megatron's other selective modules (``mlp``, ``layernorm`` for the pre-MLP norm) keep
working; the input norm is inside the checkpoint, so its own ``layernorm`` recompute is
switched off there.

With ``recompute_qkv=True`` (a spec parameter: ``--recompute-modules qkv``, which megatron's
config does not know) the attention sub-block keeps the layer input, the kernel's output and
its statistics, and re-runs only input norm -> QKV -> RoPE in backward, never the kernel
(:mod:`mcore_flash.transformer.qkv_recompute`). It combines with Megatron's ``mlp`` and
``layernorm`` (pre-MLP norm) modules, not with ``core_attn`` (which already recomputes more).
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_layer import TransformerLayer

from .qkv_recompute import QKVRecompute


class FlashTransformerLayer(TransformerLayer):
    """``TransformerLayer`` whose ``core_attn`` selective recompute covers the attention sub-block."""

    def __init__(self, config, submodules, *args, recompute_qkv: bool = False, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.recompute_attention = config.recompute_granularity == "selective" and "core_attn" in (
            config.recompute_modules or []
        )
        if recompute_qkv and self.recompute_attention:
            raise ValueError(
                "--recompute-modules qkv and core_attn exclude each other: core_attn already recomputes the whole "
                "attention sub-block (kernel included); keep one"
            )
        if recompute_qkv and config.recompute_granularity == "full":
            raise ValueError(
                "--recompute-modules qkv with --recompute-granularity full: every layer is recomputed whole; drop "
                "qkv, or use --recompute-granularity selective"
            )
        self.recompute_qkv = recompute_qkv
        if self.recompute_attention:
            self.self_attention.checkpoint_core_attention = False  # covered, and would do nothing
        if self.recompute_attention or self.recompute_qkv:
            self.recompute_input_layernorm = False  # inside the checkpoint / the qkv replay already

    def _forward_attention(self, hidden_states, *args, **kwargs):
        if self.recompute_qkv and self.training and torch.is_grad_enabled():
            return self._forward_attention_keeping_output(hidden_states, *args, **kwargs)
        if not (self.recompute_attention and self.training):
            return super()._forward_attention(hidden_states, *args, **kwargs)
        contexts = []

        def attention_block(layer_input):
            output, context = TransformerLayer._forward_attention(self, layer_input, *args, **kwargs)
            contexts.append(context)
            return output

        output = tensor_parallel.checkpoint(attention_block, self.config.distribute_saved_activations, hidden_states)
        return output, contexts[0]

    def _forward_attention_keeping_output(self, hidden_states, *args, **kwargs):
        """The attention sub-block under the qkv boundary; the core attention finds the
        boundary as its ``qkv_recompute`` while the sub-block runs (forward and replay)."""
        core_attention = self.self_attention.core_attention

        def attention_block(layer_input):
            core_attention.qkv_recompute = boundary
            try:
                return TransformerLayer._forward_attention(self, layer_input, *args, **kwargs)
            finally:
                core_attention.qkv_recompute = None

        boundary = QKVRecompute(attention_block, hidden_states)
        with boundary.forward():
            return attention_block(hidden_states)
