"""The tests' model shapes (:data:`TINY_TEST`) and parameter counts of the real model, to
check the planner's formulas against (:mod:`mcore_flash.planning.parameters`):
:func:`meta_parameter_count`. Importing this module imports neither torch nor megatron-core."""

from __future__ import annotations

from typing import Optional, Union

from mcore_flash.planning import ModelShape

# The tests' tiny Llama (tests/_support/gpt_models.py: VOCAB 128): 2 layers, h 64, ffn 128,
# 4 heads, 2 query groups, 128 positions. A fixture, not a ``--model`` preset.
TINY_TEST = ModelShape("tiny-test", 2, 64, 128, 4, 2, 128, max_position_embeddings=128)


def meta_parameter_count(
    model: Union[ModelShape, str], tp: int = 1, vp_stage: Optional[int] = None
) -> int:
    """Build ``GPTModel`` with the flash spec (:func:`mcore_flash.benchmarks.models.build_flash_gpt`)
    on the meta device and count its parameters; ``model`` a shape or a preset name.

    Needs megatron-core; megatron's parallel state must be initialised (one process at TP=1
    counts the whole model; at TP=t the count is this rank's share). The pipeline stage is
    this rank's. Nothing is allocated: every tensor lives on "meta".
    """
    import torch

    from mcore_flash.benchmarks.models import build_flash_gpt

    with torch.device("meta"):  # use_cpu_initialization: allocations without a device -> meta
        gpt = build_flash_gpt(
            model,
            tp,
            vp_stage,
            params_dtype=torch.bfloat16,
            bf16=True,
            perform_initialization=False,
        )
    params = list(gpt.parameters())
    off_meta = [p for p in params if p.device.type != "meta"]
    if off_meta:
        raise RuntimeError(f"{len(off_meta)} parameters were allocated off the meta device")
    return sum(p.numel() for p in params)
