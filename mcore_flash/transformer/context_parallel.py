"""Context parallelism for the trainer: split a batch over Megatron's CP group.

    from mcore_flash.transformer.context_parallel import get_batch_on_this_cp_rank

    batch = get_batch_on_this_cp_rank(
        {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    )

Megatron's ``get_batch_on_this_cp_rank`` semantics (``megatron/core/utils.py``): the sequence
is cut into ``2*cp`` equal chunks and rank ``r`` keeps chunks ``r`` and ``2cp-1-r`` (so
every rank gets the same causal attention work). Every tensor is split along dim 1, except
``attention_mask`` (``[b, 1, s, s]``), whose query rows (dim 2) are split. Megatron's RoPE
slices its embedding the same way (``get_pos_emb_on_this_cp_rank``), and
:class:`~mcore_flash.transformer.attention.FlashDotProductAttention` assumes this layout.

After the forward pass each rank holds the per-token losses of its own tokens: sum them
with the loss mask, all-reduce the sum and the token count over the CP group; Megatron's
DDP then reduces gradients over data x context parallel ranks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mcore_flash.ops.context_parallel import split_for_cp_rank

__all__ = ["cp_size_and_rank", "get_batch_on_this_cp_rank"]

_SEQ_DIM = {"attention_mask": 2}  # everything else: dim 1


def get_batch_on_this_cp_rank(
    batch: dict[str, Any],
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
    *,
    cp_size: Optional[int] = None,
    cp_rank: Optional[int] = None,
) -> dict[str, Any]:
    """This CP rank's share of ``batch`` (a new dict; None values and non-tensors pass through).

    The CP size and rank come from ``cp_size``/``cp_rank`` if given, else from ``cp_group``,
    else from Megatron's ``parallel_state``. Raises ValueError when a sequence length is not
    divisible by ``2 * cp``.
    """
    cp_size, cp_rank = cp_size_and_rank(cp_group, cp_size, cp_rank)
    if cp_size == 1:
        return dict(batch)
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            out[key] = value
            continue
        seq_dim = _SEQ_DIM.get(key, 1)
        if value.dim() <= seq_dim:
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}: expected a sequence dim {seq_dim}"
            )
        seq = value.shape[seq_dim]
        if seq % (2 * cp_size):
            raise ValueError(
                f"batch[{key!r}] has sequence length {seq}, not divisible by 2 x --context-parallel-size = "
                f"{2 * cp_size}: choose --seq-length as a multiple of {2 * cp_size} (or change "
                "--context-parallel-size)"
            )
        out[key] = split_for_cp_rank(value, seq_dim, cp_size, cp_rank)
    return out


def cp_size_and_rank(cp_group, cp_size: Optional[int], cp_rank: Optional[int]) -> tuple[int, int]:
    """``(cp_size, cp_rank)`` from the explicit pair, else ``cp_group``, else megatron's state."""
    if cp_size is not None or cp_rank is not None:
        if cp_size is None or cp_rank is None:
            raise ValueError("pass both cp_size and cp_rank, or neither")
        if cp_size < 1 or not 0 <= cp_rank < cp_size:
            raise ValueError(
                f"cp_rank={cp_rank} is outside a context-parallel group of size {cp_size}"
            )
        return cp_size, cp_rank
    if cp_group is not None:
        return cp_group.size(), cp_group.rank()
    from megatron.core import parallel_state

    return (
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_context_parallel_rank(),
    )
