"""The plan of a ring step: which local query rows meet which key rows, under which band and
ALiBi shift. Arithmetic over chunk ids and bands only; no tensors, no communication.

At step ``i`` rank ``r`` holds the K/V of rank ``src = (r - i) mod cp``; with
``c = s_local / 2`` (the rows of one chunk) and causal:

* ``i == 0`` (own block): q ``[2c]`` x kv ``[2c]`` causal (the concatenation of chunks r and
  2cp-1-r is in increasing position order, so the plain causal mask is exact);
* ``src < r``: kv chunk ``src`` precedes both query chunks, kv chunk ``2cp-1-src`` follows
  both: q ``[2c]`` x kv first half ``[c]``, no mask;
* ``src > r``: both kv chunks precede query chunk ``2cp-1-r`` and follow chunk ``r``:
  q second half ``[c]`` x kv ``[2c]``, no mask.

Without causal every step is q ``[2c]`` x kv ``[2c]``, no mask (:func:`blocks_by_halves`).
With a sliding window or ALiBi (:func:`by_chunk_pairs`) every step is split into its four
chunk pairs (:func:`chunk_pairs`), each with its local band and ALiBi distance shift, cut to
the rows that see a key and the keys they see (:func:`pair_cut`); a pair the band misses
runs no kernel.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Optional

from ..backends import AttentionParams
from .layout import cp_chunk_ids

RowsKey = Hashable  # names a set of local rows: "all", "first", "second", or a cut of a half
Block = tuple[
    RowsKey, RowsKey, AttentionParams
]  # (query rows, kv rows, the params of that block's kernel)


def blocks_by_halves(step: int, rank: int, size: int, params: AttentionParams) -> list[Block]:
    """The kernel calls of ring step ``step`` without chunk pairs: ``(query rows, kv rows,
    params)`` with rows ``"all"``, ``"first"`` (the rows of chunk ``r``) or ``"second"``
    (those of chunk ``2cp-1-r``); see the module docstring."""
    if not params.causal or step == 0:
        return [("all", "all", params)]  # step 0 is the diagonal block
    src = (rank - step) % size
    unmasked = params.with_band(None, None)
    if src < rank:
        return [
            ("all", "first", unmasked)
        ]  # kv chunk src precedes both query chunks, 2cp-1-src follows
    return [("second", "all", unmasked)]  # both kv chunks precede chunk 2cp-1-r only


def by_chunk_pairs(params: AttentionParams) -> bool:
    """Whether a ring step must be split into its chunk pairs: a window's band, or ALiBi's
    distances, depend on where each chunk lies, not only on the causal order of chunks.

    ALiBi (``alibi_slopes``) splits every step the same way as a window, windowed or not: its
    distance ``|j - i|`` is global too, so each block's kernel gets its distance below the
    global diagonal as ``alibi_shift`` (:class:`~mcore_flash.ops.backends.AttentionParams`):
    ``delta`` (:func:`chunk_pairs`), plus ``first_row - first_key`` for a cut pair
    (:func:`pair_cut`)."""
    return params.window is not None or params.alibi_slopes is not None


def chunk_pairs(step: int, rank: int, size: int) -> list[tuple[str, str, int]]:
    """``(query half, kv half, query chunk - kv chunk)`` of the four chunk pairs of step ``step``.

    With a sliding window (``window_size``) every step is split into these pairs (query chunk
    ``a``, kv chunk ``b``, each ``[c]``): the global band ``lo <= j - i <= hi`` becomes the
    local band ``(lo + delta, hi + delta)`` with ``delta = (a - b) * c``; a pair the band
    misses entirely is skipped (neither computed nor masked, no kernel call), a pair it covers
    entirely runs unmasked, and a pair it cuts runs only the square of its rows that see a key
    against the keys they see (:func:`pair_cut`: no kernel meets a row without keys, which TND
    calls and flash-attn's windows cannot compute). With window 4096 at 128K over cp 8 most
    pairs are skipped.
    """
    q_chunks = zip(("first", "second"), cp_chunk_ids(size, rank))
    kv_chunks = list(zip(("first", "second"), cp_chunk_ids(size, (rank - step) % size)))
    return [(q_half, kv_half, a - b) for q_half, a in q_chunks for kv_half, b in kv_chunks]


def _shifted_band(lo, hi, delta: int, c: int):
    """The local band of a ``c x c`` block ``delta`` rows below the diagonal, or None when no
    pair ``(i, j)`` of it is inside; sides it does not cut become None."""
    lo = None if lo is None else lo + delta
    hi = None if hi is None else hi + delta
    if (lo is not None and lo > c - 1) or (hi is not None and hi < -(c - 1)):
        return None
    lo = None if lo is not None and lo <= -(c - 1) else lo
    hi = None if hi is not None and hi >= c - 1 else hi
    return lo, hi


class PairCut(NamedTuple):
    """The part of a chunk pair a band reaches: rows ``[first_row, first_row + n)`` of its
    query chunk against keys ``[first_key, first_key + n)`` of its kv chunk."""

    first_row: int
    first_key: int
    n: int
    band: tuple[Optional[int], Optional[int]]  # the band of that n x n block
    alibi_shift: int  # its ALiBi distance shift


def pair_cut(params: AttentionParams, delta: int, c: int) -> Optional[PairCut]:
    """The block of a ``c x c`` chunk pair ``delta`` rows below the global diagonal that holds
    every (query, key) pair inside ``params``' band, and no row without a key; None when the
    band misses the pair.

    Row ``i`` sees keys ``[i + lo, i + hi]``: a band below the diagonal (``hi < 0``) leaves
    the first ``-hi`` rows and the last ``-hi`` keys out, one above it (``lo > 0``) the first
    ``lo`` keys and the last ``lo`` rows. What is left is a square whose band holds its own
    diagonal: no kernel meets a row without keys (which TND calls and flash-attn's windows
    cannot compute) and no row is computed for nothing."""
    band = _shifted_band(*params.band(), delta, c)
    if band is None:
        return None
    lo, hi = band
    first_row = 0 if hi is None else max(0, -hi)
    first_key = 0 if lo is None else max(0, lo)
    n = c - first_row - first_key
    trim = first_row - first_key
    return PairCut(first_row, first_key, n, _shifted_band(lo, hi, trim, n), delta + trim)
