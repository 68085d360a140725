"""Weight streaming (the ladder's top rung): torch FSDP2 ``fully_shard`` with
``CPUOffloadPolicy(pin_memory=True)`` over the ``D = dp * cp`` ranks, the trainer's
``--use-torch-fsdp2 --fsdp2-offload-to-cpu``.

Units (:func:`stream_units`): the embedding and each transformer layer, then the root (the
``GPTModel``: final norm and output layer), all with ``reshard_after_forward=True``. A unit of
``P`` elements (one TP rank's) has the shard ``S`` = the sum over its parameters of
``ceil(rows / D) * columns`` (FSDP2 pads every parameter's dim-0 chunks alike on every rank).

**Device bytes, the contract** (:func:`stream_device_bytes`, per rank, at the step's worst
moment for FSDP2's own tensors; they replace the resident ``weights``, ``gradients`` and
``optimizer_state`` the other rungs count). Between steps nothing of the model is on the
device (``optimizer_state`` = 0; the fp32 shards, gradients and Adam live on the host). In
a step, with ``p`` the bytes of ``param_dtype`` (bf16: 2, fp32: 4) and ``r`` = 4 (fp32
``reduce_dtype``), FSDP2 (torch 2.13, ``torch/distributed/fsdp/_fully_shard``) allocates:

* *gathering* a unit (``foreach_all_gather``): each parameter's fp32 shard copied to the
  device (``FSDPParam.all_gather_inputs``: ``.to(device)``, then ``_to_dtype_if_needed``; the
  fp32 copy dies with the cast, so the unit's casts ``p·S`` and one parameter's fp32 copy
  ``4·s`` are alive at once, one tensor under fp32), then the flat all-gather output ``p·D·S``;
  the casts die after the copy-in;
* *waiting* for it (``foreach_all_gather_copy_out``): each parameter's unsharded tensor,
  ``p·D·S`` (padded rows), into which the flat output is copied; the flat output dies then;
* in the unit's *backward* autograd's unsharded gradients, ``p·P`` (the parameter's dtype);
* in its *post-backward* (``FSDPParamGroup.post_backward``): the unsharded parameters freed
  (``reshard``), the previous unit's reduce-scatter input popped from
  ``reduce_scatter_states`` (FSDP2 keeps one alive, ``reduce_scatter_max_input_buffers`` =
  1, until the next unit's reduce-scatter), the reduce-scatter input ``r·D·S``
  (``foreach_reduce``), the unsharded gradients freed (``unsharded_grads.clear()``), the
  reduce-scatter output ``r·S``, copied to the host and freed.

The root's parameters are gathered for the forward and again for the backward, where they
and their gradients (``p·D·S_root + p·P_root``) stay until the root's post-backward, the
last. The backward prefetches one unit: while unit ``i`` computes, unit ``i-1``'s flat
all-gather output is alive. :func:`stream_backward_moments` replays the backward moment by
moment; the device bytes are its largest moment's: ``weights`` (the root's unsharded
parameters, the unit's, the prefetched flat output, the casts and fp32 copies) and
``gradients`` (the root's and the unit's unsharded gradients, the reduce-scatter buffers).
With units of one size the largest is the end of a layer's backward that follows another
layer's: ``p·(D·S_root + P_root) + p·D·S + p·P + p·D·S_prefetched + r·D·S_previous``. The
forward's moments (no gradient, no reduce-scatter) are below the backward's.

Not counted: the caching allocator's cross-stream delays (the copies run on side streams;
the host rungs' larger headroom, :data:`.memory.MIN_FREE_SHARE_HOST`).

**Host bytes** (:func:`stream_host_bytes`, per rank; a node sums its ranks): the fp32
sharded parameters (the master), Adam's fp32 m and v (``host_optimizer_state`` = 12 B per
shard element of every unit and the root, plus torch Adam's 4-byte step per parameter) and
the fp32 gradient shard (``host_gradient_copy`` = 4 B per shard element): 16 B per shard
element, pinned (the parameters and gradients; Adam's state is pageable).

**Copies** (:func:`stream_copy_seconds`, per micro-batch): every unit's fp32 shard host to
device twice (before its forward and its backward; the root too, gathered again for its
backward as above), its fp32 gradient shard device to host once, at the profile's
``host_device_bandwidth`` (the offload rung's assumption), each hidden behind the previous
unit's compute (prefetch one unit ahead) but the first of each pass and the last gradient.
That holds for a step's first micro-batch only: from the second on, a unit's gradient shard
already exists on the host, and FSDP2 (``foreach_reduce``) copies the new one down with
``non_blocking=False`` and adds it there, on the thread that issues the next unit's
backward (:func:`stream_accumulation_seconds`: each layer's gradient copy is exposed, and
the host's add of the rank's shard).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from .models import ModelShape
from .parallel_layout import Layout
from .parameters import stage_parameter_shapes
from .units import BF16_BYTES, FP32_BYTES

__all__ = [
    "StreamUnit",
    "stream_units",
    "StreamMoment",
    "stream_backward_moments",
    "stream_device_bytes",
    "stream_shard_elements",
    "stream_host_bytes",
    "stream_copy_seconds",
    "stream_accumulation_seconds",
]

ADAM_STATE_BYTES = 3 * FP32_BYTES  # the fp32 master (the sharded parameter), m, v
STEP_COUNTER_BYTES = 4  # torch Adam's fp32 "step" per parameter, on the host


class StreamUnit(NamedTuple):
    """One FSDP2 unit on one rank: ``elements`` (its unsharded parameters, one TP rank's),
    ``shard`` (this rank's padded shard elements), ``parameters`` (tensors) and ``largest``
    (the largest parameter's shard elements)."""

    name: str
    elements: int
    shard: int
    parameters: int
    largest: int = 0


@functools.lru_cache(maxsize=256)
def stream_units(
    model: ModelShape, tp: int, ranks: int
) -> tuple[tuple[StreamUnit, ...], StreamUnit]:
    """``(units in forward order, root)`` of ``model`` at ``tp`` sharded over ``ranks``
    (PP1): the embedding and each layer, and the root's final norm and output layer
    (cached: a search plans many layouts of one shape). ValueError for tied embeddings (the
    output layer would use the embedding unit's weight after its reshard: not modelled)."""
    if not model.untie_embeddings_and_output_weights:
        raise ValueError(
            f"--use-torch-fsdp2 --fsdp2-offload-to-cpu: {model.name} ties its embeddings and output layer, "
            "which the streaming plan does not model"
        )
    grouped: dict[str, list[tuple[int, ...]]] = {}
    for shape in stage_parameter_shapes(model, tp):
        grouped.setdefault(shape.unit or "root", []).append(shape.shape)

    def unit(name: str) -> StreamUnit:
        shapes = grouped[name]
        elements = sum(math.prod(s) for s in shapes)
        shards = [-(-s[0] // ranks) * math.prod(s[1:]) for s in shapes]
        return StreamUnit(name, elements, sum(shards), len(shapes), max(shards))

    units = tuple(unit(name) for name in grouped if name != "root")
    return units, unit("root")


class StreamMoment(NamedTuple):
    """FSDP2's device bytes of one rank at one moment of the backward: ``unit`` (the unit
    computing or reducing), ``moment`` (what happens) and the bytes by category."""

    unit: str
    moment: str
    weights: int
    gradients: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients


def stream_backward_moments(
    model: ModelShape, layout: Layout, param_bytes: int = BF16_BYTES
) -> list[StreamMoment]:
    """The backward's moments of one rank under weight streaming (the module docstring),
    the units from the last: for each, its copy-out (``wait``), the prefetch of the unit
    before it (``gather``: its casts with one fp32 copy, then with the flat output), the end
    of its backward (``computed``), its reduce-scatter's copy-in (``copy-in``) and its
    output (``reduced``). ``param_bytes``: ``MixedPrecisionPolicy.param_dtype``'s bytes."""
    units, root = stream_units(model, layout.tp, layout.sharding_ranks)
    d, p, r = layout.sharding_ranks, param_bytes, FP32_BYTES
    copy = FP32_BYTES if p != FP32_BYTES else 0  # the fp32 copy beside its cast
    root_weights, root_gradients = p * d * root.shard, p * root.elements
    moments = []
    previous = 0  # the previous unit's reduce-scatter input, kept until this unit's
    for index in range(len(units) - 1, -1, -1):
        unit = units[index]
        before = units[index - 1] if index else None  # prefetched in this unit's backward
        gathered = p * d * unit.shard
        flat = p * d * before.shard if before else 0

        def at(moment, weights, gradients, name=unit.name):
            moments.append(
                StreamMoment(name, moment, root_weights + weights, root_gradients + gradients)
            )

        at("wait", 2 * gathered, previous)
        if before:
            casts = p * before.shard
            at("gather", gathered + casts + copy * before.largest, previous)
            at("gather", gathered + casts + flat, previous)
        at("computed", gathered + flat, p * unit.elements + previous)
        at("copy-in", flat, p * unit.elements + r * d * unit.shard)
        at("reduced", flat, r * d * unit.shard + r * unit.shard)
        previous = r * d * unit.shard
    return moments


def stream_device_bytes(
    model: ModelShape, layout: Layout, param_bytes: int = BF16_BYTES
) -> dict[str, int]:
    """``weights``, ``gradients``, ``optimizer_state`` of one rank (bytes) under weight
    streaming: the largest of :func:`stream_backward_moments` (the module docstring's
    contract); ``param_bytes`` as there (the planner's runs are bf16)."""
    worst = max(stream_backward_moments(model, layout, param_bytes), key=lambda m: m.total)
    return {"weights": worst.weights, "gradients": worst.gradients, "optimizer_state": 0}


def stream_shard_elements(model: ModelShape, layout: Layout) -> int:
    """One rank's padded shard elements of every unit and the root: what its host Adam steps."""
    units, root = stream_units(model, layout.tp, layout.sharding_ranks)
    return sum(u.shard for u in units) + root.shard


def stream_host_bytes(model: ModelShape, layout: Layout) -> dict[str, int]:
    """One rank's host bytes under weight streaming: ``host_optimizer_state`` (fp32 master,
    m, v: 12 B per shard element, and a 4-byte step per parameter) and
    ``host_gradient_copy`` (the fp32 gradient shard, 4 B per element)."""
    units, root = stream_units(model, layout.tp, layout.sharding_ranks)
    shard = stream_shard_elements(model, layout)
    parameters = sum(u.parameters for u in units) + root.parameters
    return {
        "host_optimizer_state": ADAM_STATE_BYTES * shard + STEP_COUNTER_BYTES * parameters,
        "host_gradient_copy": FP32_BYTES * shard,
    }


def stream_copy_seconds(
    model: ModelShape, layout: Layout, bandwidth: float, layer_forward: float, layer_backward: float
) -> tuple[float, float]:
    """``(copies, exposed)``: seconds of one micro-batch's host-device copies on a rank and
    the part of them not hidden behind compute, at ``bandwidth`` bytes/s per direction.
    Copies: each unit's fp32 shard up before its forward and its backward and its fp32
    gradient shard down, the root's too. Exposed: the first unit's copy of each pass, the
    last gradient's and the root's, and each layer's copy beyond the previous
    layer's compute (``layer_forward`` / ``layer_backward`` seconds; in the backward the
    copy up and the gradient down run at once, one direction each)."""
    units, root = stream_units(model, layout.tp, layout.sharding_ranks)
    seconds = [FP32_BYTES * u.shard / bandwidth for u in units]  # one shard, one direction
    root_s = FP32_BYTES * root.shard / bandwidth
    copies = 3 * (sum(seconds) + root_s)
    layers = seconds[1:]  # the embedding computes (almost) nothing: its copies are exposed
    exposed = 3 * (seconds[0] + root_s) + layers[0] + layers[-1]
    exposed += sum(max(0.0, t - layer_forward) for t in layers[1:])
    exposed += sum(max(0.0, t - layer_backward) for t in layers[:-1])
    return copies, exposed


def stream_accumulation_seconds(
    model: ModelShape, layout: Layout, bandwidth: float, add_elements_per_s: float
) -> float:
    """Seconds one micro-batch after a step's first adds on a rank to :func:`stream_copy_seconds`'
    exposed part: each layer's fp32 gradient shard copied down blocking (the embedding's and the
    root's are exposed in every micro-batch already) at ``bandwidth`` bytes/s, and the host's
    add of the rank's whole shard at ``add_elements_per_s`` (this rank's share of the host)."""
    units, _ = stream_units(model, layout.tp, layout.sharding_ranks)
    copies = sum(FP32_BYTES * u.shard for u in units[1:]) / bandwidth
    return copies + stream_shard_elements(model, layout) / add_elements_per_s
