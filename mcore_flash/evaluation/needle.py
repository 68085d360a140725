"""Needle retrieval by context length and depth (the "needle in a haystack" grid).

Each sample is one sequence of ``length`` tokens in the layout of the built-in long-range
copy task (:mod:`mcore_flash.data.synthetic`), with the needle moved::

    [filler x lead]  @  k1 .. kK  :  [filler x rest]  ?  k1 .. kK  <eod>
                     \\_ needle _/                       \\_answer_/

* key: ``K`` letters a-z, i.i.d. uniform; ``@ : ?`` and ``<eod>`` as in training;
* filler: ``F = length - 2K - 4`` tokens, uniform digits (the built-in haystack) or
  consecutive tokens of held-out ``--data-path`` documents (EOD tokens dropped);
* depth ``d`` in [0, 1]: ``lead = round(d * F)`` filler tokens come before the needle, so
  depth 0 puts the needle first (the farthest from the question: at the training length
  this is exactly a training document) and depth 1 right before ``?``.

A sample counts as retrieved when greedy decoding after ``?`` produces the ``K`` key tokens
exactly, scored by one teacher-forced forward pass (:func:`score_needles`); token accuracy is
reported next to it (:class:`NeedleCell`). Usage and the main job's grid: docs/evaluate.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch

from mcore_flash.data.synthetic import EOD, FILLER_ALPHABET, KEY_ALPHABET, QUERY, SEP, START

__all__ = [
    "NeedleCell",
    "needle_samples",
    "score_needles",
    "needle_grid",
    "check_needle_lengths",
    "digit_filler",
    "stream_filler",
]


@dataclass(frozen=True)
class NeedleCell:
    """Result of one (length, depth) cell over ``samples`` sequences."""

    length: int
    depth: float
    samples: int
    exact: float  # fraction of samples whose K key tokens are all retrieved
    token_accuracy: float  # fraction of key tokens retrieved (teacher-forced)


def check_needle_lengths(lengths, depths, key_length: int) -> None:
    """ValueError naming the flag for a grid that cannot be built."""
    if not lengths:
        raise ValueError("--lengths: give at least one length, e.g. --lengths 256,512")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(
            f"--depths {list(depths)}: give fractions in [0, 1], e.g. --depths 0,0.25,0.5,0.75,1"
        )
    if key_length < 1:
        raise ValueError(f"--needle-length must be >= 1, got {key_length}")
    for length in lengths:
        if length < 2 * key_length + 4:
            raise ValueError(
                f"--lengths {length}: a needle of --needle-length {key_length} takes {2 * key_length + 4} tokens "
                f"(@ key : ? key <eod>), longer than the haystack; use lengths >= {2 * key_length + 4} or a "
                "shorter --needle-length"
            )


def needle_samples(
    length: int, depth: float, key_length: int, filler: numpy.ndarray, rng: numpy.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [n, length], answer_mask [n, length])`` for ``n = len(filler)`` samples.

    ``filler``: ``[n, length - 2*key_length - 4]`` haystack token ids. ``answer_mask`` is True
    at the input positions whose next token is a key token of the answer (the query ``?`` and
    the first ``K-1`` answer tokens), i.e. where the model must retrieve.
    """
    n, free = filler.shape
    if free != length - 2 * key_length - 4:
        raise ValueError(
            f"filler has {free} tokens per sample; a length-{length} sample needs {length - 2 * key_length - 4}"
        )
    lead = int(round(depth * free))
    keys = KEY_ALPHABET[rng.integers(0, len(KEY_ALPHABET), size=(n, key_length))]
    pieces = [
        filler[:, :lead],
        numpy.full((n, 1), START),
        keys,
        numpy.full((n, 1), SEP),
        filler[:, lead:],
        numpy.full((n, 1), QUERY),
        keys,
        numpy.full((n, 1), EOD),
    ]
    tokens = numpy.concatenate(pieces, axis=1).astype(numpy.int64)
    query = length - key_length - 2
    mask = numpy.zeros((n, length), dtype=bool)
    mask[:, query : query + key_length] = True
    return torch.from_numpy(tokens), torch.from_numpy(mask)


def score_needles(model, tokens: torch.Tensor, answer_mask: torch.Tensor) -> tuple[int, int]:
    """``(samples retrieved exactly, key tokens retrieved)`` by ``model`` (a
    :class:`~mcore_flash.evaluation.model_runner.LoadedModel`).

    A sample counts as retrieved when greedy decoding after ``?`` produces the ``K`` key
    tokens exactly. That equals "the argmax at every answer position, given the true answer
    so far, is the true next key token" (if every greedy step is right, greedy decoding sees
    the true answer), so one teacher-forced forward pass scores it. Token accuracy (the
    fraction of key tokens whose teacher-forced argmax is right) is reported next to it; a
    model that cannot see the key scores at most ``1/26`` per token in expectation and
    ``26**-K`` exactly."""
    greedy, _ = model.predict(tokens)
    labels = torch.roll(tokens, -1, dims=1)
    hit = (greedy == labels) & answer_mask
    per_sample = hit.sum(dim=1)
    key_length = int(answer_mask[0].sum())
    return int((per_sample == key_length).sum()), int(per_sample.sum())


def needle_grid(
    model,
    lengths,
    depths,
    key_length: int,
    num_samples: int,
    batch_size: int,
    filler_source,
    seed: int,
):
    """Yields one :class:`NeedleCell` per (length, depth), row by row. ``filler_source(rng, n, count)``
    returns ``[n, count]`` haystack tokens. Keys and filler are drawn from a generator seeded
    by ``(seed, length, depth index)``, so every rank and every parallel layout sees the same
    samples."""
    for length in lengths:
        for index, depth in enumerate(depths):
            rng = numpy.random.default_rng([seed, length, index])
            exact = tokens_right = 0
            for start in range(0, num_samples, batch_size):
                n = min(batch_size, num_samples - start)
                filler = filler_source(rng, n, length - 2 * key_length - 4)
                tokens, mask = needle_samples(length, depth, key_length, filler, rng)
                samples_right, keys_right = score_needles(model, tokens, mask)
                exact += samples_right
                tokens_right += keys_right
            yield NeedleCell(
                length,
                depth,
                num_samples,
                exact / num_samples,
                tokens_right / (num_samples * key_length),
            )


def digit_filler(rng: numpy.random.Generator, n: int, count: int) -> numpy.ndarray:
    """The built-in haystack: uniform digits, as in the training task."""
    return FILLER_ALPHABET[rng.integers(0, len(FILLER_ALPHABET), size=(n, count))]


def stream_filler(stream: numpy.ndarray):
    """A haystack of consecutive tokens from ``stream`` (held-out documents, EOD removed) at
    random offsets."""

    def source(rng: numpy.random.Generator, n: int, count: int) -> numpy.ndarray:
        if len(stream) < count:
            raise ValueError(
                f"--data-path: the held-out documents hold {len(stream)} tokens, fewer than one haystack "
                f"of {count}; use more data or shorter --lengths"
            )
        starts = rng.integers(0, len(stream) - count + 1, size=n)
        return numpy.stack([stream[i : i + count] for i in starts])

    return source
