"""Megatron-FSDP (ZeRO-3) as the trainer configures it: parameter groups, padding, bytes.

A pure-Python mirror of megatron-core's ``megatron_fsdp/param_and_grad_buffer.py``
(0.16.1 and 0.19.x hold the same code; tests/planning/test_fsdp.py checks the mirror
against megatron's own functions): :func:`parameter_groups` (``_get_parameter_groups``)
and :func:`buffer_offsets` (``build_data_parallel_buffer_index``) make a device's
:class:`Bucket` s, their parameters' offsets and padding (:meth:`Bucket.size`);
:func:`backward_moments` replays megatron's backward bucket by bucket; :func:`fsdp_bytes`
gives the bytes of one device per strategy (:data:`FSDP_STRATEGIES`) and
:func:`prefetched_after_step` what a step leaves gathered. Sizes are elements (a bucket's)
or bytes (the results); ``D`` (``ranks``) is the sharding group, data x context parallel
ranks; megatron releases are ``(major, minor)``. The bytes per strategy and how they were
measured: docs/planner.md ("Megatron-FSDP (ZeRO-3)").
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from .models import ModelShape
from .parameters import ParameterShape, stage_parameter_shapes

__all__ = [
    "FSDP_STRATEGIES",
    "PLANNED_STRATEGIES",
    "Bucket",
    "buffer_offsets",
    "parameter_groups",
    "stage_groups",
    "BackwardMoment",
    "backward_moments",
    "gathered_parameter_bytes",
    "fsdp_bytes",
    "prefetched_after_step",
    "FSDP_CATEGORIES",
    "NEWEST_MEGATRON",
    "NON_UNITS_PRESERVED_SINCE",
    "REDUCE_SCATTER_IN_PLACE_SINCE",
    "gradient_transient_bytes",
]

FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# what the trainer runs on megatron-core 0.16.1 (it refuses no_shard and optim, and FSDP at
# dp x cp = 1: upstream bugs) and so what the search proposes
PLANNED_STRATEGIES = ("optim_grads_params", "optim_grads")
# per-device categories of an FSDP plan beyond weights / gradients / optimizer_state
FSDP_CATEGORIES = ("fsdp_gathered_parameters", "fsdp_gradient_buckets")
# the first megatron-core release whose Megatron-FSDP keeps the non-unit groups gathered
# between steps (``AllGatherPipeline.reset(preserve_non_fsdp_units=True)``: in 0.18.0, not in
# 0.17.1), and the newest release the planner models (the default where none is given)
NON_UNITS_PRESERVED_SINCE = (0, 18)
NEWEST_MEGATRON = (0, 19)
# the first megatron-core release whose Megatron-FSDP reduce-scatters a gradient bucket into
# its own shard (0.16 allocates a new shard, ``torch.empty_like(grad_shard)``)
REDUCE_SCATTER_IN_PLACE_SINCE = (0, 17)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def buffer_offsets(shapes: Sequence[Sequence[int]], chunk_size_factor: int) -> tuple[list, int]:
    """``(offsets, end)``: the start element of each of ``shapes`` (in their order) in a
    bucket and the bucket's unpadded length, as megatron's ``build_data_parallel_buffer_index``
    places them: items of at least ``chunk_size_factor`` elements in order, each starting a
    chunk; a remainder shares its last chunk with the next item whose remainder fits; smaller
    items (fragments, in their order: megatron's sort of them is discarded) fill the gaps or
    go at the end."""
    factor = chunk_size_factor
    fragments = [(i, _numel(s)) for i, s in enumerate(shapes) if _numel(s) < factor]
    regular = [(i, _numel(s)) for i, s in enumerate(shapes) if _numel(s) >= factor]
    offsets: dict[int, int] = {}
    index = 0
    while regular:
        item, size = regular.pop(0)
        offsets[item] = index
        if size % factor == 0:
            index += size
            continue
        gap = index + size
        index += (size // factor + 1) * factor
        remain = size % factor
        space = factor - remain
        partner = next(
            (r for r in regular if r[1] % factor and remain + r[1] % factor <= factor), None
        )
        if partner is not None:
            regular.remove(partner)
            offsets[partner[0]] = index - partner[1] % factor
            space -= partner[1] % factor
            index += partner[1] // factor * factor
        for fragment in fragments[:]:
            if fragment[1] > space:
                continue
            offsets[fragment[0]] = gap
            space -= fragment[1]
            gap += fragment[1]
            fragments.remove(fragment)
    for item, size in fragments:
        offsets[item] = index
        index += size
    return [offsets[i] for i in range(len(shapes))], index


def _chunk_size_factor(shapes: list[tuple[int, ...]]) -> int:
    """Megatron's ``chunk_size_factor`` of a bucket whose ``shapes`` are sorted by
    ``shape[1:]`` elements, largest first: the lcm of those counts that do not divide it."""
    factor = _numel(shapes[0][1:])
    for shape in shapes:
        row, size = _numel(shape[1:]), _numel(shape)
        if not (row == factor or (factor % row == 0 and size % factor == 0) or size < factor):
            factor = math.lcm(factor, row)
    return factor


@dataclass(frozen=True)
class Bucket:
    """One Megatron-FSDP parameter group (it is also one communication bucket).

    ``unit``: the FSDP unit module's name, or None (gathered and reduced as a non-unit
    group); ``names`` / ``shapes``: its parameters in buffer order; ``offsets``: where each
    starts (elements); ``end``: the unpadded length; ``chunk_size_factor`` as megatron's.
    The bucket is padded to a multiple of ``D * chunk_size_factor`` (``D`` = the sharding
    group, data x context parallel ranks) for every strategy but ``no_shard``, and rank
    ``r`` holds elements ``[r * size/D, (r+1) * size/D)`` of it."""

    unit: Optional[str]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    end: int
    chunk_size_factor: int

    @property
    def elements(self) -> int:
        """Real (unpadded) parameter elements."""
        return sum(_numel(s) for s in self.shapes)

    def size(self, ranks: int, strategy: str = "optim_grads_params") -> int:
        """The bucket's elements as megatron allocates it unsharded: ``end`` padded to a
        multiple of ``ranks * chunk_size_factor`` (not padded under ``no_shard``)."""
        if strategy == "no_shard":
            return self.end
        unit = ranks * self.chunk_size_factor
        return -(-self.end // unit) * unit

    def local_elements(self, ranks: int, rank: int, strategy: str = "optim_grads_params") -> int:
        """Real elements of the shard rank ``rank`` of ``ranks`` holds (its optimizer state)."""
        shard = self.size(ranks, strategy) // ranks
        low, high = rank * shard, (rank + 1) * shard
        return sum(
            max(0, min(start + _numel(shape), high) - max(start, low))
            for start, shape in zip(self.offsets, self.shapes)
        )


def _make_bucket(unit: Optional[str], params: list[ParameterShape]) -> Bucket:
    ordered = sorted(params, key=lambda p: _numel(p.shape[1:]), reverse=True)  # stable, as torch's
    shapes = [tuple(p.shape) for p in ordered]
    factor = _chunk_size_factor(shapes)
    offsets, end = buffer_offsets(shapes, factor)
    return Bucket(unit, tuple(p.name for p in ordered), tuple(shapes), tuple(offsets), end, factor)


def parameter_groups(
    params: Sequence[ParameterShape],
    strategy: str = "optim_grads_params",
    bucket_size: Optional[int] = None,
) -> list[Bucket]:
    """Megatron-FSDP's parameter groups of one device's ``params`` (``named_parameters``
    order, all of one dtype and trainable), in megatron's order. ``bucket_size`` (elements;
    the DDP config's ``bucket_size``, None as the trainer leaves it) splits non-unit groups.

    Mirrors megatron's ``_get_parameter_groups``: one group per FSDP unit module (the
    trainer's units: the embedding and each transformer layer) and one per non-unit
    (dtype, requires_grad) set (the final norm and the output layer); a ``shared_embedding``
    parameter (tied embeddings split over pipeline stages) gets its own bucket; a non-unit
    group is split once it reaches ``bucket_size`` elements; each group's
    ``chunk_size_factor`` is the lcm of its parameters' ``shape[1:]`` element counts (after
    megatron's sort by that count)."""
    groups: dict[Optional[str], list[ParameterShape]] = {}
    for param in params:
        groups.setdefault(param.unit, []).append(param)
    buckets: list[Bucket] = []
    for unit, members in groups.items():
        current: list[ParameterShape] = []
        for param in members:
            if param.shared_embedding and strategy != "no_shard":
                if current:
                    buckets.append(_make_bucket(unit, current))
                buckets.append(_make_bucket(unit, [param]))
                current = []
                continue
            current.append(param)
            if (
                unit is None
                and bucket_size
                and sum(_numel(p.shape) for p in current) >= bucket_size
            ):
                buckets.append(_make_bucket(unit, current))
                current = []
        if current:
            buckets.append(_make_bucket(unit, current))
    return buckets


