"""The emulated NPU's bytes of a training run: after its setup and after its first step."""

from __future__ import annotations

import contextlib
import gc


def allocated() -> int:
    """The emulated device's allocated bytes, once the reference cycles are collected (object
    collectives' byte tensors die in them)."""
    import torch

    gc.collect()
    return torch.npu.memory_allocated()


@contextlib.contextmanager
def set_up_and_stepped(config, vocab_size: int):
    """``(recipe, start, setup, step)``: the trainer's recipe for ``config`` (after
    ``init_distributed``), the device's bytes before it (``start``: earlier runs' leftovers), and
    above them after its setup and after one training step; the recipe and megatron's parallel
    state are torn down after the block. Its padded vocabulary must be ``vocab_size``."""
    from megatron.core import parallel_state

    from mcore_flash.training import loop

    start = allocated()
    recipe = loop.PretrainRecipe(config)
    try:
        assert recipe.padded_vocab_size == vocab_size
        setup = allocated() - start
        recipe.train_step()
        yield recipe, start, setup, allocated() - start
    finally:
        recipe.cleanup()
        parallel_state.destroy_model_parallel()
        del recipe
