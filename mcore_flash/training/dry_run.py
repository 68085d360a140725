"""``mcore-flash pretrain --dry-run``: check a cluster launch on one CPU, allocating nothing.

The flags are validated for ``WORLD_SIZE`` ranks, then every pipeline stage's model is
built on the meta device inside a fake process group of that size (so megatron sees the
real TP/PP/CP layout) and its parameters are counted.
"""

from __future__ import annotations

import torch

from mcore_flash.training.data import tokenizer_and_vocab
from mcore_flash.training.distributed import init_fake_world
from mcore_flash.training.model import build_model, transformer_config


def dry_run(args) -> dict:
    """Returns ``{"per_stage": [params per rank of each stage], "total": unique parameters}``."""
    from megatron.core import parallel_state

    init_fake_world(args)
    _, vocab = tokenizer_and_vocab(args)
    if args.tokenizer_type is None and args.tokenizer_model is None:
        vocab = _preset_vocab(args)
    config = transformer_config(args)
    per_stage, total = [], 0
    for stage in range(args.pipeline_model_parallel_size):
        parallel_state.set_pipeline_model_parallel_rank(stage)
        with torch.device("meta"):
            model = build_model(args, config, vocab)
        per_stage.append(sum(p.numel() for p in model.parameters()))
        tp = args.tensor_model_parallel_size
        total += sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in model.parameters())
    parallel_state.set_pipeline_model_parallel_rank(0)
    return {"per_stage": per_stage, "total": total, "padded_vocab_size": vocab}


def _preset_vocab(args) -> int:
    """A preset's own vocabulary (e.g. Llama-2's 32000) when no tokenizer is given."""
    from mcore_flash.planning.models import MODELS

    return MODELS[args.model].vocab_size
