"""The saved-bytes meter itself (``mcore_flash.memory``), which the planner and recompute tests trust.

Oracle: byte counts of tensors built by hand, of known size, in situations the meter must
get right whatever the allocator does.
"""

from __future__ import annotations

import torch

from mcore_flash.memory import measure_saved_bytes

NUMEL = 8192  # 32 KiB of float32: glibc hands a freed block of this size straight back


def _saved_at_a_freed_address():
    """Save one tensor, free its storage as ``CheckpointWithoutOutput`` does, then save a new
    tensor that the allocator placed at the freed address: ``(freed, reused)`` storages' bytes."""
    x = torch.ones(NUMEL, requires_grad=True)
    first = x.exp()  # exp saves its output
    address = first.untyped_storage().data_ptr()
    first.untyped_storage().resize_(0)
    for _ in range(1000):
        candidate = torch.empty(NUMEL)
        if candidate.data_ptr() == address:
            break
        del candidate
    else:
        raise AssertionError("the allocator never reused the freed address; the test's premise does not hold here")
    second = candidate.fill_(1.0).requires_grad_(True)
    return second.sin()  # sin saves its input, the tensor at the reused address


def test_a_storage_at_a_freed_storages_address_is_counted():
    _, saved = measure_saved_bytes(_saved_at_a_freed_address)
    assert saved.total == NUMEL * 4  # the freed storage counts 0 bytes, the new one its 32 KiB


def test_a_storage_saved_twice_is_counted_once():
    def fn():
        x = torch.ones(NUMEL, requires_grad=True)
        y = x.exp()  # saves y
        return y * y  # saves y twice more (both operands)

    _, saved = measure_saved_bytes(fn)
    assert saved.total == NUMEL * 4
