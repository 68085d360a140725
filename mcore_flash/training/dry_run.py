"""``mcore-flash pretrain --dry-run``: check a cluster launch on one CPU, allocating nothing.

The flags are validated for ``WORLD_SIZE`` ranks, then every pipeline stage's model is
built on the meta device inside a fake process group of that size (so megatron sees the
real TP/PP/CP layout) and its parameters are counted.
"""

from __future__ import annotations

import torch

from mcore_flash.training.config import TrainingConfig, preset_shape
from mcore_flash.training.data import tokenizer_and_vocab
from mcore_flash.training.distributed import init_fake_world
from mcore_flash.training.model import build_model, transformer_config


def dry_run(config: TrainingConfig) -> dict:
    """Returns ``{"per_stage": [params per rank of each stage], "total": unique parameters,
    "padded_vocab_size": embedding rows}``."""
    from megatron.core import parallel_state

    init_fake_world(config)
    _, vocab = tokenizer_and_vocab(config)
    if config.tokenizer_type is None and config.tokenizer_model is None:
        vocab = preset_shape(config.model).vocab_size  # the preset's own (e.g. Llama-2's 32000)
    model_config = transformer_config(config)
    per_stage, total = [], 0
    for stage in range(config.pipeline_model_parallel_size):
        parallel_state.set_pipeline_model_parallel_rank(stage)
        with torch.device("meta"):
            model = build_model(config, model_config, vocab)
        per_stage.append(sum(p.numel() for p in model.parameters()))
        tp = config.tensor_model_parallel_size
        total += sum(
            p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
            for p in model.parameters()
        )
    parallel_state.set_pipeline_model_parallel_rank(0)
    return {"per_stage": per_stage, "total": total, "padded_vocab_size": vocab}
