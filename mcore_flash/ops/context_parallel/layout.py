"""Which rows of the sequence each context-parallel rank holds. No communication.

One sequence (Megatron's ``get_batch_on_this_cp_rank``): it is cut into ``2*cp`` equal
chunks and rank ``r`` holds chunks ``r`` and ``2*cp-1-r``, concatenated, so every rank gets
the same causal work.

Packed documents (THD, Transformer Engine's scheme): every document is cut into ``2*cp``
chunks and rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of EVERY document, in document
order. Documents must be padded to multiples of ``2*cp``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

Tensor = torch.Tensor

Rows = Union[slice, Tensor]  # some rows of the local sequence: a slice, or their int64 indices


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two sequence chunks (out of ``2*cp_size``) rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_for_cp_rank(x: Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> Tensor:
    """Rank ``cp_rank``'s part of ``x`` along ``seq_dim``: chunks r and 2cp-1-r of 2cp.

    Megatron's ``get_batch_on_this_cp_rank`` split. Raises ValueError when the length is not
    divisible by ``2*cp_size``.
    """
    seq = x.shape[seq_dim]
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside a context-parallel group of size {cp_size}")
    if seq % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq} is not divisible by 2 * context-parallel size = {2 * cp_size} "
            "(each rank holds two equal chunks)"
        )
    if cp_size == 1:
        return x
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=seq_dim)


def gather_from_cp_ranks(parts: list[Tensor], seq_dim: int) -> Tensor:
    """Inverse of :func:`split_for_cp_rank`: every rank's part (rank order) -> the whole."""
    cp_size = len(parts)
    chunks: list[Optional[Tensor]] = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        first, second = cp_chunk_ids(cp_size, rank)
        chunks[first], chunks[second] = part.chunk(2, dim=seq_dim)
    return torch.cat(chunks, dim=seq_dim)


def thd_positions_for_cp_rank(cu_seqlens: list[int], cp_size: int, cp_rank: int) -> Tensor:
    """Rank ``cp_rank``'s rows of a pack of documents: their positions in the whole pack.

    Transformer Engine's THD split (and megatron-core's THD RoPE): every document (length
    ``cu_seqlens[i+1] - cu_seqlens[i]``, divisible by ``2*cp_size``) is cut into ``2*cp``
    equal chunks and the rank takes chunks ``r`` and ``2cp-1-r`` of EVERY document, in
    document order (``cp_size == 1``: every row). Returns int64 ``[cu_seqlens[-1] // cp_size]``.
    """
    if cp_size == 1:
        return torch.arange(cu_seqlens[-1])
    check_thd_cp_lengths(cu_seqlens, cp_size)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    starts, lengths = [], []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        chunk = (end - start) // (2 * cp_size)
        starts += [start + first * chunk, start + second * chunk]
        lengths += [chunk, chunk]
    return concat_ranges(starts, lengths)


def concat_ranges(starts: list[int], lengths: list[int]) -> Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` without a loop of
    tensor ops (packs hold thousands of documents). int64."""
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    total = int(lengths_t.sum())
    segment_starts = torch.cumsum(lengths_t, 0) - lengths_t
    offsets = torch.arange(total) - torch.repeat_interleave(
        segment_starts, lengths_t, output_size=total
    )
    return (
        torch.repeat_interleave(
            torch.tensor(starts, dtype=torch.int64), lengths_t, output_size=total
        )
        + offsets
    )


def check_thd_cp_lengths(cu_seqlens: list[int], cp_size: int) -> None:
    """Every document of a pack split over ``cp_size`` ranks must be a multiple of ``2*cp``."""
    lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    bad = [n for n in lengths if n % (2 * cp_size)]
    if bad:
        raise ValueError(
            f"packed documents of lengths {bad[:6]} are not multiples of 2 x context-parallel size = "
            f"{2 * cp_size}: pad every document to a multiple of {2 * cp_size} "
            "(mcore_flash.transformer.packed_sequences does; cu_seqlens_q_padded holds the padded lengths)"
        )