@functools.lru_cache(maxsize=512)
def stage_groups(
    model: ModelShape, tp: int, pp: int, stage: int, strategy: str
) -> tuple[Bucket, ...]:
    """:func:`parameter_groups` of pipeline stage ``stage``'s device (cached: the search asks
    for the same stage many times)."""
    return tuple(parameter_groups(stage_parameter_shapes(model, tp, pp, stage), strategy))


@dataclass(frozen=True)
class BackwardMoment:
    """What Megatron-FSDP holds unsharded while one bucket's modules run their backward
    (elements; one entry of :func:`backward_moments`).

    ``unit``: the bucket's FSDP unit (None: a non-unit group); ``gathered``: parameters
    all-gathered (this bucket, the ones prefetched after it in backward order, every non-unit
    group; 0 unless the weights are sharded); ``queued``: earlier gradient buckets still
    queued for their reduce-scatter; ``size``: this bucket's unsharded gradient bucket
    (allocated by its first gradient); ``largest``: its largest parameter (the gradient
    copied into the bucket in the parameter dtype); ``kept``: the queued buckets left after
    the wait at this bucket's last gradient; ``shard``: ``size / ranks`` (megatron-core 0.16's
    reduce-scatter output)."""

    unit: Optional[str]
    gathered: int
    queued: int
    size: int
    largest: int
    kept: int
    shard: int

    def held_bytes(self, param_bytes: int = 2, grad_bytes: int = 4) -> int:
        """Bytes held from the bucket's first gradient to its last (a layer's attention
        backward lies there: its MLP and output-projection gradients come first)."""
        return self.gathered * param_bytes + (self.queued + self.size) * grad_bytes

    def gradient_bytes(
        self,
        param_bytes: int = 2,
        grad_bytes: int = 4,
        megatron_release: tuple[int, int] = NEWEST_MEGATRON,
    ) -> int:
        """The most gradient-transient bytes in this moment: the buckets and the
        parameter-dtype gradient being copied, or (up to 0.16) the buckets left after the
        wait, this one and its new reduce-scatter shard."""
        copying = (self.queued + self.size) * grad_bytes + self.largest * param_bytes
        if tuple(megatron_release) < REDUCE_SCATTER_IN_PLACE_SINCE:
            return max(copying, (self.kept + self.size + self.shard) * grad_bytes)
        return copying


