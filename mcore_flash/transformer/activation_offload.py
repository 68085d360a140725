"""Activation offload: what the first N layers of a stage keep for backward waits on the host.

``--activation-offload-layers N`` (:func:`install`): for each forward of layer ``i < N`` of a
``TransformerBlock`` (this pipeline stage's layers), every tensor autograd saves for backward
while the layer runs is copied to (pinned) host memory when the layer's forward ends and its
device copy is released; before the layer's backward it comes back. Under full or partial
recompute that is the checkpoint's input, under ``qkv`` recompute the kept attention output
and softmax statistics, without recompute whatever the layer saves. Never offloaded:
parameters and tensors sharing their storage, the block's other inputs, and under ``qkv``
recompute the layer input. On a device the copies run on ``platform.side_stream()``,
overlapping the neighbouring layer's compute (on the CPU every copy is synchronous);
:attr:`ActivationOffload.events` records their order. One checkpoint must hold one layer
(refused: ``--recompute-method uniform --recompute-num-layers > 1``).

:class:`ActivationOffload` states the mechanism and the order of copies;
``docs/megatron-spec.md``, "Activation offload", the flag and its tests.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from mcore_flash import platform

Tensor = torch.Tensor

__all__ = ["ActivationOffload", "install"]


def _storage(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _Parcel:
    """The saved tensors of one forward of one offloaded layer (one micro-batch).

    ``device[k]``: the device tensor (until released, and again once fetched back);
    ``host[k]``: its host copy (once issued). ``previous``: the parcel of the layer forwarded
    just before in the same block forward (the next one in backward order)."""

    def __init__(self, offload: "ActivationOffload", layer: int, previous: Optional["_Parcel"]):
        self.offload, self.layer, self.previous = offload, layer, previous
        self.device: list[Optional[Tensor]] = []
        self.host: list[Optional[Tensor]] = []
        self.where: list[torch.device] = []  # each tensor's device
        self.slots: dict[int, int] = {}  # id(tensor) -> slot: a tensor saved twice is parked once
        self.d2h_done = self.h2d_done = None  # side-stream events
        self.state = "open"  # open -> parked (copies issued) -> released -> fetching -> fetched

    def add(self, tensor: Tensor) -> int:
        slot = self.slots.get(id(tensor))
        if slot is None:
            slot = self.slots[id(tensor)] = len(self.device)
            self.device.append(tensor)
            self.host.append(None)
            self.where.append(tensor.device)
        return slot

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host if t is not None)


class _Handle:
    """What autograd holds for one offloaded saved tensor; dropping it frees both copies."""

    __slots__ = ("parcel", "slot")

    def __init__(self, parcel: _Parcel, slot: int):
        self.parcel, self.slot = parcel, slot

    def __del__(self):
        self.parcel.device[self.slot] = self.parcel.host[self.slot] = None


class ActivationOffload:
    """Offload of the first ``num_layers`` layers of ``block`` (a ``TransformerBlock``).

    For each forward of layer ``i < num_layers``, every tensor autograd saves for backward
    while the layer runs -- under full or partial recompute the checkpoint's input
    ``[s/tp/cp, b, h]`` (SP) or ``[s/cp, b, h]`` (megatron's ``CheckpointFunction`` saves it
    with ``ctx.save_for_backward`` right after the layer's forward), under ``qkv`` recompute
    the kept attention output and softmax statistics (the boundary hands its kept tensors to
    these outer hooks), without recompute whatever the layer saves -- is copied to (pinned)
    host memory when the layer's forward ends and its device copy is released; before the
    layer's backward it comes back. The mechanism is
    ``torch.autograd.graph.saved_tensors_hooks`` (``save_on_cpu``'s design) around the block's
    forward; a forward pre-hook on each layer tells which layer a save belongs to (saves after
    layer ``i`` started and before the next layer starts are layer ``i``'s: the checkpoint
    saves its input after the layer returns).

    Never offloaded: parameters and tensors sharing a storage with one (weights, their views),
    tensors sharing a storage with the block's other inputs (the attention mask, RoPE's
    frequencies: shared by every layer, held by the model anyway), and under ``qkv`` recompute
    the layer input (the boundary holds it itself).

    Ordering, on a device (``platform.side_stream()``; on the CPU there is none and every copy
    is synchronous): layer ``i``'s device-to-host copies are issued on the side stream when
    its forward ends (at the next layer's start or the block's end), and its device tensors
    released at the following boundary, after the compute stream waits for the copy (so the
    copy overlaps layer ``i + 1``'s forward). In backward, the first unpack of layer ``i`` (its
    backward starts) waits for its own host-to-device copy (issued now if no prefetch did) and
    issues layer ``i - 1``'s on the side stream, into buffers allocated on the compute stream,
    so that copy overlaps layer ``i``'s backward. :attr:`events` records this order as strings
    (``"d2h 3"``, ``"h2d 2"``, ``"wait 2"``, ``"release 3"``); each forward of the block
    (micro-batch) is a separate chain.

    Limits: one checkpoint must hold one layer (refused: ``--recompute-method uniform
    --recompute-num-layers > 1``). On pipeline stages after the first, megatron's schedule
    holds the received input of layer 0 for its own backward, so parking it frees nothing
    there.

    Attributes:
        events: the layers' forwards and the copies in the order issued: ``"forward i"`` (layer
            ``i`` of the stage starts), ``"d2h i"`` (its copies to the host issued),
            ``"release i"`` (its device copies dropped), ``"h2d i"`` (copies back issued),
            ``"wait i"`` (the compute stream waits for them: layer ``i``'s backward starts).
        parked_bytes: bytes of all tensors on the host now (host copies alive).
        released_bytes: bytes of the device storages the parked tensors lived in, summed over
            every forward (what the device gave up; more than the tensors' own bytes where a
            saved tensor is a view of a larger storage, e.g. the two halves of SwiGLU's input).
    """

    def __init__(self, block: torch.nn.Module, num_layers: int):
        layers = list(block.layers)
        if not 0 <= num_layers <= len(layers):
            raise ValueError(
                f"--activation-offload-layers {num_layers}: choose 0..{len(layers)} (the layers of "
                "this pipeline stage)"
            )
        self.num_layers = num_layers
        self.side, self.device_module = platform.side_stream()
        self.events: list[str] = []
        self.released_bytes = 0
        self._parcels: list[_Parcel] = []  # host copies issued, not yet freed (for parked_bytes)
        self._active = False  # inside a block forward with grad enabled
        self._open: Optional[_Parcel] = None  # the layer saving now
        self._released: Optional[_Parcel] = None  # parked, device copies still held
        self._last: Optional[_Parcel] = None
        self._skip: set[int] = set()  # storages never offloaded in this forward
        self._keep_input = False
        block.forward = functools.partial(self._block_forward, block.forward)
        for index, layer in enumerate(layers):
            layer.register_forward_pre_hook(
                functools.partial(self._layer_starts, index), with_kwargs=True
            )
        if getattr(block, "final_layernorm", None) is not None:
            block.final_layernorm.register_forward_pre_hook(lambda *_: self._boundary(None))

    @property
    def parked_bytes(self) -> int:
        self._parcels = [p for p in self._parcels if any(t is not None for t in p.host)]
        return sum(p.nbytes() for p in self._parcels)

    # forward ----------------------------------------------------------------------------

    def _block_forward(self, forward, *args, **kwargs):
        if self.num_layers == 0 or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        shared = [v for k, v in kwargs.items() if k != "hidden_states"] + list(args[1:])
        self._skip = {_storage(t) for t in shared if isinstance(t, Tensor)}
        self._active, self._last = True, None
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return forward(*args, **kwargs)
        finally:
            self._boundary(None)
            self._release()
            self._active = False

    def _layer_starts(self, index: int, layer, args, kwargs):
        if not self._active:  # a recompute in backward, or no grad
            return
        self.events.append(f"forward {index}")
        self._boundary(index if index < self.num_layers else None)
        if self._open is not None:
            self._skip |= {_storage(p) for p in layer.parameters()}
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            self._keep_input = bool(getattr(layer, "recompute_qkv", False)) and hidden is not None
            if self._keep_input:
                self._skip.add(_storage(hidden))

    def _boundary(self, next_layer: Optional[int]) -> None:
        """The open layer's forward ended: park it; open ``next_layer`` (None: no offload)."""
        parcel, self._open = self._open, None
        if parcel is not None:
            self._park(parcel)
        else:
            self._release()
        if next_layer is not None:
            self._open = self._last = _Parcel(self, next_layer, self._last)

    def _park(self, parcel: _Parcel) -> None:
        """Issue the parcel's device-to-host copies; release the previous parcel's device copies."""
        if self.side is not None:
            self.side.wait_stream(self.device_module.current_stream())
        with self._on_side():
            for slot, tensor in enumerate(parcel.device):
                host = torch.empty(
                    tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type != "cpu"
                )
                parcel.host[slot] = host.copy_(tensor, non_blocking=True)
        parcel.d2h_done = self.side.record_event() if self.side is not None else None
        parcel.state = "parked"
        self._parcels.append(parcel)
        self.events.append(f"d2h {parcel.layer}")
        self._release()
        self._released = parcel

    def _release(self) -> None:
        parcel, self._released = self._released, None
        if parcel is None:
            return
        if parcel.d2h_done is not None:
            self.device_module.current_stream().wait_event(parcel.d2h_done)
        storages = {
            _storage(t): t.untyped_storage().nbytes() for t in parcel.device if t is not None
        }
        self.released_bytes += sum(storages.values())
        parcel.device = [None] * len(parcel.device)
        parcel.state = "released"
        self.events.append(f"release {parcel.layer}")

    def _on_side(self):
        return (
            self.device_module.stream(self.side)
            if self.side is not None
            else contextlib.nullcontext()
        )

    def _pack(self, tensor: Tensor):
        parcel = self._open
        if (
            parcel is None
            or isinstance(tensor, torch.nn.Parameter)
            or _storage(tensor) in self._skip
        ):
            return ("keep", tensor)
        return _Handle(parcel, parcel.add(tensor))

    # backward ---------------------------------------------------------------------------

    def _unpack(self, packed):
        if isinstance(packed, tuple):
            return packed[1]
        parcel = packed.parcel
        if parcel.state in ("open", "parked"):  # unpacked in its own forward (double backward)
            return parcel.device[packed.slot]
        if parcel.state == "released":
            self._fetch(parcel)
        if parcel.state == "fetching":
            if parcel.h2d_done is not None:
                self.device_module.current_stream().wait_event(parcel.h2d_done)
            parcel.state = "fetched"
            self.events.append(f"wait {parcel.layer}")
            previous, parcel.previous = parcel.previous, None
            if previous is not None and previous.state == "released":
                self._fetch(previous)  # the next layer in backward order, one layer ahead
        return parcel.device[packed.slot]

    def _fetch(self, parcel: _Parcel) -> None:
        """Issue the parcel's host-to-device copies on the side stream (buffers allocated on
        the compute stream, which frees them after use)."""
        buffers = [
            None if host is None else torch.empty(host.shape, dtype=host.dtype, device=where)
            for host, where in zip(parcel.host, parcel.where)
        ]
        if self.side is not None:
            self.side.wait_stream(self.device_module.current_stream())
        with self._on_side():
            for buffer, host in zip(buffers, parcel.host):
                if host is not None:
                    buffer.copy_(host, non_blocking=True)
        parcel.h2d_done = self.side.record_event() if self.side is not None else None
        parcel.device, parcel.state = buffers, "fetching"
        self.events.append(f"h2d {parcel.layer}")


def install(block: torch.nn.Module, num_layers: int) -> ActivationOffload:
    """Offload the saved tensors of ``block``'s first ``num_layers`` layers (0: nothing); the
    returned object's ``events`` record the copies' order."""
    return ActivationOffload(block, num_layers)
