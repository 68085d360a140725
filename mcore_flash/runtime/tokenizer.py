"""The tokenizer of a run (``pretrain``, ``generate``, ``evaluate``) and its padded vocabulary."""

from __future__ import annotations

from mcore_flash.checkpoint.tokenizer import checkpoint_tokenizer
from mcore_flash.data.tokenizers import build_tokenizer, padded_vocab_size
from mcore_flash.runtime.config import TrainingConfig


def tokenizer_and_vocab(config: TrainingConfig):
    """``(tokenizer, padded vocab size in rows)`` for the config (:func:`run_tokenizer`)."""
    tokenizer = run_tokenizer(config)
    return tokenizer, padded_vocab_size(
        tokenizer.vocab_size, config.make_vocab_size_divisible_by, config.tensor_model_parallel_size
    )


def run_tokenizer(config):
    """The tokenizer of a run (``pretrain``, ``generate``, ``evaluate``): the one
    ``--tokenizer-type``/``--tokenizer-model`` name when either is given; else the tokenizer
    stored with the checkpoint in ``--load`` (:func:`mcore_flash.checkpoint.tokenizer.checkpoint_tokenizer`) when it has one;
    else the default byte-level one."""
    explicit = config.tokenizer_type is not None or config.tokenizer_model is not None
    if not explicit and config.load:
        stored = checkpoint_tokenizer(config.load)
        if stored is not None:
            return stored
    return build_tokenizer(config.tokenizer_type, config.tokenizer_model)
