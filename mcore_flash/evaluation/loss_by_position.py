"""Loss as a function of token position: does the model use the far context?

Per-token losses of held-out sequences are averaged in position buckets of doubling width,
``[0, 1), [1, 2), [2, 4), [4, 8), ...`` up to the sequence length (the last bucket ends at
the length). A model that uses long context keeps lowering its loss in the late buckets; a
model that does not is flat after its effective context. Positions count from the start of
the evaluated sequence (a ``--seq-length`` window of the held-out stream, as in training).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PositionBucket", "position_buckets", "loss_by_position"]


@dataclass(frozen=True)
class PositionBucket:
    start: int  # first position (0-based)
    end: int  # one past the last position
    tokens: int  # tokens averaged
    loss: float  # mean loss in nats per token


def position_buckets(length: int) -> list[tuple[int, int]]:
    """``[(0, 1), (1, 2), (2, 4), (4, 8), ..., (2^k, length)]`` covering ``range(length)``."""
    edges, edge = [0], 1
    while edge < length:
        edges.append(edge)
        edge *= 2
    edges.append(length)
    return list(zip(edges[:-1], edges[1:]))


def loss_by_position(model, batches) -> list[PositionBucket]:
    """Mean loss per bucket over ``batches`` of ``(tokens [n, s], labels [n, s], loss_mask
    [n, s])`` (all the same ``s``) run through ``model`` (a :class:`LoadedModel`)."""
    total = count = None
    for tokens, labels, loss_mask in batches:
        _, loss = model.predict(tokens, labels)
        mask = loss_mask.float()
        sums, tokens_at = (loss * mask).sum(dim=0).double(), mask.sum(dim=0).double()
        total = sums if total is None else total + sums
        count = tokens_at if count is None else count + tokens_at
    if total is None:
        raise ValueError("loss by position: no held-out sequences to evaluate")
    buckets = []
    for start, end in position_buckets(len(total)):
        n = float(count[start:end].sum())
        buckets.append(
            PositionBucket(
                start, end, int(n), float(total[start:end].sum()) / n if n else float("nan")
            )
        )
    return buckets


def stack_samples(samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTDataset samples (dicts of ``tokens``, ``labels``, ``loss_mask``) -> three ``[n, s]`` tensors."""
    return tuple(
        torch.stack([torch.as_tensor(s[key]) for s in samples])
        for key in ("tokens", "labels", "loss_mask")
    )
