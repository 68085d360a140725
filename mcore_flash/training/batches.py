"""Tokenizer, datasets and the deterministic micro-batch order of the trainer.

Sample order follows Megatron-LM's ``MegatronPretrainingSampler``: global batch ``g``
covers samples ``[g * G, (g + 1) * G)``; micro-batch ``i`` of data-parallel rank ``r``
holds samples ``g * G + i * m * d + r * m + [0, m)``. It depends only on the number of
samples consumed, which checkpoints store, so a resumed run sees exactly the samples an
uninterrupted one would. No attention mask is built: the model runs causal, per document
with ``--reset-attention-mask`` (the loop packs each micro-batch by its EOD tokens).
"""

from __future__ import annotations

import os
from typing import Iterator

import torch

from mcore_flash.data.synthetic import synthetic_dataset
from mcore_flash.runtime.config import TrainingConfig

SYNTHETIC_DOCS = 4096


def build_train_valid_datasets(config: TrainingConfig, tokenizer):
    """``(train, valid)``: megatron's GPTDatasets over ``--data-path``, mock data, or the
    built-in long-range task; ``valid`` (the ``--split`` validation set, sized for every
    ``--eval-interval`` validation and the last) is None without ``--eval-interval``."""
    from mcore_flash.data.datasets import build_datasets

    data_path, split = config.data_path, config.split
    if not data_path and not config.mock_data:
        data_path, split = (
            [
                _built_in_dataset(
                    config.save,
                    config.seq_length,
                    config.seed,
                    key_depth=config.synthetic_key_depth,
                )
            ],
            "100,0,0",
        )
    valid_samples = None if config.mock_data else 0
    if config.eval_interval:
        evaluations = config.train_iters // config.eval_interval + 1
        valid_samples = evaluations * config.eval_iters * config.global_batch_size
    train, valid, _ = build_datasets(
        data_path,
        config.mock_data,
        split,
        config.seq_length,
        config.seed,
        tokenizer,
        config.train_iters * config.global_batch_size,
        valid_samples,
        None if config.mock_data else 0,
        cache_dir=config.data_cache_path or os.path.join(config.save, "data", "cache"),
        reset_position_ids=config.reset_position_ids,
        eod_mask_loss=config.eod_mask_loss,
    )
    if config.reset_attention_mask or config.eod_mask_loss:
        _check_documents_end_with_eod(train, tokenizer.eod, config.seq_length)
    return train, valid if config.eval_interval else None


EOD_PROBE_SAMPLES = 16  # samples read to find an EOD before per-document flags are trusted


def _check_documents_end_with_eod(dataset, eod: int, seq_length: int) -> None:
    """``--reset-attention-mask`` / ``--eod-mask-loss`` act at EOD tokens only: on data with
    no EOD in its first samples they would silently do nothing, so that is refused."""
    probe = range(min(EOD_PROBE_SAMPLES, len(dataset)))
    samples = (dataset[i] for i in probe)
    if not any(
        (torch.as_tensor(s[key]) == eod).any() for s in samples for key in ("tokens", "labels")
    ):
        raise ValueError(
            f"--reset-attention-mask / --eod-mask-loss: the first {len(probe)} samples "
            f"({len(probe) * seq_length:,} tokens) hold no EOD token (id {eod}), so no document "
            "boundary would be seen; preprocess the data with `mcore-flash preprocess "
            "--append-eod` (Megatron-LM's flag), or drop these flags"
        )


def _built_in_dataset(save: str, seq_length: int, seed: int, key_depth: str = "fixed") -> str:
    """Prefix of the built-in long-range task (documents of ``seq_length`` tokens drawn with
    ``seed``, the key placed as ``key_depth`` says: ``--synthetic-key-depth``) under
    ``save``/data: global rank 0 writes it (if absent), then every other rank checks it, so no
    two ranks write the same files."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    writer = not distributed or torch.distributed.get_rank() == 0
    if distributed and not writer:
        torch.distributed.barrier()  # released once rank 0 has written
    data_dir = os.path.join(save, "data")
    prefix, _ = synthetic_dataset(
        data_dir, SYNTHETIC_DOCS, seq_length, seed=seed, key_depth=key_depth, create=writer
    )
    if distributed and writer:
        torch.distributed.barrier()
    return prefix


def micro_batches(
    dataset,
    micro_batch_size: int,
    global_batch_size: int,
    consumed_samples: int,
    dp_rank: int,
    dp_size: int,
) -> Iterator[dict]:
    """This data-parallel rank's micro-batches (``micro_batch_size`` samples each) from
    ``consumed_samples`` on (endless); an iteration takes ``global_batch_size`` samples."""
    per_step = micro_batch_size * dp_size
    start = consumed_samples
    while True:
        for first in range(start, start + global_batch_size, per_step):
            indices = range(
                first + dp_rank * micro_batch_size, first + (dp_rank + 1) * micro_batch_size
            )
            yield _collate([dataset[i % len(dataset)] for i in indices])
        start += global_batch_size


def _collate(samples: list[dict]) -> dict:
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in keys}
