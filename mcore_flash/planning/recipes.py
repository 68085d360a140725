"""The layouts our launch scripts use, as plans (``scripts/pretrain_70b.sh --dry-run``).

:data:`RECIPE_70B_128K`: Llama-2-70B at 128K tokens on 256 Ascend 910Bs, the layout
``mcore-flash plan --search`` ranks first there (``scripts/pretrain_70b.sh`` asks the search at
launch; its figures: docs/planner.md), planned against what torch_npu can allocate of a 910B
(the default profile's capacity) with its default headroom.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .hardware import DEFAULT_HARDWARE, HARDWARE_PROFILES, HardwareProfile
from .memory import plan_memory
from .models import ModelShape, get_model
from .parallel_layout import Layout
from .plans import MemoryPlan
from .units import parse_bytes

__all__ = [
    "RECIPE_70B_128K",
    "plan_for_recipe",
    "PlannedRun",
    "planned_run_for_pretrain_args",
    "plan_for_pretrain_args",
    "model_shape_for_pretrain_args",
]

RECIPE_70B_128K = dict(
    model="llama2-70b",
    seq_length=131072,
    tp=8,
    pp=2,
    cp=16,
    dp=1,
    vp=1,
    sequence_parallel=True,
    recompute="none",
    micro_batch_size=1,
    global_batch_size=32,
    distributed_optimizer=True,
    device_memory=HARDWARE_PROFILES[DEFAULT_HARDWARE].capacity,
)


def plan_for_recipe(
    model: Optional[str] = None,
    seq_length: Optional[int] = None,
    *,
    num_devices: Optional[int] = None,
    profile: str = "npu",
    **overrides,
) -> MemoryPlan:
    """The memory plan of the 70B/128K recipe, with any setting overridden.

    Keywords: ``tp, pp, cp, dp, vp, sequence_parallel, recompute, micro_batch_size,
    global_batch_size, distributed_optimizer, device_memory`` (as in :data:`RECIPE_70B_128K`)
    and ``num_devices`` (sets ``dp = num_devices / (tp*pp*cp)``); other keywords go to
    :func:`~mcore_flash.planning.memory.plan_memory` (``runtime_reserve``, ...). ``model``
    is a preset name or a :class:`ModelShape`; ``device_memory`` and ``runtime_reserve`` are
    bytes or sizes such as ``"64GB"``.
    """
    settings = dict(RECIPE_70B_128K)
    if model is not None:
        settings["model"] = model
    if seq_length is not None:
        settings["seq_length"] = seq_length
    layout_keys = {f for f in Layout.__dataclass_fields__}
    plan_kwargs = {
        k: v for k, v in overrides.items() if k not in layout_keys and k != "device_memory"
    }
    settings.update(
        {k: v for k, v in overrides.items() if k in layout_keys or k == "device_memory"}
    )
    if num_devices is not None:
        unit = settings["tp"] * settings["pp"] * settings["cp"]
        if num_devices % unit:
            raise ValueError(f"num_devices {num_devices} is not divisible by tp*pp*cp = {unit}")
        settings["dp"] = num_devices // unit
    layout = Layout(**{k: settings[k] for k in layout_keys if k in settings})
    if "runtime_reserve" in plan_kwargs:
        plan_kwargs["runtime_reserve"] = parse_bytes(plan_kwargs["runtime_reserve"])
    capacity = None if settings["device_memory"] is None else parse_bytes(settings["device_memory"])
    return plan_memory(
        get_model(settings["model"]),
        settings["seq_length"],
        layout,
        device_memory=capacity,
        profile=profile,
        **plan_kwargs,
    )


class PlannedRun(NamedTuple):
    """What a ``mcore-flash pretrain`` command line trains, in the planner's terms."""

    model: ModelShape  # its --model preset with its shape flags
    seq_length: int  # tokens
    layout: Layout
    dtype_bytes: int  # weights and activations: 2 with --bf16 or --fp16, else 4
    hardware: HardwareProfile  # its --hardware (default DEFAULT_HARDWARE)
    device_memory: int  # bytes: its --device-memory, else the profile's capacity