def _gathered_with_prefetch(sizes: Sequence[int], current: int, limit: int) -> set[int]:
    """Indices of the buckets one all-gather leaves gathered: ``current`` and the ones after it
    in ``sizes``' order (the pass's order, forward or backward), added while the prefetched
    ones hold fewer than ``limit`` elements (megatron's ``suggested_AG_prefetch_size``: the
    prefetch loop of ``AllGatherPipeline.all_gather_params``, 0.16.1
    ``param_and_grad_buffer.py:3534-3559``)."""
    gathered = {current}
    prefetched = 0
    for later in range(current + 1, len(sizes)):
        if prefetched >= limit:
            break
        gathered.add(later)
        prefetched += sizes[later]
    return gathered


def backward_moments(
    buckets: Sequence[Bucket], strategy: str, ranks: int, unit_size: int
) -> list[BackwardMoment]:
    """Megatron-FSDP's transient buffers through a backward, one :class:`BackwardMoment` per
    bucket in backward order (the reverse of megatron's: the non-unit group, the layers from
    the last, the embedding), by megatron's own schedule (the same in 0.16.1 and 0.19.2 unless
    said). ``unit_size``: the trainer's communication unit, 2 x one layer's elements on this
    rank (``suggested_communication_unit_size``).

    Parameters (``optim_grads_params``): a module's backward pre-hook all-gathers its bucket
    and prefetches the next buckets in backward order until they reach ``unit_size // 2``
    elements (``suggested_AG_prefetch_size``, 0.16.1 ``megatron_fsdp.py:399``, 0.19.2
    ``:444``; the prefetch loop of ``AllGatherPipeline.all_gather_params``, 0.16.1
    ``param_and_grad_buffer.py:3534-3559``); a unit is released after its backward; the
    non-unit groups, gathered by their forward, stay until ``finish_grad_sync`` (see
    :func:`prefetched_after_step`).

    Gradients (sharded gradients):

    * Each parameter has a post-accumulate-grad hook (0.16.1 ``megatron_fsdp.py:1007-1012``,
      0.19.2 ``:1110-1117``) whose ``_grad_acc`` fetches the parameter's unsharded bucket
      (``get_main_grad`` -> ``fetch_bucket`` -> ``TemporaryBucketAllocator.allocate``, 0.16.1
      ``param_and_grad_buffer.py:2400-2414``, ``:509-522``), copies the gradient into it and
      deletes ``param.grad`` (0.16.1 ``megatron_fsdp.py:568-573``, 0.19.2 ``:652-659``). So a
      bucket is allocated by the first gradient of its parameters, and one parameter's
      gradient in the parameter dtype is alive beside the buckets: the largest of the bucket
      (megatron's and the emulation's layers give one parameter's gradient per autograd node;
      a layer that returned several at once would hold them together: not modelled).
    * When a bucket's last gradient has arrived, ``reduce_gradients`` calls
      ``wait_for_previous_grad_reduce(suggested_queue_capacity=...)`` (0.16.1
      ``param_and_grad_buffer.py:3081-3090``, 0.19.2 ``:3905-3914``; the capacity is
      ``suggested_RS_queue_capacity`` = ``unit_size``, ``megatron_fsdp.py`` 0.16.1 ``:398``,
      0.19.2 ``:443``), which frees queued buckets, oldest first, while the queued ones (not
      counting this one) hold more than the capacity (0.16.1 ``:3103-3116``, 0.19.2
      ``:3927-3940``); then this bucket is reduce-scattered and queued (0.16.1
      ``:3331-3335``, 0.19.2 ``:4246``).
    * Up to megatron-core 0.16 the reduce-scatter writes into a new shard,
      ``torch.empty_like(grad_shard)`` (0.16.1 ``:3241-3242``; removed in 0.17.0 by
      "Add dtype customization to Megatron-FSDP", b969f7642c: 0.17.0 on reduce into the
      bucket itself), alive from after the wait until the bucket's reduce returns.
    * ``_root_post_backward`` resets the pipeline (0.16.1 ``megatron_fsdp.py:791``, 0.19.2
      ``:880``): every backward (micro-batch) starts with no bucket.

    Each bucket completes before the next one's first gradient; a ``shared_embedding``
    bucket, whose gradient megatron's root post-backward hook handles, is not modelled apart.
    Under ``optim_grads`` nothing is gathered (``gathered`` 0); ``optim`` and ``no_shard``
    keep whole gradient buffers and have no such moments (an empty list), nor has ``ranks``
    = 1 (megatron shards no buffer of a group of one)."""
    if ranks == 1 or strategy not in ("optim_grads", "optim_grads_params"):
        return []
    order = list(reversed(buckets))
    sizes = [bucket.size(ranks, strategy) for bucket in order]
    non_units = {i for i, bucket in enumerate(order) if bucket.unit is None}
    moments = []
    queue: list[int] = []
    for index, bucket in enumerate(order):
        gathered = 0
        if strategy == "optim_grads_params":
            members = _gathered_with_prefetch(sizes, index, unit_size // 2) | non_units
            gathered = sum(sizes[i] for i in members)
        queued = sum(queue)
        while sum(queue) > unit_size:
            queue.pop(0)
        moments.append(
            BackwardMoment(
                unit=bucket.unit,
                gathered=gathered,
                queued=queued,
                size=sizes[index],
                largest=max(_numel(shape) for shape in bucket.shapes),
                kept=sum(queue),
                shard=sizes[index] // ranks,
            )
        )
        queue.append(sizes[index])
    return moments


def gradient_transient_bytes(
    buckets: Sequence[Bucket],
    strategy: str,
    ranks: int,
    unit_size: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 4,
    megatron_release: tuple[int, int] = NEWEST_MEGATRON,
) -> int:
    """The most bytes of Megatron-FSDP's gradient transients alive at once in a backward
    (:func:`backward_moments`; ``grad_bytes`` an element of the buckets, ``param_bytes`` of
    the gradient being copied), whatever the gathered parameters do meanwhile."""
    moments = backward_moments(buckets, strategy, ranks, unit_size)
    return max(
        (m.gradient_bytes(param_bytes, grad_bytes, megatron_release) for m in moments), default=0
    )


def gathered_parameter_bytes(
    buckets: Sequence[Bucket], strategy: str, ranks: int, unit_size: int, param_bytes: int = 2
) -> int:
    """The most bytes of gathered (unsharded) parameters alive at once in a step: the largest
    over :func:`backward_moments` (a forward gathers the same units in the other order, the
    non-unit groups at most as many)."""
    moments = backward_moments(buckets, strategy, ranks, unit_size)
    return max((m.gathered for m in moments), default=0) * param_bytes


@functools.lru_cache(maxsize=512)
def _largest_shard(buckets: tuple[Bucket, ...], ranks: int, strategy: str) -> int:
    """The most real elements any of the ``ranks`` ranks holds of ``buckets``' shards."""
    return max(
        sum(b.local_elements(ranks, rank, strategy) for b in buckets) for rank in range(ranks)
    )


def fsdp_bytes(
    buckets: Sequence[Bucket],
    strategy: str,
    ranks: int,
    layer_elements: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 4,
    main_bytes: int = 4,
    adam_bytes: int = 8,
    megatron_release: tuple[int, int] = NEWEST_MEGATRON,
) -> dict[str, int]:
    """Bytes of one device under Megatron-FSDP ``strategy`` over ``ranks`` (dp x cp) ranks.

    ``layer_elements``: one transformer layer's parameters on this rank (the trainer's
    communication unit is twice that). Keys: ``weights`` (the model-weight buffer, or the
    module's parameters under ``no_shard``), ``gradients`` (main grads, ``grad_bytes`` each:
    4 for fp32, 2 for bf16 with ``--grad-reduce-in-bf16``, megatron's
    ``megatron_fsdp_main_grads_dtype``; the bf16 figure is modelled, not measured),
    ``optimizer_state`` (fp32 main params + Adam m, v on this rank's largest shard),
    ``fsdp_gathered_parameters`` and ``fsdp_gradient_buckets``: what megatron holds unsharded
    at the backward's worst moment for the two together (:func:`backward_moments`, the
    largest over the buckets of the gathered units and non-unit groups, ``param_bytes`` an
    element, plus the gradient buckets, ``grad_bytes`` an element, with the parameter-dtype
    gradient being copied into one, gradient-accumulation fusion being off;
    ``megatron_release`` picks 0.16's reduce-scatter into a new shard), split into its
    gathered parameters and the rest. The two kinds peak apart (the tests' tiny model at DP2: the
    gathered units in the last layer's backward, the gradient buckets at the embedding's),
    so each may be less here than its own largest (:func:`gathered_parameter_bytes`,
    :func:`gradient_transient_bytes`). All three are measured exactly on the emulated NPU.
    A buffer is sharded only when ``ranks > 1`` (megatron: ``is_data_distributed=... and
    group.size() > 1``). The byte table per strategy: docs/planner.md.
    """
    if strategy not in FSDP_STRATEGIES:
        raise ValueError(f"sharding strategy {strategy!r}: choose one of {FSDP_STRATEGIES}")
    distributed = ranks > 1
    shard_weights = distributed and strategy == "optim_grads_params"
    shard_grads = distributed and strategy in ("optim_grads", "optim_grads_params")
    shard_main = distributed and strategy != "no_shard"

    def held(bucket: Bucket, sharded: bool) -> int:
        size = bucket.size(ranks, strategy)
        return size // ranks if sharded else size

    weights = (
        sum(b.elements for b in buckets)
        if strategy == "no_shard"
        else sum(held(b, shard_weights) for b in buckets)
    )
    local = (
        _largest_shard(tuple(buckets), ranks, strategy)
        if shard_main
        else sum(b.elements for b in buckets)
    )
    out = {
        "weights": weights * param_bytes,
        "gradients": sum(held(b, shard_grads) for b in buckets) * grad_bytes,
        "optimizer_state": sum(held(b, shard_main) for b in buckets) * main_bytes
        + local * adam_bytes,
        "fsdp_gathered_parameters": 0,
        "fsdp_gradient_buckets": 0,
    }
    moments = backward_moments(buckets, strategy, ranks, 2 * layer_elements)
    if moments:
        worst = max(
            moments,
            key=lambda m: (
                m.gathered * param_bytes
                + m.gradient_bytes(param_bytes, grad_bytes, megatron_release)
            ),
        )
        out["fsdp_gathered_parameters"] = worst.gathered * param_bytes
        out["fsdp_gradient_buckets"] = worst.gradient_bytes(
            param_bytes, grad_bytes, megatron_release
        )
    return out


def prefetched_after_step(
    buckets: Sequence[Bucket],
    strategy: str,
    ranks: int,
    layer_elements: int,
    *,
    param_bytes: int = 2,
    megatron_release: tuple[int, int] = NEWEST_MEGATRON,
) -> int:
    """Bytes of unsharded weights alive between steps: what megatron all-gathers for the next
    forward as soon as the optimizer has stepped, and (from megatron-core 0.18 on) the
    non-unit groups, which stay gathered from the first forward on.

    Under ``optim_grads_params`` megatron forces ``overlap_param_gather`` on
    (``megatron_fsdp.py``, "Default to overlapped parameter gather when fully-sharding"), so
    the distributed optimizer's ``step_with_ready_grads`` calls ``start_param_sync``, which
    all-gathers the bucket of the module's first parameter (bucket 0) with prefetch: the
    all-gather pipeline adds the next buckets in forward order while the prefetched ones sum
    to less than ``suggested_AG_prefetch_size`` = the trainer's unit size // 2 = one layer
    (``AllGatherPipeline.all_gather_params``). These buckets stay allocated until the next
    forward uses and frees them, so a device holds them at rest, after every step (not after
    setup).

    The non-unit groups (final norm, output layer) are gathered by their modules' forward
    and backward pre-hooks and never released by a hook (``_post_forward`` and
    ``_post_backward_release_module`` run on FSDP units only); what frees them is
    ``finish_grad_sync`` -> ``synchronize_param_gather`` -> ``AllGatherPipeline.reset``
    before the optimizer step (0.16.1 ``megatron_fsdp.py:1206``, 0.19.2 ``:1366``). Up to
    0.17 ``reset()`` marks every bucket releasable and recycles it (0.16.1
    ``megatron_fsdp.py:1160``, ``param_and_grad_buffer.py:3418-3434``); from 0.18.0 on
    ``synchronize_param_gather`` calls ``reset(preserve_non_fsdp_units=True)`` (0.19.2
    ``megatron_fsdp.py:1320``), which marks non-unit buckets ``PRESERVED`` and keeps their
    storage (0.19.2 ``param_and_grad_buffer.py:4331-4363``: "their params may be read across
    module boundaries"); the next all-gather refills it in place. So from
    ``megatron_release`` (major, minor) ``NON_UNITS_PRESERVED_SINCE`` = (0, 18) on every
    non-unit bucket is also held at rest (once, where the prefetch reaches it too). The
    default is the newest supported release, ``NEWEST_MEGATRON`` = (0, 19), for callers that
    do not know the installed one (the planner does not import megatron); the tests pass the
    installed release (``importlib.metadata``).

    Other strategies keep the whole weights, and ``ranks = 1`` shards nothing: 0."""
    if strategy != "optim_grads_params" or ranks == 1:
        return 0
    sizes = [bucket.size(ranks, strategy) for bucket in buckets]
    gathered = _gathered_with_prefetch(sizes, 0, layer_elements)
    if tuple(megatron_release) >= NON_UNITS_PRESERVED_SINCE:
        gathered |= {index for index, bucket in enumerate(buckets) if bucket.unit is None}
    return sum(sizes[index] for index in gathered) * param_bytes
