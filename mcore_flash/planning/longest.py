"""The longest sequence a number of devices trains (``mcore-flash plan --longest``)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

from .search import Candidate

__all__ = ["Longest", "longest_sequence"]


class Longest(NamedTuple):
    """What :func:`longest_sequence` found: ``seq_length`` tokens fit (0: not even one step),
    with ``candidates`` (the search's, fastest first); ``beyond``, the shortest length tried
    that does not fit (None: the limit was reached)."""

    seq_length: int
    candidates: Sequence[Candidate]
    beyond: Optional[int]


def longest_sequence(
    search: Callable[[int], Sequence[Candidate]],
    step: int = 8192,
    limit: int = 1 << 24,
    progress: Callable[[int, int], None] = lambda seq_length, found: None,
) -> Longest:
    """The largest multiple of ``step`` tokens, at most ``limit``, for which ``search(seq_length)``
    finds a layout: doubling from ``step`` until a length does not fit, then bisection between
    the last that fits and the first that does not. Assumes that a length that fits makes every
    shorter one fit (activations grow with the sequence; the rest does not shrink).
    ``progress(seq_length, layouts found)`` is called after each search."""
    if step < 1 or limit < step:
        raise ValueError(f"--longest-step {step}: a positive number of tokens, at most {limit}")

    def tried(seq_length: int) -> Sequence[Candidate]:
        found = search(seq_length)
        progress(seq_length, len(found))
        return found

    best = tried(step)
    if not best:
        return Longest(0, (), step)
    low, high = step, None
    while high is None and 2 * low <= limit:
        found = tried(2 * low)
        if found:
            low, best = 2 * low, found
        else:
            high = 2 * low
    if high is None:
        return Longest(low, best, None)
    while high - low > step:
        middle = (low + high) // 2 // step * step
        found = tried(middle)
        if found:
            low, best = middle, found
        else:
            high = middle
    return Longest(low, best, high)
