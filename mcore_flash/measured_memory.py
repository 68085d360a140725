"""Exact activation memory: bytes of tensors saved for backward, grouped by submodule.

Measured, not modelled: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor
autograd keeps for backward (including those saved by custom ``autograd.Function``s such
as the fused attention and Megatron's checkpointing). Each storage is counted once, at
its size when the forward pass ends (so storages freed early, e.g. by Megatron's
``CheckpointWithoutOutput``, count 0, and a later storage at a freed one's address counts
on its own), and parameters are not counted. A saved tensor is charged to the innermost
module running when it was saved.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

_LAYER_PREFIX = re.compile(r"^(.*?layers\.)(\d+)\.(.*)$")


@dataclass
class SavedBytes:
    """Bytes saved for backward: the total and per submodule path ("" = outside modules)."""

    total: int = 0
    by_module: dict[str, int] = field(default_factory=dict)

    def per_layer(self) -> dict[str, float]:
        """Mean bytes per transformer layer by submodule suffix (``self_attention.linear_qkv``...).

        Modules under ``...layers.<i>.`` are pooled across layers (the layer itself is
        ``"<layer>"``); everything else is left out.
        """
        sums: dict[str, int] = defaultdict(int)
        layers = set()
        for path, nbytes in self.by_module.items():
            match = _LAYER_PREFIX.match(path + ".")
            if match:
                layers.add(match.group(2))
                sums[match.group(3).rstrip(".") or "<layer>"] += nbytes
        return {name: total / max(1, len(layers)) for name, total in sorted(sums.items())}

    def layer_total(self) -> float:
        """Mean bytes saved per transformer layer."""
        return sum(self.per_layer().values())


def measure_saved_bytes(
    fn: Callable[[], Any], model: Optional[torch.nn.Module] = None
) -> tuple[Any, SavedBytes]:
    """Run ``fn()`` and return ``(its result, SavedBytes)``.

    ``model``'s submodules name the groups and its parameters are excluded; without a
    model everything is charged to ``""``.
    """
    stack: list[str] = [""]
    # Keyed by the storage object, held here, so that no two storages share a key: addresses
    # would not do, the allocator reuses a storage's memory once it is freed (``resize_(0)``).
    storages: dict[int, tuple[str, torch.UntypedStorage]] = {}
    params = (
        {id(s): s for s in (p.untyped_storage() for p in model.parameters())}
        if model is not None
        else {}
    )

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in params and key not in storages and not isinstance(tensor, torch.nn.Parameter):
            storages[key] = (stack[-1], storage)
        return tensor

    def enter(name: str) -> Callable:
        def hook(module, args) -> None:
            stack.append(name)

        return hook

    def leave(module, args, output) -> None:  # must return None: a value would replace the output
        stack.pop()

    handles = []
    if model is not None:
        for name, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = fn()
    finally:
        for handle in handles:
            handle.remove()

    saved = SavedBytes()
    by_module: dict[str, int] = defaultdict(int)
    for path, storage in storages.values():
        by_module[path] += storage.nbytes()
    saved.by_module = dict(by_module)
    saved.total = sum(by_module.values())
    return result, saved


def measure_activation_bytes(model: torch.nn.Module, *args, **kwargs) -> SavedBytes:
    """Bytes saved for backward by one forward pass ``model(*args, **kwargs)`` (no backward)."""
    _, saved = measure_saved_bytes(lambda: model(*args, **kwargs), model)
    return saved
