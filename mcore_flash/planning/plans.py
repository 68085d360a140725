"""A memory plan's types: a stage's bytes (:class:`StagePlan`), a node's host bytes
(:class:`HostPlan`), the whole plan (:class:`MemoryPlan`) and its launch command.

:func:`.memory.plan_memory` makes them; the byte categories are :data:`CATEGORIES` (their
meaning: docs/planner.md, "Per device"), with FSDP :data:`.fsdp.FSDP_CATEGORIES`, with activation offload
:data:`OFFLOAD_CATEGORIES` and on the host :data:`HOST_CATEGORIES` (:mod:`.host_offload`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from . import activation_bytes as act
from .ddp_state import main_gradient_bytes
from .fsdp import FSDP_CATEGORIES
from .models import ModelShape
from .parallel_layout import (
    Layout,
    fsdp_flags,
    gradient_flags,
    offload_flags,
    pretrain_command,
    recompute_flags,
    streaming_flags,
    tiling_flags,
)

__all__ = [
    "MemoryPlan",
    "StagePlan",
    "HostPlan",
    "launch_command",
    "CATEGORIES",
    "ESTIMATED_CATEGORIES",
    "HOST_CATEGORIES",
    "OFFLOAD_CATEGORIES",
]

CATEGORIES = (
    "weights",
    "gradients",
    "optimizer_state",
    "activations",
    "attention_statistics",
    "embeddings_and_loss",
    "logits_buffers",
    "recompute_workspace",
    "communication_buffers",
    "runtime_reserve",
    "collective_library_buffers",
    "allocator_fragmentation",
)
ESTIMATED_CATEGORIES = (
    "logits_buffers",
    "recompute_workspace",
    "communication_buffers",
    "runtime_reserve",
    "allocator_fragmentation",
)
# the device's extra category under activation offload (absent without it)
OFFLOAD_CATEGORIES = ("activation_offload_buffers",)
# a rank's host bytes by category
HOST_CATEGORIES = (
    "host_optimizer_state",
    "host_gradient_copy",
    "host_activations",
    "host_runtime",
)


@dataclass
class StagePlan:
    """One pipeline stage's device: its ``parameters`` (one TP rank), its ``layers``, the
    model chunks x micro-batches ``in_flight`` at its peak and ``bytes`` by category
    (:data:`CATEGORIES`; with the exact DDP state its worst data-parallel rank's). Host:
    ``host_bytes`` (:data:`HOST_CATEGORIES` but ``host_runtime``) of its fullest rank and,
    where ranks differ, ``rank_host_bytes``: the offloaded optimizer's host bytes of each rank
    of the data x context parallel group (a node sums its own ranks')."""

    stage: int
    parameters: int
    layers: int
    in_flight: int
    bytes: dict[str, int]
    host_bytes: dict[str, int] = field(default_factory=dict)  # one rank's, HOST_CATEGORIES
    # per data x context parallel rank, where they differ (exact DDP state): each rank's host
    # optimizer bytes (host_optimizer_state, host_gradient_copy)
    rank_host_bytes: tuple[dict[str, int], ...] = ()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass
class HostPlan:
    """The host side of a plan, per node (bytes): ``per_node`` the fullest node's sum over
    its ranks plus ``reserved`` (the OS ...), ``by_category`` that node's ranks' bytes by
    :data:`HOST_CATEGORIES`, against ``host_memory`` (None: no verdict)."""

    per_node: int
    by_category: dict[str, int]
    reserved: int
    ranks_per_node: int
    host_memory: Optional[int]

    @property
    def fits(self) -> Optional[bool]:
        return None if self.host_memory is None else self.per_node <= self.host_memory

    @property
    def headroom(self) -> Optional[int]:
        return None if self.host_memory is None else self.host_memory - self.per_node

    def to_dict(self) -> dict:
        return {
            "host_bytes_per_node": self.per_node,
            "host_bytes_per_node_by_category": {**self.by_category, "host_reserved": self.reserved},
            "ranks_per_node": self.ranks_per_node,
            "host_memory_bytes": self.host_memory,
            "host_fits": self.fits,
        }


@dataclass
class MemoryPlan:
    """The result of :func:`.memory.plan_memory`; ``per_device`` is the worst stage's breakdown (bytes).

    Text forms are :func:`mcore_flash.planning.report.format_plan` (and its helpers);
    :meth:`to_dict` is the JSON form.
    """

    model: ModelShape
    seq_length: int
    layout: Layout
    profile: str
    dtype_bytes: int
    total_parameters: int
    stages: list[StagePlan]
    layer_terms: list  # activation_bytes.Term, one layer, one micro-batch, this layout
    device_memory: Optional[int]
    recompute_overhead: float
    pipeline_bubble: float
    mean_document_length: Optional[float] = (
        None  # tokens per packed document; None = one per sequence
    )
    notes: list[str] = field(default_factory=list)
    host: Optional[HostPlan] = None  # None: the hardware profile gives no host figures
    # bytes of device_memory a fitting plan leaves free (--min-free-memory)
    min_free_memory: int = 0
    devices_per_node: int = 8  # the hardware's: the launch line's --nproc-per-node

    @property
    def worst_stage(self) -> StagePlan:
        return max(self.stages, key=lambda stage: stage.total)

    @property
    def categories(self) -> tuple[str, ...]:
        """The byte categories of this plan: :data:`CATEGORIES`, and with FSDP
        :data:`.fsdp.FSDP_CATEGORIES` after them."""
        return (
            CATEGORIES
            + (FSDP_CATEGORIES if self.layout.fsdp else ())
            + (OFFLOAD_CATEGORIES if self.layout.activation_offload_layers else ())
        )

    @property
    def per_device(self) -> dict[str, int]:
        return dict(self.worst_stage.bytes)

    @property
    def total(self) -> int:
        return self.worst_stage.total

    @property
    def device_fits(self) -> Optional[bool]:
        """The worst stage leaves at least ``min_free_memory`` of ``device_memory`` free
        (None without a device memory)."""
        if self.device_memory is None:
            return None
        return self.total + self.min_free_memory <= self.device_memory

    @property
    def fits(self) -> Optional[bool]:
        """The device memory holds the worst stage and the host memory the fullest node
        (None without a device memory)."""
        if self.device_fits is None:
            return None
        return self.device_fits and (self.host is None or self.host.fits is not False)

    @property
    def headroom(self) -> Optional[int]:
        """Device bytes the worst stage leaves free (negative: over)."""
        return None if self.device_memory is None else self.device_memory - self.total

    @property
    def layer_bytes(self) -> int:
        """Saved bytes of one layer for one micro-batch (statistics included)."""
        return int(math.ceil(act.sum_terms(self.layer_terms)))

    @property
    def relative_step_time(self) -> float:
        return (1 + self.recompute_overhead) * (1 + self.pipeline_bubble)

    def to_dict(self) -> dict:
        layer_by_module = {k: int(math.ceil(v)) for k, v in act.by_module(self.layer_terms).items()}
        return {
            "model": self.model.name,
            "model_shape": self.model.to_dict(),
            "seq_length": self.seq_length,
            "mean_document_length": self.mean_document_length,
            "layout": self.layout.to_dict(),
            "profile": self.profile,
            "activation_dtype_bytes": self.dtype_bytes,
            "total_parameters": self.total_parameters,
            "parameters_per_device": self.worst_stage.parameters,
            "per_device_bytes": self.per_device,
            "estimated_categories": list(ESTIMATED_CATEGORIES),
            "total_bytes_per_device": self.total,
            "device_memory_bytes": self.device_memory,
            "fits": self.fits,
            "headroom_bytes": self.headroom,
            "min_free_memory_bytes": self.min_free_memory,
            "worst_stage": self.worst_stage.stage,
            "stages": [
                {
                    "stage": st.stage,
                    "parameters": st.parameters,
                    "layers": st.layers,
                    "in_flight": st.in_flight,
                    "bytes": st.bytes,
                    "total_bytes": st.total,
                    "host_bytes_per_rank": st.host_bytes,
                }
                for st in self.stages
            ],
            "activation_bytes_per_layer": self.layer_bytes,
            "activation_bytes_per_layer_by_module": layer_by_module,
            "activation_terms_per_layer": [
                {
                    "module": t.module,
                    "name": t.name,
                    "bytes": int(math.ceil(t.bytes)),
                    "category": t.category,
                }
                for t in self.layer_terms
            ],
            "recompute_overhead": self.recompute_overhead,
            "pipeline_bubble": self.pipeline_bubble,
            "relative_step_time": self.relative_step_time,
            "recompute_flags": recompute_flags(self.layout),
            "fsdp_flags": fsdp_flags(self.layout),
            "offload_flags": offload_flags(self.layout),
            "gradient_flags": gradient_flags(self.layout),
            "tiling_flags": tiling_flags(self.layout),
            "streaming_flags": streaming_flags(self.layout),
            "main_gradient_bytes_per_element": main_gradient_bytes(self.layout),
            "device_fits": self.device_fits,
            "host": None if self.host is None else self.host.to_dict(),
            "launch_command": launch_command(self),
            "notes": self.notes,
        }


# what every launch line leaves to its user, as shell variables: (flag, value)
LAUNCH_PLACEHOLDERS = (
    ("--data-path", "$DATA_PATH"),
    ("--tokenizer-type", "HuggingFaceTokenizer"),
    ("--tokenizer-model", "$TOKENIZER_MODEL"),
    ("--train-iters", "$TRAIN_ITERS"),
    ("--lr", "$LR"),
)


def torchrun_prefix(world_size: int, devices_per_node: int) -> str:
    """``torchrun`` with the nodes and processes of ``world_size`` ranks, ``devices_per_node``
    to a node (``--standalone`` on one node; the rendezvous as ``$NODE_RANK``,
    ``$MASTER_ADDR``, ``$MASTER_PORT`` across nodes). ValueError when the ranks do not fill
    whole nodes alike."""
    nodes = -(-world_size // devices_per_node)
    if world_size % nodes:
        raise ValueError(
            f"{world_size} devices do not split evenly over {nodes} nodes of {devices_per_node}: give a "
            f"--num-devices that is a multiple of {devices_per_node}"
        )
    per_node = world_size // nodes
    if nodes == 1:
        return f"torchrun --standalone --nproc-per-node {per_node}"
    return (
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --node-rank $NODE_RANK "
        "--master-addr $MASTER_ADDR --master-port $MASTER_PORT"
    )


def launch_command(plan: MemoryPlan, distributed_timeout_minutes: Optional[int] = None) -> str:
    """The complete launch of ``plan``'s run: :func:`torchrun_prefix` for its world size, then
    ``-m mcore_flash.pretrain`` with its flags (Megatron-LM's names; the trainer's command
    ``mcore-flash pretrain`` takes the same), ``--distributed-timeout-minutes`` when given, and
    :data:`LAUNCH_PLACEHOLDERS`: the data, tokenizer, iterations and learning rate, which
    the user sets."""
    flags = pretrain_command(
        plan.model,
        plan.seq_length,
        plan.layout,
        dtype_bytes=plan.dtype_bytes,
        mean_document_length=plan.mean_document_length,
        distributed_timeout_minutes=distributed_timeout_minutes,
        program="-m mcore_flash.pretrain",
    )
    placeholders = " ".join(f"{flag} {value}" for flag, value in LAUNCH_PLACEHOLDERS)
    launcher = torchrun_prefix(plan.layout.num_devices, plan.devices_per_node)
    return f"{launcher} {flags} {placeholders}"
