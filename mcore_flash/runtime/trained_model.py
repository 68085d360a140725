"""A model as ``mcore-flash pretrain`` builds it, for inference: untrained (benchmarks) or with
the weights of the latest checkpoint under ``--load`` (generate, evaluate)."""

from __future__ import annotations

from typing import Any, NamedTuple


class TrainedModel(NamedTuple):
    model: Any  # megatron's GPTModel on this process's device, in eval mode
    tokenizer: Any  # the run's tokenizer (mcore_flash.runtime.tokenizer.run_tokenizer)
    model_config: Any  # megatron's TransformerConfig of the model
    checkpoint: dict  # the checkpoint's common state: iteration, model_args, provenance

    @property
    def iteration(self) -> int:
        return int(self.checkpoint["iteration"])


def build_untrained_model(args) -> tuple[Any, Any, Any, int]:
    """``(GPTModel in eval mode on the CPU, tokenizer, TransformerConfig, padded vocabulary
    size)`` for the pretrain flags ``args``, with freshly initialised weights and the full
    (gathered) logits."""
    from mcore_flash.runtime.model import build_model, transformer_config
    from mcore_flash.runtime.tokenizer import tokenizer_and_vocab

    tokenizer, padded_vocab = tokenizer_and_vocab(args)
    model_config = transformer_config(args)
    model = build_model(args, model_config, padded_vocab, parallel_output=False)
    return model.eval(), tokenizer, model_config, padded_vocab


def load_trained_model(args) -> TrainedModel:
    """The latest checkpoint under ``args.load`` in the model ``mcore-flash pretrain`` builds
    for ``args``, on this process's device; call after ``init_distributed(args)``."""
    from mcore_flash import platform
    from mcore_flash.checkpoint.checkpointer import load_weights
    from mcore_flash.checkpoint.model_args import model_args

    model, tokenizer, model_config, padded_vocab = build_untrained_model(args)
    model = model.to(platform.torch_device())
    common = load_weights(args.load, model, padded_vocab, model_args(args, tokenizer.vocab_size))
    return TrainedModel(model, tokenizer, model_config, common)