def planned_run_for_pretrain_args(args) -> PlannedRun:
    """The :class:`PlannedRun` of a parsed ``mcore-flash pretrain`` command line.

    Megatron's selective recompute counts as ``attention`` when it includes ``core_attn``
    (our spec's attention-only mode), as ``qkv`` with our ``qkv`` module, and as ``none``
    otherwise (a conservative upper bound). Full recompute by ``block`` is partial recompute:
    its ``--recompute-num-layers`` layers of each chunk whole, the others by the modules.
    The sequence tiles are the config's resolved ``loss_chunk_size`` (None unless
    ``--loss-compute-mode chunk``) and ``mlp_chunk_size``. Adam's host moments plan as bf16
    when ``--exp-avg-dtype`` and ``--exp-avg-sq-dtype`` both are, else as fp32 (an upper bound).
    ``use_torch_fsdp2`` and ``fsdp2_offload_to_cpu`` (read with ``getattr``: off where the
    parser lacks them) together stream the weights (``Layout.stream_weights``).
    """
    config = args.recompute.config
    modules = args.recompute.layer_modules
    granularity = config.get("recompute_granularity")
    partial = granularity == "full" and config["recompute_method"] == "block"
    if granularity == "full" and not partial:
        recompute = "full"
    elif "qkv" in modules:
        recompute = "qkv"
    elif "core_attn" in (modules if partial else config.get("recompute_modules") or ()):
        recompute = "attention"
    else:
        recompute = "none"
    layout = Layout(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        vp=args.virtual_pipeline_model_parallel_size or 1,
        cp=args.context_parallel_size,
        dp=args.data_parallel_size,
        sequence_parallel=args.sequence_parallel,
        recompute=recompute,
        recompute_num_layers=config["recompute_num_layers"] if partial else 0,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        distributed_optimizer=args.use_distributed_optimizer,
        fsdp=args.data_parallel_sharding_strategy,
        optimizer_offload_fraction=args.optimizer_offload_fraction
        if args.optimizer_cpu_offload
        else 0.0,
        activation_offload_layers=args.activation_offload_layers,
        overlap_cpu_optimizer=args.overlap_cpu_optimizer_d2h_h2d,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        host_moment_dtype="bf16"
        if args.exp_avg_dtype == args.exp_avg_sq_dtype == "bf16"
        else "fp32",
        overlap_grad_reduce=args.overlap_grad_reduce,
        loss_chunk_size=args.loss_chunk_size,
        mlp_chunk_size=args.mlp_chunk_size,
        stream_weights=_streams(args),
    )
    hardware = args.hardware or HARDWARE_PROFILES[DEFAULT_HARDWARE]
    return PlannedRun(
        model=model_shape_for_pretrain_args(args),
        seq_length=args.seq_length,
        layout=layout,
        dtype_bytes=2 if args.bf16 or args.fp16 else 4,
        hardware=hardware,
        device_memory=hardware.capacity
        if args.device_memory is None
        else parse_bytes(args.device_memory),
    )


def _streams(args) -> bool:
    """Whether a parsed ``mcore-flash pretrain`` command line streams its weights from the
    host: ``--use-torch-fsdp2 --fsdp2-offload-to-cpu`` (absent from a parser without them:
    off). ValueError for FSDP2 without the offload (not planned) or the offload without it."""
    fsdp2, offload = (
        getattr(args, name, False) for name in ("use_torch_fsdp2", "fsdp2_offload_to_cpu")
    )
    if fsdp2 != offload:
        raise ValueError(
            "--use-torch-fsdp2 without --fsdp2-offload-to-cpu (or the other way round): the planner plans "
            "FSDP2 only with its CPU offload (weight streaming)"
        )
    return bool(fsdp2)


def plan_for_pretrain_args(args, device_memory=None, profile: str = "npu") -> MemoryPlan:
    """The plan of a parsed ``mcore-flash pretrain`` command line (its shape flags included,
    :func:`planned_run_for_pretrain_args`) against ``device_memory`` (bytes or a size such as
    ``"64GB"``; None: its ``--device-memory``, else the capacity of its ``--hardware``
    profile), with that profile's collective library buffers."""
    run = planned_run_for_pretrain_args(args)
    return plan_memory(
        run.model,
        run.seq_length,
        run.layout,
        device_memory=run.device_memory if device_memory is None else parse_bytes(device_memory),
        profile=profile,
        dtype_bytes=run.dtype_bytes,
        hardware=run.hardware,
    )


def model_shape_for_pretrain_args(args, vocab_size: Optional[int] = None) -> ModelShape:
    """The :class:`ModelShape` a parsed ``mcore-flash pretrain`` command line trains: its
    ``--model`` preset with the shape flags applied; ``vocab_size`` (the tokenizer's padded
    vocabulary, rows) when given, else the preset's."""
    preset = get_model(args.model)
    return preset.with_(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        activation="swiglu" if args.swiglu else "gelu",
        kv_channels=args.kv_channels,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        vocab_size=preset.vocab_size if vocab_size is None else vocab_size,
    )
