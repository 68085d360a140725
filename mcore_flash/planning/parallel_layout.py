"""A parallel layout (TP x PP x CP x DP, interleaving, recompute, batch) and its launch flags.

Pure helpers of :class:`Layout` that the memory plan, the step-time model, the search and
the CLI share: which micro-batches a pipeline stage holds, which share of the layers each
recompute mode covers, and the ``mcore-flash pretrain`` flags (Megatron-LM's names) that
train the layout.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass
from typing import Optional

from .activation_bytes import RECOMPUTE_MODES
from .fsdp import FSDP_STRATEGIES
from .models import MODELS, ModelShape

__all__ = [
    "Layout",
    "RECOMPUTE_FLAGS",
    "HOST_MOMENT_BYTES",
    "DEFAULT_LOSS_CHUNK_SIZE",
    "recompute_flags",
    "recompute_text",
    "fsdp_flags",
    "offload_flags",
    "offload_text",
    "gradient_flags",
    "streaming_flags",
    "tiling_flags",
    "tiling_text",
    "pretrain_command",
    "shape_flags",
]

# what the user-facing recompute names mean in Megatron-LM flags
RECOMPUTE_FLAGS = {
    "none": [],
    "qkv": ["--recompute-granularity", "selective", "--recompute-modules", "qkv"],
    "attention": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
    "full": [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ],
    "core_attention": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
}
# bytes of one Adam moment per element, by the host state's dtype (--exp-avg-dtype's names)
HOST_MOMENT_BYTES = {"fp32": 4, "bf16": 2}
# the tile with --loss-compute-mode chunk and no --loss-chunk-size, the trainer's and the
# planner's (plan_flags.tiles; MindSpeed-LLM's default)
DEFAULT_LOSS_CHUNK_SIZE = 1024


@dataclass(frozen=True)
class Layout:
    """A parallel layout: TP x PP x CP x DP devices, and how each trains.

    ``vp`` is the number of interleaved (virtual) pipeline chunks per rank (1 = plain 1F1B).
    ``recompute_num_layers`` > 0 is partial recompute: the first that many layers of each
    pipeline chunk are recomputed whole (Megatron's ``block`` method), the others use
    ``recompute``. ``global_batch_size`` (sequences) fixes the number of micro-batches per step
    ``m = global_batch_size / (micro_batch_size * dp)``; None = enough to fill the pipeline.
    ``fsdp`` is Megatron-FSDP's ``--data-parallel-sharding-strategy`` (one of
    :data:`.fsdp.FSDP_STRATEGIES`; ``optim_grads_params`` is ZeRO-3) over the ``dp * cp``
    ranks, or None for megatron's DDP (with the distributed optimizer when
    ``distributed_optimizer``); FSDP implies the distributed optimizer.

    Host offload (the ladder's 5th rung, after sequence tiling; both need the distributed
    optimizer and refuse FSDP, as the trainer does): ``optimizer_offload_fraction`` in [0, 1]
    is the share of this rank's optimizer shard (by elements) whose fp32 master and Adam
    moments live and step on the host (megatron-core's ``HybridDeviceOptimizer``,
    ``--optimizer-cpu-offload``);
    ``activation_offload_layers`` is the first that many layers of each pipeline stage whose
    kept tensors wait for their backward in host memory (``--activation-offload-layers``).
    ``overlap_cpu_optimizer`` (``--overlap-cpu-optimizer-d2h-h2d``) overlaps the offloaded
    optimizer's copies with its host step. ``host_moment_dtype`` ``"bf16"`` stores both Adam
    moments of the host's state in bf16 (``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``, the
    trainer's own host step: 8 B per offloaded element with the fp32 master instead of 12); the
    trainer takes it with the whole optimizer offloaded only.

    ``grad_reduce_in_bf16`` (Megatron-LM's ``--grad-reduce-in-bf16``; needs the bf16
    parameters the planner assumes, ``--bf16``): bf16 main gradients, 2 B per element of the
    gradient buffer (Megatron-FSDP: of its main-gradient buffer) instead of 4; the
    distributed optimizer then gives the device part of its fp32 master shard fp32
    gradients (4 B per shard element kept on the device). The ladder's narrower-state
    choice: the rung is ``"offload"``.

    ``overlap_grad_reduce`` (Megatron-LM's ``--overlap-grad-reduce``, on unless asked off):
    megatron's DDP reduces the gradients in buckets as the last micro-batch's backward
    produces them, and the step time hides that reduction behind the backward; the buckets
    are part of the buffer layout (:attr:`ddp_bucket_size`). Megatron-FSDP overlaps its own
    way and ignores it (no flag is printed with FSDP).

    Sequence tiling (the ladder's rung before host offload; docs/planner.md, "Sequence
    tiling"): ``loss_chunk_size`` tokens per tile of the output layer and the vocab-parallel
    cross-entropy (``--loss-compute-mode chunk --loss-chunk-size N``; None: megatron's
    whole-sequence logits); ``mlp_chunk_size`` tokens per tile of every MLP, each tile
    recomputed in its backward (``--mlp-chunk-size N``; None: untiled; a tile of at least the
    CP rank's tokens runs untiled, as the trainer does). Each is a positive number of tokens,
    a multiple of ``tp`` under sequence parallelism. Both go with host offload: the MLP tiles
    are megatron's checkpoints, whose saved inputs activation offload parks with the layer's.

    Weight streaming (the ladder's top rung, ``"streaming"``; docs/planner.md, "Weight
    streaming"): ``stream_weights`` puts the model in torch FSDP2 ``fully_shard`` with
    ``CPUOffloadPolicy(pin_memory=True)`` over the ``dp * cp`` ranks (``--use-torch-fsdp2
    --fsdp2-offload-to-cpu``): the fp32 sharded parameters, their gradients and Adam's state
    live on the host and each unit (the embedding, every layer) is copied to the device for
    its forward and again for its backward (:mod:`.streaming`). As the trainer: PP1, no
    distributed optimizer, no Megatron-FSDP, no optimizer offload, fp32 gradient reduction
    and fp32 moments; it combines with TP/SP/CP, recompute, activation offload and the tiles.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    vp: int = 1
    sequence_parallel: bool = True
    recompute: str = "none"
    recompute_num_layers: int = 0
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    distributed_optimizer: bool = True
    fsdp: Optional[str] = None
    optimizer_offload_fraction: float = 0.0
    activation_offload_layers: int = 0
    overlap_cpu_optimizer: bool = False
    grad_reduce_in_bf16: bool = False
    host_moment_dtype: str = "fp32"
    overlap_grad_reduce: bool = True
    loss_chunk_size: Optional[int] = None
    mlp_chunk_size: Optional[int] = None
    stream_weights: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "dp", "vp", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute {self.recompute!r}: choose one of {RECOMPUTE_MODES}")
        if self.recompute_num_layers < 0 or (
            self.recompute_num_layers and self.recompute == "full"
        ):
            raise ValueError(
                f"recompute_num_layers {self.recompute_num_layers}: the layers recomputed whole per pipeline chunk "
                "(>= 0), with a selective recompute mode for the others (not 'full', which recomputes every layer)"
            )
        if self.fsdp is not None and self.fsdp not in FSDP_STRATEGIES:
            raise ValueError(
                f"sharding strategy {self.fsdp!r} (--data-parallel-sharding-strategy): choose one of "
                f"{FSDP_STRATEGIES}"
            )
        if self.fsdp is not None and not self.distributed_optimizer:
            raise ValueError(
                "--use-megatron-fsdp implies the distributed optimizer: drop --no-distributed-optimizer"
            )
        self._check_offload()
        self._check_streaming()
        self._check_tiles()
        if self.vp > 1 and self.pp == 1:
            raise ValueError("an interleaved schedule (vp > 1) needs pp > 1")
        if self.global_batch_size is not None and self.global_batch_size % (
            self.micro_batch_size * self.dp
        ):
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not divisible by micro_batch_size x dp "
                f"= {self.micro_batch_size * self.dp}"
            )

    def _check_offload(self) -> None:
        """ValueError naming the flag for offload the trainer refuses."""
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(
                f"--optimizer-offload-fraction {self.optimizer_offload_fraction}: a fraction in [0, 1]"
            )
        if self.activation_offload_layers < 0:
            raise ValueError(
                f"--activation-offload-layers {self.activation_offload_layers}: layers per pipeline stage (>= 0)"
            )
        if self.overlap_cpu_optimizer and not self.optimizer_offload_fraction:
            raise ValueError(
                "--overlap-cpu-optimizer-d2h-h2d overlaps the offloaded optimizer's copies: it needs "
                "--optimizer-cpu-offload with --optimizer-offload-fraction > 0"
            )
        if self.host_moment_dtype not in HOST_MOMENT_BYTES:
            raise ValueError(
                f"host moment dtype {self.host_moment_dtype!r} (--exp-avg-dtype / --exp-avg-sq-dtype): "
                f"choose one of {tuple(HOST_MOMENT_BYTES)}"
            )
        if self.host_moment_dtype != "fp32" and self.optimizer_offload_fraction != 1.0:
            raise ValueError(
                f"--exp-avg-dtype {self.host_moment_dtype} is the host step's: it needs the whole optimizer "
                "offloaded (--optimizer-cpu-offload --optimizer-offload-fraction 1)"
            )
        if not self.offloads:
            return
        if self.fsdp is not None:
            raise ValueError(
                "host offload (--optimizer-cpu-offload / --activation-offload-layers) with --use-megatron-fsdp: "
                "the trainer refuses the combination (megatron-core's offloaded optimizer fails at pin_memory under "
                "Megatron-FSDP); drop one"
            )
        if self.optimizer_offload_fraction and not self.distributed_optimizer:
            raise ValueError(
                "--optimizer-cpu-offload needs the distributed optimizer (--use-precision-aware-optimizer requires "
                "it): add --use-distributed-optimizer"
            )

    def _check_streaming(self) -> None:
        """ValueError naming the flag for weight streaming the trainer refuses (or the planner
        does not model)."""
        if not self.stream_weights:
            return
        refused = (
            (self.pp > 1, "--pipeline-model-parallel-size > 1"),
            (self.distributed_optimizer, "--use-distributed-optimizer"),
            (self.fsdp is not None, "--use-megatron-fsdp"),
            (bool(self.optimizer_offload_fraction), "--optimizer-cpu-offload"),
            (self.grad_reduce_in_bf16, "--grad-reduce-in-bf16 (FSDP2 reduces in fp32)"),
        )
        for bad, flag in refused:
            if bad:
                raise ValueError(
                    f"--use-torch-fsdp2 --fsdp2-offload-to-cpu with {flag}: the trainer refuses the "
                    "combination (the model's state is already on the host); drop one"
                )

    def _check_tiles(self) -> None:
        """ValueError naming the flag for tiles the trainer refuses (its ``_loss_chunk_size``)."""
        for flag, value in (
            ("--loss-chunk-size", self.loss_chunk_size),
            ("--mlp-chunk-size", self.mlp_chunk_size),
        ):
            if value is None:
                continue
            if value < 1:
                raise ValueError(f"{flag} must be a positive number of tokens, got {value}")
            if self.sp and value % self.tp:
                raise ValueError(
                    f"{flag} {value}: under --sequence-parallel each tile takes the same number of rows from "
                    f"every one of the --tensor-model-parallel-size {self.tp} ranks; use a multiple of {self.tp}"
                )

    @property
    def tiled(self) -> bool:
        """Whether the loss or the MLPs are given tiles (``loss_chunk_size``,
        ``mlp_chunk_size``)."""
        return self.loss_chunk_size is not None or self.mlp_chunk_size is not None

    @property
    def offloads(self) -> bool:
        """Whether anything lives on the host: optimizer state, activations or (streaming)
        the whole model's state."""
        return bool(
            self.optimizer_offload_fraction or self.activation_offload_layers or self.stream_weights
        )

    @property
    def rung(self) -> str:
        """The rung of the memory ladder this layout stands on: ``"flash attention"`` (no
        recompute, no sharding beyond the distributed optimizer), ``"recompute"``,
        ``"ZeRO-3"`` (Megatron-FSDP, with or without recompute), ``"sequence tiling"`` (the
        tiled loss or MLP, with or without those), ``"offload"`` (host offload of the
        optimizer or of activations, or the narrower state of bf16 main gradients, with or
        without any of those) or ``"streaming"`` (weights, gradients and optimizer state on
        the host, streamed unit by unit: :attr:`stream_weights`)."""
        if self.stream_weights:
            return "streaming"
        if self.offloads or self.grad_reduce_in_bf16:
            return "offload"
        if self.tiled:
            return "sequence tiling"
        if self.fsdp is not None:
            return "ZeRO-3"
        if self.recompute != "none" or self.recompute_num_layers:
            return "recompute"
        return "flash attention"

    @property
    def ddp_bucket_size(self) -> Optional[int]:
        """Elements per gradient bucket of megatron's DDP buffer on the first pipeline stage's
        first model chunk (the others have one bucket: ``disable_bucketing`` for later chunks,
        ``pp_rank > 0``), or None for one bucket (and under FSDP2 streaming): with ``--overlap-grad-reduce`` megatron's
        default ``max(40000000, 1000000 x dp)`` (``dp`` without context parallelism:
        ``DistributedDataParallel.__init__``, megatron-core 0.16.1
        ``distributed_data_parallel.py:64-68``, 0.19.2 ``:68-72``); without it None, as under
        Megatron-FSDP."""
        if not self.overlap_grad_reduce or self.fsdp is not None or self.stream_weights:
            return None
        return max(40_000_000, 1_000_000 * self.dp)

    @property
    def sharding_ranks(self) -> int:
        """The data x context parallel ranks the optimizer (and FSDP) shards over."""
        return self.dp * self.cp

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def chunk_layers(self, num_layers: int) -> int:
        """Layers of one pipeline chunk: ``num_layers / (pp * vp)``."""
        return num_layers // (self.pp * self.vp)

    def recompute_shares(self, num_layers: int) -> list[tuple[float, str]]:
        """``(fraction of the layers, recompute mode)``: with partial recompute the first
        ``recompute_num_layers`` of each of the ``num_layers / (pp * vp)``-layer chunks are
        ``full``, the rest ``recompute``."""
        chunk_layers = self.chunk_layers(num_layers)
        if self.recompute_num_layers > chunk_layers:
            raise ValueError(
                f"recompute_num_layers {self.recompute_num_layers} exceeds the {chunk_layers} layers per pipeline "
                f"chunk ({num_layers} layers / (pp {self.pp} x vp {self.vp}))"
            )
        whole = self.recompute_num_layers / chunk_layers
        return [(whole, "full"), (1 - whole, self.recompute)] if whole else [(1.0, self.recompute)]

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect: asked for and TP > 1."""
        return self.sequence_parallel and self.tp > 1

    @property
    def num_microbatches(self) -> Optional[int]:
        """Micro-batches per step, ``global_batch_size / (micro_batch_size * dp)``; None without a global batch."""
        if self.global_batch_size is None:
            return None
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def in_flight(self, stage: int) -> int:
        """Model chunks x micro-batches whose activations stage ``stage`` holds at its peak."""
        if self.vp == 1:
            n = self.pp - stage
            return min(n, self.num_microbatches) if self.num_microbatches else n
        n = 2 * (self.pp - stage - 1) + (self.vp - 1) * self.pp + 1
        return min(n, self.num_microbatches * self.vp) if self.num_microbatches else n

    def to_dict(self) -> dict:
        """The fields, ``num_devices`` and ``num_microbatches``; the tile sizes only where set
        and ``stream_weights`` only when on (the JSON of an untiled, unstreamed layout is what
        it was before either existed)."""
        out = asdict(self)
        for name in ("loss_chunk_size", "mlp_chunk_size"):
            if out[name] is None:
                del out[name]
        if not self.stream_weights:
            del out["stream_weights"]
        out["num_devices"] = self.num_devices
        out["num_microbatches"] = self.num_microbatches
        return out


def recompute_flags(layout: Layout) -> list[str]:
    """The ``mcore-flash pretrain`` flags (Megatron-LM's names) of ``layout``'s recompute."""
    if not layout.recompute_num_layers:
        return list(RECOMPUTE_FLAGS[layout.recompute])
    flags = ["--recompute-granularity", "full", "--recompute-method", "block"]
    flags += ["--recompute-num-layers", str(layout.recompute_num_layers)]
    modules = RECOMPUTE_FLAGS[layout.recompute][3:]  # after "--recompute-modules"
    return flags + (["--recompute-modules", *modules] if modules else [])


def fsdp_flags(layout: Layout) -> list[str]:
    """The ``mcore-flash pretrain`` flags (Megatron-LM's names) of ``layout``'s Megatron-FSDP
    sharding: none without it."""
    if layout.fsdp is None:
        return []
    return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", layout.fsdp]


def offload_flags(layout: Layout) -> list[str]:
    """The ``mcore-flash pretrain`` flags of ``layout``'s host offload: Megatron-LM's
    optimizer offload flags (``--use-precision-aware-optimizer --optimizer-cpu-offload
    --optimizer-offload-fraction F``; ``--use-distributed-optimizer`` and ``--bf16`` come with
    every command) and ``--activation-offload-layers N``; none without offload."""
    flags = []
    if layout.optimizer_offload_fraction:
        flags += ["--use-precision-aware-optimizer", "--optimizer-cpu-offload"]
        flags += ["--optimizer-offload-fraction", f"{layout.optimizer_offload_fraction:g}"]
        if layout.overlap_cpu_optimizer:
            flags.append("--overlap-cpu-optimizer-d2h-h2d")
        if layout.host_moment_dtype != "fp32":
            for flag in ("--exp-avg-dtype", "--exp-avg-sq-dtype"):
                flags += [flag, layout.host_moment_dtype]
    if layout.activation_offload_layers:
        flags += ["--activation-offload-layers", str(layout.activation_offload_layers)]
    return flags


def gradient_flags(layout: Layout) -> list[str]:
    """``--grad-reduce-in-bf16`` for ``layout``'s bf16 main gradients; none for fp32."""
    return ["--grad-reduce-in-bf16"] if layout.grad_reduce_in_bf16 else []


def streaming_flags(layout: Layout) -> list[str]:
    """``--use-torch-fsdp2 --fsdp2-offload-to-cpu`` for ``layout``'s weight streaming; none
    without it."""
    return ["--use-torch-fsdp2", "--fsdp2-offload-to-cpu"] if layout.stream_weights else []


def tiling_flags(layout: Layout) -> list[str]:
    """The ``mcore-flash pretrain`` flags of ``layout``'s sequence tiling (none untiled):
    ``--loss-compute-mode chunk --loss-chunk-size N`` and ``--mlp-chunk-size N``."""
    flags = []
    if layout.loss_chunk_size is not None:
        flags += ["--loss-compute-mode", "chunk", "--loss-chunk-size", str(layout.loss_chunk_size)]
    if layout.mlp_chunk_size is not None:
        flags += ["--mlp-chunk-size", str(layout.mlp_chunk_size)]
    return flags


def tiling_text(layout: Layout) -> str:
    """``layout``'s sequence tiling in words (empty untiled)."""
    parts = []
    if layout.loss_chunk_size is not None:
        parts.append(f"loss tiles of {layout.loss_chunk_size} tokens")
    if layout.mlp_chunk_size is not None:
        parts.append(f"MLP tiles of {layout.mlp_chunk_size} tokens")
    return ", ".join(parts)


def offload_text(layout: Layout) -> str:
    """``layout``'s host offload in words (empty without it)."""
    parts = (
        ["weights, gradients and optimizer on the host, streamed (FSDP2)"]
        if layout.stream_weights
        else []
    )
    if layout.optimizer_offload_fraction:
        parts.append(f"optimizer offload {layout.optimizer_offload_fraction:g}")
    if layout.activation_offload_layers:
        parts.append(f"activation offload {layout.activation_offload_layers} layers/stage")
    if layout.host_moment_dtype != "fp32":
        parts.append(f"{layout.host_moment_dtype} host moments")
    if layout.grad_reduce_in_bf16:
        parts.append("bf16 main gradients")
    return ", ".join(parts)


def recompute_text(layout: Layout, num_layers: int) -> str:
    """``layout``'s recompute in words: the mode, or how partial recompute splits each chunk."""
    if not layout.recompute_num_layers:
        return layout.recompute
    return (
        f"full for {layout.recompute_num_layers} of {layout.chunk_layers(num_layers)} layers per chunk, "
        f"{layout.recompute} for the others"
    )


# the trainer's shape flags over its --model preset: (ModelShape field, flag), numbers
SHAPE_FLAGS = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("num_query_groups", "--num-query-groups"),
    ("kv_channels", "--kv-channels"),
)
# ... and switches it can only turn on: (ModelShape field or property, flag)
SHAPE_SWITCHES = (
    ("gated", "--swiglu"),
    ("add_qkv_bias", "--add-qkv-bias"),
    ("qk_layernorm", "--qk-layernorm"),
)


def shape_flags(model: ModelShape) -> list[str]:
    """The trainer's flags that make its ``--model model.name`` preset into ``model`` (none
    for the preset itself or a shape with no preset of its name); every number given, since
    the trainer derives some from others (FFN, query groups). ValueError for a shape those
    flags cannot make (a switch off that the preset has on)."""
    preset = MODELS.get(model.name)
    if preset is None or preset == model:
        return []
    flags = []
    for field, flag in SHAPE_FLAGS:
        value = getattr(model, field)
        if value is not None:
            flags += [flag, str(value)]
    if model.num_query_groups != model.num_attention_heads:
        flags.append("--group-query-attention")
    for field, flag in SHAPE_SWITCHES:
        if getattr(model, field) and not getattr(preset, field):
            flags.append(flag)
        elif getattr(preset, field) and not getattr(model, field):
            raise ValueError(f"{model.name} without {flag}: the trainer has no flag to turn it off")
    return flags


def pretrain_command(
    model: ModelShape,
    seq_length: int,
    layout: Layout,
    *,
    dtype_bytes: int = 2,
    mean_document_length: Optional[float] = None,
    distributed_timeout_minutes: Optional[int] = None,
    program: str = "mcore-flash pretrain",
) -> str:
    """The ``mcore-flash pretrain`` command line (Megatron-LM flag names) that trains ``model``
    at ``seq_length`` tokens under ``layout``: bf16 when ``dtype_bytes`` is 2 (else fp32),
    with document masking when ``mean_document_length`` (tokens) is given, and
    ``--distributed-timeout-minutes`` when given. bf16 main gradients
    (``layout.grad_reduce_in_bf16``) need ``--bf16``: ValueError otherwise."""
    if layout.grad_reduce_in_bf16 and dtype_bytes != 2:
        raise ValueError("--grad-reduce-in-bf16 needs --bf16 (bf16 parameters and activations)")
    args = [
        "--model",
        model.name,
        *shape_flags(model),
        "--seq-length",
        str(seq_length),
        "--micro-batch-size",
        str(layout.micro_batch_size),
    ]
    if layout.global_batch_size is not None:
        args += ["--global-batch-size", str(layout.global_batch_size)]
    args += [
        "--tensor-model-parallel-size",
        str(layout.tp),
        "--pipeline-model-parallel-size",
        str(layout.pp),
        "--context-parallel-size",
        str(layout.cp),
    ]
    if layout.vp > 1:
        args += [
            "--num-layers-per-virtual-pipeline-stage",
            str(layout.chunk_layers(model.num_layers)),
        ]
    if layout.sp:
        args.append("--sequence-parallel")
    if layout.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if layout.ddp_bucket_size is not None:
        args.append("--overlap-grad-reduce")
    args += fsdp_flags(layout)
    args += streaming_flags(layout)
    args += offload_flags(layout)
    args += gradient_flags(layout)
    args += tiling_flags(layout)
    if mean_document_length is not None:  # the plan assumes document masking
        args += ["--reset-attention-mask", "--reset-position-ids"]
    args += recompute_flags(layout)
    if dtype_bytes == 2:
        args.append("--bf16")  # fp32 is the trainer's default (Megatron-LM has no --fp32)
    if distributed_timeout_minutes is not None:
        args += ["--distributed-timeout-minutes", str(distributed_timeout_minutes)]
    return " ".join([program] + [shlex.quote(a) for a in args])
