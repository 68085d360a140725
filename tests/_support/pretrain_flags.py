"""The tiny model the tests train, as `mcore-flash pretrain` flags.

    tiny_flags()                                                  # 2 layers, mbs 2, no --train-iters
    tiny_flags(num_layers=8, micro_batch_size=1, train_iters=6)   # test_interleaved's model
    model_shape(num_layers=1, seq_length=256)                     # the shape alone

The tiny model: ``num_layers`` layers of hidden size 64, FFN 128, 4 heads in 2 query groups
(head dim 16), sequences of 64 tokens (``--max-position-embeddings`` 64), global batch 4, lr 1e-3
after 1 warm-up iteration, a log line every iteration; the vocabulary (258 tokens in the
built-in dataset) padded to a multiple of 256: 512 rows at TP 1 and 2.

Standard library only: ``scripts/fault_drill.py`` (run in a checkout) loads this file too.
"""

from __future__ import annotations

from typing import Optional


def model_shape(num_layers: int = 2, seq_length: Optional[int] = None) -> list[str]:
    """The tiny model's layers and widths as flags; with ``seq_length`` (tokens) also
    ``--seq-length`` and ``--max-position-embeddings`` of that length."""
    flags = [
        "--num-layers",
        str(num_layers),
        "--hidden-size",
        "64",
        "--ffn-hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--num-query-groups",
        "2",
    ]
    if seq_length is not None:
        flags += ["--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length)]
    return flags


def tiny_flags(
    num_layers: int = 2,
    micro_batch_size: int = 2,
    train_iters: Optional[int] = None,
    vocab_multiple: Optional[int] = 256,
) -> list[str]:
    """`mcore-flash pretrain` flags of the tiny model at 64 tokens, global batch 4, in this
    order: its shape, the batch, the schedule (``--train-iters`` only where given), the log
    interval, ``--make-vocab-size-divisible-by vocab_multiple`` (left out when None)."""
    flags = [
        *model_shape(num_layers, seq_length=64),
        "--micro-batch-size",
        str(micro_batch_size),
        "--global-batch-size",
        "4",
        "--lr",
        "1e-3",
        "--lr-warmup-iters",
        "1",
    ]
    if train_iters is not None:
        flags += ["--train-iters", str(train_iters)]
    flags += ["--log-interval", "1"]
    if vocab_multiple is not None:
        flags += ["--make-vocab-size-divisible-by", str(vocab_multiple)]
    return flags
