"""``FlashTransformerLayer``: Megatron's ``TransformerLayer`` with attention-only and qkv recompute.

With a fused attention kernel, Megatron's ``selective`` + ``core_attn`` recompute re-runs
the kernel and saves nothing (Megatron-LM issues 464, 1225, 1732). With this layer the same
settings instead checkpoint the whole attention sub-block,

    input_layernorm -> linear_qkv -> RoPE -> fused attention -> linear_proj -> bias-dropout-add

keeping only the layer input ``[s/tp (SP) or s, b, h]`` for backward. The spec parameter
``layer_recompute_modules`` (:data:`LAYER_MODULES`) adds selective modules the layer applies
itself, beyond what megatron's config can say: ``qkv``
(:mod:`mcore_flash.transformer.qkv_recompute`) and partial recompute's modules. Megatron's
other selective modules (``mlp``, ``layernorm``) keep working. :class:`FlashTransformerLayer`
states the rules; ``docs/megatron-spec.md``, "Recompute", what each mode keeps and costs.
"""

from __future__ import annotations

from typing import Sequence

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_layer import TransformerLayer

from .qkv_recompute import QKVRecompute

LAYER_MODULES = ("qkv", "core_attn", "mlp", "layernorm")  # what layer_recompute_modules may name


class FlashTransformerLayer(TransformerLayer):
    """``TransformerLayer`` whose ``core_attn`` selective recompute covers the attention sub-block,
    with the ``qkv`` module and partial recompute's selective modules (``layer_recompute_modules``).

    ``core_attn``: with a fused attention kernel, Megatron's ``selective`` + ``core_attn``
    recompute re-runs the kernel and saves nothing: the kernel keeps only q, k, v, out and the
    logsumexp, and the output projection keeps the attention output anyway (Megatron-LM issues
    464, 1225, 1732). With this layer the same settings (``recompute_granularity="selective"``,
    ``"core_attn" in recompute_modules``) instead checkpoint the whole attention sub-block
    (input_layernorm -> linear_qkv -> RoPE -> fused attention -> linear_proj ->
    bias-dropout-add), keeping only the layer input ``[s/tp (SP) or s, b, h]`` for backward and
    recomputing the rest in backward through ``tensor_parallel.checkpoint`` (which replays the
    CPU/device RNG and the model-parallel RNG tracker, so attention and hidden dropout are
    identical). The boundary ends after the residual add so that nothing of the sub-block --
    not even the dropout mask of the bias-dropout-add -- stays alive; measurements in
    docs/benchmarks.md.

    Megatron's other selective modules (``mlp``, ``layernorm`` for the pre-MLP norm) keep
    working; the input norm is inside the checkpoint, so its own ``layernorm`` recompute is
    switched off there.

    ``layer_recompute_modules`` adds selective modules the layer applies itself, beyond what
    megatron's config can say:

    * ``qkv`` (``--recompute-modules qkv``, which megatron's config does not know): the
      attention sub-block keeps the layer input, the kernel's output and its statistics, and
      re-runs only input norm -> QKV -> RoPE in backward, never the kernel
      (:mod:`mcore_flash.transformer.qkv_recompute`). It combines with ``mlp`` and
      ``layernorm`` (pre-MLP norm), not with ``core_attn`` (which already recomputes more).
    * partial recompute: under ``--recompute-granularity full --recompute-method block
      --recompute-num-layers N`` megatron's block recomputes the first N layers of each stage
      whole; the spec gives the other layers the selective ``layer_recompute_modules`` (any of
      ``qkv``, ``core_attn``, ``mlp``, ``layernorm``), which megatron would ignore under
      ``full``.
    """

    def __init__(
        self, config, submodules, *args, layer_recompute_modules: Sequence[str] = (), **kwargs
    ):
        super().__init__(config, submodules, *args, **kwargs)
        own = set(layer_recompute_modules)
        if own and config.recompute_granularity == "full" and config.recompute_method != "block":
            raise ValueError(
                "--recompute-modules with --recompute-granularity full needs --recompute-method block (the modules "
                "apply to the layers the block does not recompute whole); with uniform every layer is recomputed"
            )
        unknown = own - set(LAYER_MODULES)
        if unknown:
            raise ValueError(
                f"--recompute-modules {sorted(unknown)}: this layer recomputes {LAYER_MODULES}"
            )
        selective = config.recompute_granularity == "selective"
        modules = own | set((config.recompute_modules or []) if selective else [])
        if {"qkv", "core_attn"} <= modules:
            raise ValueError(
                "--recompute-modules qkv and core_attn exclude each other: core_attn already recomputes the whole "
                "attention sub-block (kernel included); keep one"
            )
        self.recompute_attention = "core_attn" in modules
        self.recompute_qkv = "qkv" in modules
        if "mlp" in own:
            self.recompute_mlp = True
        if "layernorm" in own:
            self.recompute_input_layernorm = self.recompute_pre_mlp_layernorm = True
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
            output, context = TransformerLayer._forward_attention(
                self, layer_input, *args, **kwargs
            )
            contexts.append(context)
            return output

        output = tensor_parallel.checkpoint(
            attention_block, self.config.distribute_saved_activations, hidden_states
        )
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
