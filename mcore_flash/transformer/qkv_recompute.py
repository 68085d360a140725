"""The ``qkv`` recompute boundary: keep the attention output, re-run only norm -> QKV -> RoPE.

A fused attention kernel's backward needs ``q, k, v``, its output and its softmax
statistics. ``out`` and the statistics cost the kernel's forward to rebuild; ``q, k, v`` and
everything the *prelude* of the attention sub-block keeps (the input norm's statistics,
``linear_qkv``'s input, RoPE's cos/sin) cost only the input norm, the QKV projection and
RoPE. So one layer's forward under :class:`QKVRecompute` keeps the layer input, the kernel's
``out`` and statistics and everything after the kernel, and drops every other tensor saved
between the layer input and the kernel, as well as the kernel's own ``q, k, v``.

In backward the prelude is re-run once from the kept layer input (Megatron's own code,
stopped where the core attention would start the kernel), the first time a dropped tensor is
needed. The kernel runs once per step; the autograd graph is the original one, only saved
values are re-materialised; outer saved-tensor hooks still see every kept tensor.
:class:`QKVRecompute` has the details.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

Tensor = torch.Tensor

__all__ = ["QKVRecompute"]


def _outer_saved_tensors_hooks():
    """The (pack, unpack) hooks active around this layer, or None. torch has no public API
    for it; without the private one (torch 2.x has it) outer hooks do not see kept tensors."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _PreludeRecomputed(Exception):
    """Stops the prelude's replay at the kernel: its inputs are all the replay needs."""


class QKVRecompute:
    """One layer's forward with the ``qkv`` boundary; lives as long as its saved tensors.

    ``out`` and the statistics cost the kernel's forward to rebuild (at 128K the kernel
    dominates the layer's FLOPs), so one layer's forward under this boundary keeps

    * the layer input (it is the input norm's saved input: one tensor, kept as saved),
    * the kernel's ``out`` and statistics (and anything the kernel saves besides ``q, k, v``),
    * everything after the kernel (``linear_proj``'s input is ``out``; the bias-dropout-add),

    and drops every other tensor saved between the layer input and the kernel, as well as the
    kernel's own ``q, k, v``. In backward, the first time one of them is needed (the kernel's
    backward asks for ``q``), the prelude is re-run once from the kept layer input --
    Megatron's own code, stopped where the core attention would start the kernel -- and the
    tensors it saves replace the dropped ones, one for one, in the order they were saved. The
    autograd graph is the original one; only saved values are re-materialised (the mechanism
    of ``torch.utils.checkpoint``'s non-reentrant mode, with the kernel left out of the
    replay). The kernel runs once per step; its dropout mask is replayed by the kernel's
    backward from its own saved RNG state, as without recompute. The prelude draws no random
    numbers.

    Outer saved-tensor hooks (Megatron's activation offloading,
    :mod:`mcore_flash.measured_memory`'s measurement) still see every tensor this boundary
    keeps: kept tensors go through the hooks that were active when the layer's forward began.

    The kernel's ``q, k, v`` are recognised by identity: the tensors the core attention hands
    to the kernel (:meth:`kernel`). Kernels that save other tensors derived from them (the
    Ulysses all-to-all's head-split ``q, k, v``) keep those: the prelude's tensors are still
    dropped.

    Args:
        run_prelude: runs the attention sub-block from a layer input ``[s, b, h]`` (or the
            sequence-parallel ``[s/tp, b, h]``) up to the core attention, which calls
            :meth:`kernel` (the rest of the sub-block never runs in the replay).
        layer_input: the layer input of this forward (kept for backward).
    """

    def __init__(self, run_prelude: Callable[[Tensor], object], layer_input: Tensor):
        self._run_prelude = run_prelude
        self._input = layer_input.detach()
        self._input_storage = layer_input.untyped_storage().data_ptr()
        self._outer = _outer_saved_tensors_hooks()
        self._phase = "prelude"  # forward: "prelude" -> "kernel" -> "after"; "replay" in backward
        self._saves = 0  # tensors saved so far in the prelude (numbers the dropped ones)
        self._kernel_inputs: tuple[Tensor, ...] = ()
        self._replayed: Optional[tuple[list[Tensor], tuple[Tensor, ...]]] = None

    @contextlib.contextmanager
    def forward(self):
        """Scope of the layer's attention sub-block in forward."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
        if self._phase != "after":
            raise RuntimeError(
                "qkv recompute: the attention sub-block never reached the fused kernel (its core attention "
                "must be FlashDotProductAttention, which calls QKVRecompute.kernel)"
            )

    @contextlib.contextmanager
    def kernel(self, q: Tensor, k: Tensor, v: Tensor):
        """Around the fused kernel's call on exactly these ``q, k, v`` (whatever layout)."""
        if self._phase == "replay":
            self._kernel_inputs = (q.detach(), k.detach(), v.detach())
            raise _PreludeRecomputed
        self._kernel_inputs, self._phase = (q, k, v), "kernel"
        try:
            yield
        finally:
            self._kernel_inputs, self._phase = (), "after"

    # saved-tensor hooks -----------------------------------------------------------------

    def _keep(self, tensor: Tensor):
        return ("keep", self._outer[0](tensor) if self._outer else tensor)

    def _pack(self, tensor: Tensor):
        if self._phase == "prelude":
            index, self._saves = self._saves, self._saves + 1
            if (
                isinstance(tensor, torch.nn.Parameter)
                or tensor.untyped_storage().data_ptr() == self._input_storage
            ):
                return self._keep(tensor)
            return ("prelude", index)
        if self._phase == "kernel":
            for slot, kernel_input in enumerate(self._kernel_inputs):
                if tensor is kernel_input:
                    return ("kernel", slot)
        return self._keep(tensor)

    def _unpack(self, packed):
        kind, value = packed
        if kind == "keep":
            return self._outer[1](value) if self._outer else value
        saved, kernel_inputs = self._replay()
        return saved[value] if kind == "prelude" else kernel_inputs[value]

    def _replay(self) -> tuple[list[Tensor], tuple[Tensor, ...]]:
        """Re-run the prelude once from the kept input: (its saved tensors, the kernel's
        q, k, v)."""
        if self._replayed is None:
            saved: list[Tensor] = []

            def record(tensor: Tensor) -> Tensor:
                saved.append(tensor.detach())
                return tensor

            self._phase = "replay"
            layer_input = self._input.detach().requires_grad_(self._input.requires_grad)
            with (
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor),
            ):
                try:
                    self._run_prelude(layer_input)
                except _PreludeRecomputed:
                    pass
                else:
                    raise RuntimeError(
                        "qkv recompute: the replayed prelude never reached the fused kernel"
                    )
            if len(saved) != self._saves:
                raise RuntimeError(
                    f"qkv recompute: the replayed prelude saved {len(saved)} tensors, the forward {self._saves}; "
                    "the attention sub-block must compute the same way twice"
                )
            self._replayed = (saved, self._kernel_inputs)
        return self._replayed
