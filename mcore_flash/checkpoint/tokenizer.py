"""The tokenizer stored beside a run's checkpoints (``<save>/tokenizer/``): its record in the
latest checkpoint, and the tokenizer itself, its files checked against that record."""

from __future__ import annotations

import os

from mcore_flash.checkpoint.directory import latest_iteration, read_latest
from mcore_flash.data.tokenizers import TOKENIZER_DIR, stored_tokenizer


def stored_tokenizer_record(load: str):
    """``(record, directory, common state)`` of the tokenizer stored with the latest checkpoint
    under ``load`` (``hf-to-mcore`` or an earlier run put it there), or None: no checkpoint yet,
    or one that stores no tokenizer."""
    if latest_iteration(load) is None:
        return None
    _, common = read_latest(load)
    record = common.get("tokenizer")
    if not record:
        return None
    return record, os.path.join(load, TOKENIZER_DIR), common


def checkpoint_tokenizer(load: str):
    """The tokenizer stored with the latest checkpoint under ``load``, its files checked
    against the checkpoint's record, with the checkpoint's vocabulary; None where it stores none
    (or only files the trainer cannot load, such as a slow tokenizer's vocab.json + merges.txt)."""
    stored = stored_tokenizer_record(load)
    if stored is None or stored[0].get("type") is None:
        return None
    record, directory, common = stored
    vocab = (common.get("model_args") or {}).get("vocab_size")
    return stored_tokenizer(directory, record, vocab, what=f"--load {load}")
