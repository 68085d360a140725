"""The saved-bytes meter itself (``mcore_flash.measured_memory``), which the planner and recompute tests trust.

Oracle: byte counts of tensors built by hand, of known size, in situations the meter must
get right whatever addresses the allocator hands out.
"""

from __future__ import annotations

import torch

from mcore_flash.measured_memory import measure_saved_bytes

NUMEL = 8192  # 32 KiB of float32


def _save_free_save():
    """Save a tensor, free its storage as Megatron's ``CheckpointWithoutOutput`` does
    (``resize_(0)``), then save a second tensor of the same size."""
    x = torch.ones(NUMEL, requires_grad=True)
    first = x.exp()  # exp saves its output
    first.untyped_storage().resize_(0)
    return x.sin()  # sin saves its input, x


def test_a_storage_at_a_freed_storages_address_is_counted(monkeypatch):
    """The allocator may put the second tensor where the freed one was (CI once saw it do so):
    every live storage reports one address here, the freed one (0 bytes) address 0."""
    monkeypatch.setattr(
        torch.UntypedStorage, "data_ptr", lambda storage: 0x1000 if storage.nbytes() else 0
    )
    _, saved = measure_saved_bytes(_save_free_save)
    assert saved.total == NUMEL * 4  # the freed storage counts 0 bytes, x its 32 KiB


def test_a_freed_storage_counts_nothing():
    _, saved = measure_saved_bytes(_save_free_save)
    assert saved.total == NUMEL * 4


def test_a_storage_saved_through_several_views_is_counted_once():
    def fn():
        x = torch.ones(NUMEL, requires_grad=True)
        y = x.exp()  # saves y
        return (y * y).sum() + y[:10].sin().sum()  # saves y twice more, then a view of it

    _, saved = measure_saved_bytes(fn)
    assert saved.total == NUMEL * 4  # y's storage, once
