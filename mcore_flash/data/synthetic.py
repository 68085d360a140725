"""The built-in dataset of the default run: a synthetic long-range copy task.

Every document is exactly ``seq_length`` ByteTokenizer tokens (so it is readable with
``ByteTokenizer().detokenize`` and trains with the default tokenizer)::

    [lead filler]  @  k1 .. kK  :  filler ............................  ?  k1 .. kK  <eod>
                      \\__ key __/                                          \\_ answer _/

key: K letters ``a-z``; filler: digits ``0-9`` (both i.i.d. uniform); ``@ : ?`` markers,
``<eod>`` (256) last. Each answer token is the key token exactly ``distance`` positions
earlier (:func:`make_task`), and nothing else carries information about the key, so the mean
loss can fall below ``local_floor`` (nats/token) only by copying across the gap, towards
``perfect_floor`` (the layout, floors and their derivation: :class:`LongRangeTask`; the
answer-token loss: :func:`answer_loss_mask`). ``key_depth="uniform"`` (``pretrain
--synthetic-key-depth uniform``) draws the key's depth per document, in the layout of
:func:`mcore_flash.evaluation.needle.needle_samples`. Documents are deterministic in ``seed``
(:func:`generate_documents`); one document per GPTDataset sample at the same ``seq_length``
(:func:`write_synthetic_dataset`). Usage and values: docs/pretrain.md, "The built-in dataset".
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy

from mcore_flash.data.errors import DataError
from mcore_flash.data.tokenizers import ByteTokenizer

__all__ = [
    "KEY_DEPTHS",
    "LongRangeTask",
    "make_task",
    "generate_documents",
    "write_synthetic_dataset",
    "synthetic_dataset",
    "answer_loss_mask",
    "KEY_ALPHABET",
    "FILLER_ALPHABET",
    "START",
    "SEP",
    "QUERY",
]

KEY_ALPHABET = numpy.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=numpy.uint8).astype(
    numpy.int64
)
FILLER_ALPHABET = numpy.frombuffer(b"0123456789", dtype=numpy.uint8).astype(numpy.int64)
START, SEP, QUERY = ord("@"), ord(":"), ord("?")
EOD = ByteTokenizer.EOD
# Where the key sits: "fixed" (``distance`` back from the answer, the default run's task) or
# "uniform" (a uniformly random depth per document, the needle evaluation's layout).
KEY_DEPTHS = ("fixed", "uniform")


@dataclass(frozen=True)
class LongRangeTask:
    """Layout of one document (positions are 0-based within the document).

    ``key_depth="fixed"``: K key letters (log 26 nats each), the filler digits pure noise
    (log 10 nats each). Each answer token is the key token exactly ``distance`` positions
    earlier (default ``seq_length - K - 2``, i.e. >= 3/4 of the sequence for K <= S/4 - 2; the
    lead filler is empty then). Nothing else in the document carries information about the
    key, so:

    * a model that cannot attend ``distance`` tokens back can at best predict the answer with
      the uniform letter distribution: loss floor ``local_floor`` (nats/token, mean over the
      sequence);
    * a model that copies across the gap reaches ``perfect_floor`` = ``local_floor -
      K*log(26)/S``.

    Everything else (filler and key entropy, markers, eod) is learnable locally, so once the
    loss is near ``local_floor`` it can only fall further through long-range attention; the
    answer-token loss (:func:`answer_loss_mask`) falls from log 26 = 3.26 towards 0. For
    S=256: K=16, distance=238, local floor 2.386, perfect floor 2.182.

    ``key_depth="uniform"`` places the key at a uniformly random depth instead, in exactly
    the layout of ``mcore-flash evaluate --task needle``
    (:func:`mcore_flash.evaluation.needle.needle_samples`)::

        [lead filler]  @  k1 .. kK  :  [rest filler]  ?  k1 .. kK  <eod>

    with ``F = seq_length - 2K - 4`` digits in all, ``lead ~ U{0..F}`` drawn per document and
    the query ``?`` always at ``seq_length - K - 2``: the key-to-answer distance runs from
    ``K + 2`` (lead ``F``, depth 1) to ``seq_length - K - 2`` (lead 0, depth 0: the fixed
    document). Where the ``@`` falls is itself ``log(F + 1)`` nats of entropy per document, so
    both floors are the fixed task's plus ``log(F + 1) / seq_length``; ``local_floor`` is then
    the best loss of a model that never copies the key (near depth 1 the key is close enough
    for a short-range head to copy it). For S=256, K=16: 2.407 and 2.204. ``distance`` is then
    the longest (depth 0) and the per-document positions (``lead_length``, ``filler_length``,
    ``key_start``) raise ValueError; ``query_position``, ``answer_start``, ``digits`` and the
    floors hold for every document."""

    seq_length: int
    key_length: int
    distance: int
    key_depth: str = "fixed"

    def _fixed_only(self, what: str) -> None:
        if self.key_depth != "fixed":
            raise ValueError(f"{what}: varies per document with key_depth={self.key_depth!r}")

    @property
    def lead_length(self) -> int:
        self._fixed_only("lead_length")
        return self.seq_length - self.key_length - self.distance - 2

    @property
    def filler_length(self) -> int:
        self._fixed_only("filler_length")
        return self.distance - self.key_length - 2

    @property
    def key_start(self) -> int:
        return self.lead_length + 1

    @property
    def digits(self) -> int:
        """Filler digits per document, lead and rest together: ``seq_length - 2K - 4``."""
        return self.seq_length - 2 * self.key_length - 4

    @property
    def query_position(self) -> int:
        return self.seq_length - self.key_length - 2

    @property
    def answer_start(self) -> int:
        return self.query_position + 1

    @property
    def _placement_entropy(self) -> float:
        """Nats per document in where the key sits: 0 fixed, ``log(F + 1)`` uniform."""
        return math.log(self.digits + 1) if self.key_depth == "uniform" else 0.0

    @property
    def local_floor(self) -> float:
        """Best mean loss (nats/token) without attending ``distance`` back (uniform: without
        copying the key at all)."""
        nats = self.digits * math.log(10) + 2 * self.key_length * math.log(26)
        return (nats + self._placement_entropy) / self.seq_length

    @property
    def perfect_floor(self) -> float:
        """Best mean loss (nats/token) of a model that copies the key across the gap."""
        nats = self.digits * math.log(10) + self.key_length * math.log(26)
        return (nats + self._placement_entropy) / self.seq_length

    @property
    def answer_chance_loss(self) -> float:
        """Answer-token loss of a model that cannot see the key: log 26."""
        return math.log(26)


def make_task(
    seq_length: int,
    key_length: Optional[int] = None,
    distance: Optional[int] = None,
    key_depth: str = "fixed",
) -> LongRangeTask:
    """Validate the layout. Defaults: ``key_length = max(2, seq_length // 16)``,
    ``distance = seq_length - key_length - 2`` (the longest). ``key_depth`` is one of
    :data:`KEY_DEPTHS`; "uniform" takes no ``distance`` (each document draws its own)."""
    if key_depth not in KEY_DEPTHS:
        raise DataError(
            f"synthetic key_depth {key_depth!r}: must be one of {', '.join(KEY_DEPTHS)} "
            "(pretrain's --synthetic-key-depth)"
        )
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 8:
        raise DataError(
            f"--seq-length {seq_length!r}: the synthetic task needs a sequence of at least 8 tokens"
        )
    if key_length is None:
        key_length = max(2, seq_length // 16)
    max_key = (seq_length - 4) // 2
    if not 1 <= key_length <= max_key:
        raise DataError(
            f"synthetic key_length {key_length}: must be in [1, {max_key}] for seq_length {seq_length}"
        )
    longest = seq_length - key_length - 2
    if key_depth == "uniform" and distance is not None:
        raise DataError(
            f"synthetic distance {distance}: the key depth is uniform, so each document draws "
            "its own distance; give no distance"
        )
    if distance is None:
        distance = longest
    if not key_length + 2 <= distance <= longest:
        raise DataError(
            f"synthetic distance {distance}: must be in [{key_length + 2}, {longest}] for seq_length "
            f"{seq_length} and key_length {key_length}"
        )
    return LongRangeTask(seq_length, key_length, distance, key_depth)


def generate_documents(task: LongRangeTask, num_docs: int, seed: int) -> numpy.ndarray:
    """``[num_docs, seq_length]`` int64 token ids of the task, deterministic in ``seed``.

    numpy: vectorised for the fixed task, a row at a time for the uniform one."""
    if task.key_depth == "uniform":
        return _uniform_depth_documents(task, num_docs, seed)
    rng = numpy.random.default_rng(seed)
    s, k = task.seq_length, task.key_length
    docs = FILLER_ALPHABET[rng.integers(0, len(FILLER_ALPHABET), size=(num_docs, s))]
    keys = KEY_ALPHABET[rng.integers(0, len(KEY_ALPHABET), size=(num_docs, k))]
    docs[:, task.key_start - 1] = START
    docs[:, task.key_start : task.key_start + k] = keys
    docs[:, task.key_start + k] = SEP
    docs[:, task.query_position] = QUERY
    docs[:, task.answer_start : task.answer_start + k] = keys
    docs[:, -1] = EOD
    return docs


def _uniform_depth_documents(task: LongRangeTask, num_docs: int, seed: int) -> numpy.ndarray:
    """``key_depth="uniform"``: per document ``lead ~ U{0..F}`` digits, ``@ key :``, the other
    ``F - lead`` digits, ``? key <eod>`` (the needle evaluation's layout, ``needle_samples``)."""
    rng = numpy.random.default_rng(seed)
    f, k = task.digits, task.key_length
    leads = rng.integers(0, f + 1, size=num_docs)
    digits = FILLER_ALPHABET[rng.integers(0, len(FILLER_ALPHABET), size=(num_docs, f))]
    keys = KEY_ALPHABET[rng.integers(0, len(KEY_ALPHABET), size=(num_docs, k))]
    docs = numpy.empty((num_docs, task.seq_length), dtype=numpy.int64)
    for row, (lead, filler, key) in enumerate(zip(leads, digits, keys)):
        docs[row] = numpy.concatenate(
            [filler[:lead], [START], key, [SEP], filler[lead:], [QUERY], key, [EOD]]
        )
    return docs


def write_synthetic_dataset(
    output_prefix: str,
    num_docs: int,
    seq_length: int,
    seed: int,
    key_length: Optional[int] = None,
    distance: Optional[int] = None,
    key_depth: str = "fixed",
) -> LongRangeTask:
    """Write ``num_docs`` task documents to ``output_prefix.bin/.idx`` (Megatron format, uint16,
    ByteTokenizer ids, one sequence per document; atomic). Returns the task (floors, layout).

    Documents are exactly ``seq_length`` long, so with megatron's GPTDataset at the same
    ``seq_length`` (which reads ``seq_length + 1`` tokens per sample, overlapping by one) every
    sample is one whole document plus the next document's first token: samples start where a
    document does (at ``@`` in the fixed task) and position ids match the layout."""
    if isinstance(num_docs, bool) or not isinstance(num_docs, int) or num_docs < 1:
        raise DataError(f"synthetic num_docs {num_docs!r}: must be a positive integer")
    task = make_task(seq_length, key_length, distance, key_depth)
    docs = generate_documents(task, num_docs, seed).astype(numpy.uint16)
    parent = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(parent, exist_ok=True)
    from mcore_flash.data.indexed import atomic_indexed_dataset_builder

    with atomic_indexed_dataset_builder(output_prefix, numpy.uint16) as builder:
        for row in docs:
            builder.add_document(row, [seq_length])
    return task


def synthetic_dataset(
    directory: str,
    num_docs: int,
    seq_length: int,
    seed: int,
    key_length: Optional[int] = None,
    distance: Optional[int] = None,
    *,
    key_depth: str = "fixed",
    create: bool = True,
) -> tuple[str, LongRangeTask]:
    """The prefix of the synthetic dataset for these settings under ``directory``, written
    if it is not there yet (or is damaged). Returns ``(prefix, task)`` for ``--data-path``.
    The name records every setting, the key placement included (``_d<distance>_`` fixed,
    ``_duniform_`` uniform), so a dataset is only ever reused for the settings it was drawn with.

    ``create=False``: only look; raise DataError if the dataset is missing or damaged (the
    non-writing ranks of a distributed run, which must not race the writer)."""
    from mcore_flash.data.indexed import check_indexed_dataset

    task = make_task(seq_length, key_length, distance, key_depth)
    placement = task.distance if key_depth == "fixed" else key_depth
    prefix = os.path.join(
        directory,
        f"longrange_s{seq_length}_k{task.key_length}_d{placement}_n{num_docs}_seed{seed}",
    )
    try:
        summary = check_indexed_dataset(prefix, arg="synthetic dataset")
        ok = summary.num_sequences == num_docs and summary.num_tokens == num_docs * seq_length
    except DataError:
        ok = False
    if not ok and not create:
        raise DataError(
            f"synthetic dataset {prefix}: missing or incomplete on this rank after rank 0 wrote it; "
            "--save must be a directory every rank shares (or pass --data-path / --mock-data)"
        )
    if not ok:
        write_synthetic_dataset(
            prefix,
            num_docs,
            seq_length,
            seed,
            task.key_length,
            None if key_depth == "uniform" else task.distance,
            key_depth,
        )
    return prefix, task


def answer_loss_mask(tokens, key_length: int):
    """1.0 at the input positions whose *label* is an answer token, else 0.0.

    ``tokens``: ``[..., s]`` torch tensor or numpy array of input ids (a GPTDataset sample's
    ``tokens``). Use it to report the answer-token loss / accuracy next to the mean loss.
    Rows without the query marker get an all-zero mask.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    is_torch = torch is not None and isinstance(tokens, torch.Tensor)
    arr = tokens.detach().cpu().numpy() if is_torch else numpy.asarray(tokens)
    s = arr.shape[-1]
    flat = arr.reshape(-1, s)
    pos = numpy.arange(s)
    q = numpy.where(flat == QUERY, pos, s).min(axis=1, keepdims=True)  # first '?' per row
    mask = ((pos >= q) & (pos < q + key_length)).astype(numpy.float32).reshape(arr.shape)
    return torch.from_numpy(mask) if is_torch else mask
