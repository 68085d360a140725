"""The GPTModel the trainer builds: megatron-core's ``GPTModel`` (optionally with a tiled loss) with
the flash block spec."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from mcore_flash.runtime.config import TrainingConfig


def transformer_config(config: TrainingConfig):
    """megatron's ``TransformerConfig`` for the run's model, parallel layout and precision."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
    return TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        normalization=config.normalization,
        layernorm_epsilon=config.norm_epsilon,
        gated_linear_unit=config.swiglu,
        activation_func=F.silu if config.swiglu else F.gelu,
        use_te_activation_func=config.swiglu,  # megatron's activation hook -> our fused SwiGLU
        add_bias_linear=not config.disable_bias_linear,
        add_qkv_bias=config.add_qkv_bias,
        qk_layernorm=config.qk_layernorm,
        kv_channels=config.kv_channels,
        attention_dropout=config.attention_dropout,
        hidden_dropout=config.hidden_dropout,
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        cp_comm_type=config.cp_comm_type,
        window_size=config.window_size,
        window_attn_skip_freq=config.window_attn_skip_freq,
        sequence_parallel=config.sequence_parallel,
        params_dtype=torch.float32 if config.fsdp2 else dtype,  # FSDP2 computes in bf16 itself
        pipeline_dtype=dtype,
        bf16=config.bf16,
        fp16=config.fp16,
        use_cpu_initialization=True,
        calculate_per_token_loss=True,
        batch_p2p_comm=False,  # gloo has no batched p2p; harmless elsewhere
        **config.recompute.config,
        **_packed_pipeline_settings(config),
    )


def _packed_pipeline_settings(config: TrainingConfig) -> dict:
    """Packed documents under pipelining: a micro-batch's row count depends on its padding,
    so stages exchange shapes first (megatron's ``variable_seq_lengths``). megatron-core 0.16's
    ``TransformerConfig.__post_init__`` refuses that with its default MoE dispatcher
    ("allgather") even in a model without experts, so the (unused) dispatcher is "alltoall"."""
    if not (config.reset_attention_mask and config.pipeline_model_parallel_size > 1):
        return {}
    return {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"}


def build_model_chunks(config: TrainingConfig, model_config, padded_vocab_size: int) -> list:
    """This rank's model chunks, in schedule order: one (:func:`build_model`), or with the
    interleaved schedule one per virtual pipeline stage (``vp_stage`` 0..V-1; chunk v of
    pipeline rank p holds the layers of virtual stage ``v * PP + p``)."""
    vp = config.virtual_pipeline_model_parallel_size
    if vp is None:
        return [build_model(config, model_config, padded_vocab_size)]
    return [build_model(config, model_config, padded_vocab_size, vp_stage=v) for v in range(vp)]


def build_model(
    config: TrainingConfig,
    model_config,
    padded_vocab_size: int,
    parallel_output: bool = True,
    vp_stage: Optional[int] = None,
):
    """This rank's pipeline stage of the GPT (on the current default device) for ``model_config``
    (:func:`transformer_config`'s), with ``padded_vocab_size`` embedding rows; with
    ``parallel_output=False`` the logits are gathered over TP (full vocabulary on every rank);
    ``vp_stage``: which of the rank's chunks under the interleaved schedule (None: the stage).
    ``--loss-compute-mode chunk`` and ``--mlp-chunk-size`` compute the loss and the MLPs in
    sequence tiles (:mod:`mcore_flash.transformer.gpt_model`, ``.tiled_mlp``).
    With ``--activation-offload-layers N`` the first N layers of the stage park their saved
    tensors on the host (:mod:`mcore_flash.transformer.activation_offload`)."""
    from megatron.core import parallel_state

    from mcore_flash.transformer import activation_offload, get_gpt_decoder_block_flash_spec
    from mcore_flash.transformer.gpt_model import TiledLossGPTModel

    model = TiledLossGPTModel(
        model_config,
        get_gpt_decoder_block_flash_spec(
            model_config,
            attention_backend=config.attention_backend,
            vp_stage=vp_stage,
            layer_recompute_modules=config.recompute.layer_modules,
            mlp_chunk_size=config.mlp_chunk_size,
        ),
        vocab_size=padded_vocab_size,
        max_sequence_length=max(config.max_position_embeddings, config.seq_length),
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=not config.untie_embeddings_and_output_weights,
        position_embedding_type=config.position_embedding_type,
        rotary_base=config.rotary_base,
        rope_scaling=config.use_rope_scaling,
        rope_scaling_factor=config.rope_scaling_factor,
        seq_len_interpolation_factor=config.rotary_seq_len_interpolation_factor,
        parallel_output=parallel_output,
        vp_stage=vp_stage,
        loss_chunk_size=config.loss_chunk_size,
    )
    if config.activation_offload_layers:  # ``model.activation_offload.events``: the copies' order
        model.activation_offload = activation_offload.install(
            model.decoder, config.activation_offload_layers
        )
    return model


def count_parameters(model_chunks: list) -> int:
    """Parameters (elements) held by this rank (all its model chunks)."""
    return sum(p.numel() for chunk in model_chunks for p in chunk.parameters())
