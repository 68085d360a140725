"""Packed documents (Megatron-LM's ``--reset-attention-mask``): a batch -> THD + cu_seqlens.

    from mcore_flash.transformer.packed_sequences import pack_documents

    local, packed_seq_params = pack_documents(batch, eod=tokenizer.eod, cp_size=cp, cp_rank=r)
    model(local["tokens"], local["position_ids"], None, labels=local["labels"],
          packed_seq_params=packed_seq_params)

Documents are found as Megatron-LM finds them (``get_ltor_masks_and_position_ids``): a
document ends right after each EOD token of the input ``tokens`` and at the end of every
sample (:func:`document_lengths`). The ``b`` samples of a micro-batch are flattened into one
pack (THD: the model sees ``[1, t]``), described by cumulative lengths -- never by an
``S x S`` mask. Under CP rank ``r`` keeps chunks ``r`` and ``2cp-1-r`` of every document
(Transformer Engine's THD scheme), so each document is padded at its end to a multiple of
``2*cp`` (:func:`padded_lengths`); padding never changes the loss or a gradient. The padded
lengths are both ``cu_seqlens_*`` and ``cu_seqlens_*_padded`` of the ``PackedSeqParams``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from mcore_flash.ops.context_parallel import concat_ranges, thd_positions_for_cp_rank
from mcore_flash.transformer.context_parallel import cp_size_and_rank

__all__ = ["document_lengths", "pack_documents", "padded_lengths"]

_PER_TOKEN = ("tokens", "labels", "loss_mask", "position_ids")


def document_lengths(tokens: torch.Tensor, eod: int) -> list[int]:
    """Lengths of the documents of ``tokens [b, s]`` flattened sample after sample.

    A document ends after each ``eod`` token and at each sample's end (no document spans
    two samples). The lengths sum to ``b * s``.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    lengths = []
    seq = tokens.shape[1]
    for sample in tokens.cpu():
        ends = (torch.nonzero(sample == eod).flatten() + 1).tolist()
        if not ends or ends[-1] != seq:
            ends.append(seq)
        lengths += [end - start for start, end in zip([0] + ends[:-1], ends)]
    return lengths


def padded_lengths(lengths: list[int], cp_size: int, pad_to_multiple_of: int = 1) -> list[int]:
    """The padding rule: each length rounded up to a multiple of ``2*cp`` (cp > 1), then an
    all-padding document appended if the total is not a multiple of
    ``cp * pad_to_multiple_of`` (it is itself a multiple of ``2*cp``).

    Why (context parallelism, sequence parallelism): under CP every document is split into
    ``2*cp`` equal chunks and rank ``r`` keeps chunks ``r`` and ``2cp-1-r`` of every document
    (Transformer Engine's THD scheme, which megatron-core's THD RoPE follows), so each
    document is padded at its END to a multiple of ``2*cp``; a document of 1..2cp-1 tokens
    becomes one of ``2*cp``. With ``pad_to_multiple_of`` (sequence parallelism needs each CP
    rank's rows divisible by TP) one more all-padding document closes the pack. Padding rows
    carry token 0, label 0, loss mask 0 and continue their document's positions; causal
    attention never shows them to a real token (they follow every real token of their
    document), so the loss and every gradient equal those of the unpadded documents. The
    padded lengths are both ``cu_seqlens_*`` and ``cu_seqlens_*_padded`` of the
    ``PackedSeqParams``.
    """
    multiple = 2 * cp_size if cp_size > 1 else 1
    padded = [-(-n // multiple) * multiple for n in lengths]
    total_multiple = math.lcm(multiple, cp_size * pad_to_multiple_of)
    tail = -sum(padded) % total_multiple
    return padded + [tail] if tail else padded


def pack_documents(
    batch: dict[str, Any],
    eod: int,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
    *,
    cp_size: Optional[int] = None,
    cp_rank: Optional[int] = None,
    pad_to_multiple_of: int = 1,
) -> tuple[dict[str, Any], Any]:
    """This CP rank's rows of ``batch`` as one pack, and megatron's ``PackedSeqParams``.

    Args:
        batch: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``, each ``[b, s]``
            (positions as the dataset made them: reset per document with
            ``--reset-position-ids``). Other entries pass through; an ``attention_mask`` is
            refused (packed documents take their boundaries from EOD tokens).
        eod: the tokenizer's end-of-document id.
        cp_group / cp_size / cp_rank: as in
            :func:`mcore_flash.transformer.context_parallel.get_batch_on_this_cp_rank`.
        pad_to_multiple_of: each CP rank's row count becomes a multiple of this (TP size
            under sequence parallelism).

    Returns:
        ``(local, params)``: ``local[key]`` is ``[1, t_local]``; ``params.cu_seqlens_q``
        (= ``_kv``, ``_padded``) are the int32 cumulative padded lengths over the whole
        pack, ``max_seqlen_*`` the longest padded document.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if batch.get("attention_mask") is not None:
        raise ValueError(
            "--reset-attention-mask builds document boundaries from EOD tokens: the batch must not "
            "carry an attention_mask (drop it, or train without --reset-attention-mask)"
        )
    cp_size, cp_rank = cp_size_and_rank(cp_group, cp_size, cp_rank)
    tokens = batch["tokens"]
    lengths = document_lengths(tokens, eod)
    padded = padded_lengths(lengths, cp_size, pad_to_multiple_of)
    cu = [0]
    for n in padded:
        cu.append(cu[-1] + n)
    mine = thd_positions_for_cp_rank(cu, cp_size, cp_rank)
    source, first, offset = (x[mine].to(tokens.device) for x in _pack_rows(lengths, padded))
    real = source >= 0
    local = {}
    for key, value in batch.items():
        if key not in _PER_TOKEN:
            local[key] = value
            continue
        flat = value.reshape(-1)
        if key == "position_ids":  # padding continues its document's positions
            fill = torch.where(first >= 0, flat[first.clamp(min=0)], 0) + offset
        else:
            fill = torch.zeros_like(flat[:1])
        local[key] = torch.where(real, flat[source.clamp(min=0)], fill).unsqueeze(0)
    cu_tensor = torch.tensor(cu, dtype=torch.int32, device=tokens.device)
    longest = max(padded)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_tensor,
        cu_seqlens_kv=cu_tensor,
        cu_seqlens_q_padded=cu_tensor,
        cu_seqlens_kv_padded=cu_tensor,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    return local, params


def _pack_rows(
    lengths: list[int], padded: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of the padded pack: its row in the flattened batch (-1: padding), the batch
    row of its document's first token (-1: the all-padding document) and its offset in the
    document. Each int64 ``[sum(padded)]``."""
    real = lengths + [0] * (len(padded) - len(lengths))
    starts = [0]
    for n in real[:-1]:
        starts.append(starts[-1] + n)
    padded_t = torch.tensor(padded, dtype=torch.int64)
    offset = concat_ranges([0] * len(padded), padded)
    first = torch.repeat_interleave(
        torch.tensor([s if n else -1 for s, n in zip(starts, real)]), padded_t
    )
    is_real = offset < torch.repeat_interleave(torch.tensor(real, dtype=torch.int64), padded_t)
    return torch.where(is_real, first + offset, -1), first, offset
