"""The pretrain flags' checks, run by ``TrainingConfig.__post_init__`` before anything is
allocated: each raises ValueError naming the flag to change; :func:`checked_and_derived` also
returns the values derived from the flags (data-parallel size, micro-batches, recompute
settings, hardware profile)."""

from __future__ import annotations

import importlib.util
from importlib.metadata import version
from typing import Any, Optional

from mcore_flash.checkpoint.directory import FSDP_DTENSOR, TORCH_DIST
from mcore_flash.data.datasets import parse_data_path, parse_split
from mcore_flash.data.indexed import check_indexed_dataset
from mcore_flash.planning.hardware import load_hardware
from mcore_flash.planning.plan_flags import tiles
from mcore_flash.runtime.fsdp2_settings import resolve_fsdp2
from mcore_flash.transformer.recompute import RecomputeSettings, recompute_settings

# the TrainingConfig being checked: its flag fields, read as attributes (no import: it imports us)
Flags = Any
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DEFAULT_SHARDING_STRATEGY = "optim_grads_params"  # ZeRO-3, Megatron-LM's recommended one
CKPT_FORMATS = (TORCH_DIST, FSDP_DTENSOR)

# the first megatron-core release whose Megatron-FSDP accumulates gradients right at size 1
DP1_FIXED_IN = (0, 19)


def _megatron_release() -> tuple[int, int]:
    major, minor = version("megatron-core").split(".")[:2]
    return int(major), int(minor)


def upstream_defect(strategy: str, dp_cp: int) -> Optional[str]:
    """Why the installed megatron-core's Megatron-FSDP trains ``strategy`` at data x context
    parallel size ``dp_cp`` wrongly, as an error naming the flag; None if it does not. Pure
    Python (reads the installed version only). Measured against the distributed optimizer's
    run (tests/training/test_megatron_fsdp.py; ``distributed/fsdp/src/megatron_fsdp/
    param_and_grad_buffer.py``, 0.16.1 lines):

    * ``no_shard``: 0.16 fails at the first step (``fetch_bucket`` on the weight buffer
      ``no_shard`` never makes, ``:3734``); 0.19.2 doubles every gradient (grad norm 2x).
    * ``optim``: 0.16 adds the reduce-scatter's copy onto the local gradient (``:3252-3257``):
      grad norm 2x; 0.19.2's grad norm is 1.5x the oracle's.
    * ``optim_grads[_params]`` at size 1 before 0.19 (Megatron-LM issue 6660): the gradient
      buffer is not distributed, so its bucket is a view of it (``:936-942``) and that same
      addition doubles every gradient each micro-batch; 0.19 adds only
      ``if gbuf.is_data_distributed``.
    """
    installed = f"megatron-core {version('megatron-core')}"
    if strategy == "no_shard":
        return (
            f"--data-parallel-sharding-strategy no_shard trains wrongly on {installed} (0.16 fails at "
            "the first step, 0.19 doubles every gradient): it shards nothing, so drop --use-megatron-fsdp "
            "(plain data parallelism)"
        )
    if strategy == "optim":
        return (
            f"--data-parallel-sharding-strategy optim trains wrongly on {installed} (its gradients are "
            "not the data-parallel sum: 0.16 doubles them, 0.19 scales them by 1.5): use "
            "--use-distributed-optimizer without --use-megatron-fsdp (it shards the optimizer state "
            "alike), or optim_grads / optim_grads_params"
        )
    if dp_cp == 1 and _megatron_release() < DP1_FIXED_IN:
        return (
            f"--use-megatron-fsdp at data x context parallel size 1 shards nothing and, on {installed}, "
            "doubles the gradients every micro-batch (Megatron-LM issue 6660, fixed in 0.19): drop "
            "--use-megatron-fsdp (--use-distributed-optimizer keeps the same bytes), or add data-parallel ranks"
        )
    return None


def checked_and_derived(args: Flags, world_size: int) -> dict[str, Any]:
    """Raise ValueError naming the flag for settings that cannot work (before any allocation);
    returns the derived values and the flags resolved on the way (batch size, hardware)."""
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    at_least_one = {
        "--tensor-model-parallel-size": tp,
        "--pipeline-model-parallel-size": pp,
        "--context-parallel-size": cp,
        "--micro-batch-size": args.micro_batch_size,
        "--train-iters": args.train_iters,
        "--seq-length": args.seq_length,
        "--log-interval": args.log_interval,
        "--save-interval": args.save_interval,
    }
    for flag, value in at_least_one.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise ValueError(
            f"--exit-duration-in-mins must be a positive number of minutes, got {args.exit_duration_in_mins}"
        )
    if not 0 < args.distributed_timeout_minutes < float("inf"):
        raise ValueError(
            "--distributed-timeout-minutes must be a positive number of minutes (fractions "
            f"allowed: 0.5 = 30 s), got {args.distributed_timeout_minutes}"
        )
    if world_size % (tp * pp * cp):
        launch = (
            f": one process (no WORLD_SIZE); launch {tp * pp * cp} or a multiple with torchrun "
            f"--nproc-per-node {tp * pp * cp} -m mcore_flash.pretrain ..., or check the flags with --dry-run"
            if world_size == 1
            else ""
        )
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size x --context-parallel-size = {tp} x {pp} x {cp}{launch}"
        )
    dp = world_size // (tp * pp * cp)
    _check_model_layout(args, tp, pp, cp)
    global_batch_size = (
        args.micro_batch_size * dp if args.global_batch_size is None else args.global_batch_size
    )
    if global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(
            f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp}"
        )
    if not 0 <= args.lr_warmup_iters < args.train_iters:
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --train-iters {args.train_iters})"
        )
    if not 0 <= args.min_lr <= args.lr:
        raise ValueError(
            f"--min-lr {args.min_lr:g} must be in [0, --lr {args.lr:g}]: the decay ends there; "
            "lower --min-lr (0 with --lr 0)"
        )
    if args.emulate_npu and args.dry_run:
        raise ValueError(
            "--emulate-npu and --dry-run exclude each other: the dry run builds on the meta device"
        )
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 exclude each other; pick one")
    _check_positions(args)
    for flag in ("finetune", "no_load_optim", "no_load_rng"):
        if getattr(args, flag) and not args.load:
            raise ValueError(
                f"--{flag.replace('_', '-')} needs --load (the checkpoint to start from)"
            )
    hardware = args.hardware  # resolved once already: a config rebuilt by dataclasses.replace
    if isinstance(hardware, str):
        hardware = load_hardware(hardware)  # ValueError names --hardware
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path exclude each other; drop one")
    _check_document_flags(args)
    key_depth = _synthetic_key_depth(args)
    _check_validation(args)
    if args.window_attn_skip_freq is not None and (
        args.window_size is None or args.window_attn_skip_freq < 1
    ):
        raise ValueError("--window-attn-skip-freq needs --window-size and a value >= 1")
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ValueError(
            "--grad-reduce-in-bf16 keeps the main gradients in the bf16 of the parameters: add --bf16"
        )
    fsdp2 = resolve_fsdp2(args)
    sharding = _check_sharding(args, dp * cp)
    _check_optimizer_offload(args)
    _check_moment_dtypes(args)
    _check_overlap_param_gather(args)
    if args.data_path:
        parse_split(args.split)  # DataError naming a bad --split
        prefixes, _ = parse_data_path(args.data_path)
        for prefix in prefixes:
            check_indexed_dataset(prefix, arg="--data-path", scan_tokens=0)
    vp = _virtual_pipeline_size(args, pp, global_batch_size // (args.micro_batch_size * dp))
    recompute = _recompute(args, pp * (vp or 1))
    _check_activation_offload(args, pp)
    return dict(
        loss_chunk_size=_loss_chunk_size(args, tp),
        virtual_pipeline_model_parallel_size=vp,
        num_layers_per_virtual_pipeline_stage=None,  # resolved into vp (so a recheck agrees)
        world_size=world_size,
        data_parallel_size=dp,
        global_batch_size=global_batch_size,
        num_micro_batches=global_batch_size // (args.micro_batch_size * dp),
        hardware=hardware,
        recompute=recompute,
        fsdp2=fsdp2,
        synthetic_key_depth=key_depth,
        **sharding,
    )


def _recompute(args: Flags, chunks: int) -> RecomputeSettings:
    """What the ``--recompute-*`` flags mean; full recompute of at most the layers of one of the
    ``chunks`` (pipeline stages x virtual stages) megatron's block recomputes within."""
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise ValueError(
            "--recompute-granularity full needs --recompute-method uniform (every layer, in "
            "groups of --recompute-num-layers) or block (the first --recompute-num-layers layers "
            "of each stage)"
        )
    recompute = recompute_settings(
        args.recompute_granularity,
        args.recompute_method,
        args.recompute_num_layers,
        args.recompute_modules,
    )
    if recompute.config.get("recompute_granularity") == "full":
        per_chunk = args.num_layers // chunks
        if args.recompute_num_layers > per_chunk:
            where = (
                "virtual pipeline stage"
                if args.virtual_pipeline_model_parallel_size
                else "pipeline stage"
            )
            raise ValueError(
                f"--recompute-num-layers {args.recompute_num_layers} exceeds the {per_chunk} layers per {where}"
            )
    return recompute


def _virtual_pipeline_size(args: Flags, pp: int, micro_batches: int) -> Optional[int]:
    """Model chunks per pipeline rank of the interleaved schedule, from Megatron-LM's
    ``--virtual-pipeline-model-parallel-size V`` or ``--num-layers-per-virtual-pipeline-stage
    N`` (V = layers per stage / N); None (plain 1F1B) for neither or V = 1.

    megatron-core's interleaved schedule runs the micro-batches in groups of PP per chunk
    (``microbatch_group_size_per_vp_stage``): the micro-batches per iteration must be a
    multiple of PP. Offloads and Megatron-FSDP are not validated with it (refused)."""
    size, per_stage = (
        args.virtual_pipeline_model_parallel_size,
        args.num_layers_per_virtual_pipeline_stage,
    )
    if size is not None and per_stage is not None:
        raise ValueError(
            "--virtual-pipeline-model-parallel-size and --num-layers-per-virtual-pipeline-stage exclude "
            "each other (as in Megatron-LM); give one"
        )
    if size is None and per_stage is None:
        return None
    flag = (
        "--virtual-pipeline-model-parallel-size"
        if size is not None
        else "--num-layers-per-virtual-pipeline-stage"
    )
    value = size if size is not None else per_stage
    stage_layers = args.num_layers // pp
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")
    if pp == 1:
        raise ValueError(
            f"{flag} interleaves pipeline stages: it needs --pipeline-model-parallel-size > 1"
        )
    if stage_layers % value:
        raise ValueError(
            f"{flag} {value} does not divide the {stage_layers} layers per pipeline stage "
            f"(--num-layers {args.num_layers} / --pipeline-model-parallel-size {pp})"
        )
    vp = size if size is not None else stage_layers // per_stage
    if vp == 1:
        return None
    if micro_batches % pp:
        raise ValueError(
            f"{flag}: the interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size "
            f"{pp}, and this run has {micro_batches} per iteration (--global-batch-size / (--micro-batch-size x "
            f"data-parallel size)); raise --global-batch-size to a multiple of {pp} micro-batches"
        )
    for name, on in (
        ("--optimizer-cpu-offload", args.optimizer_cpu_offload),
        ("--activation-offload-layers", args.activation_offload_layers),
    ):
        if on:
            raise ValueError(
                f"{flag} with {name} is not validated here (the offloads are tested with one model chunk "
                "per rank); drop one of them"
            )
    return vp


def _synthetic_key_depth(args: Flags) -> Optional[str]:
    """``--synthetic-key-depth``: the built-in task's key placement ("fixed" unless given), None
    with other data, where the flag would do nothing (refused)."""
    if args.data_path or args.mock_data:
        if args.synthetic_key_depth is not None:
            source = "--data-path" if args.data_path else "--mock-data"
            raise ValueError(
                f"--synthetic-key-depth places the key of the built-in task, which {source} replaces; "
                f"drop one of them"
            )
        return None
    return args.synthetic_key_depth or "fixed"


def _check_validation(args: Flags) -> None:
    """``--eval-interval``: at least 1, on data with a validation split (the built-in task
    has none; ``--mock-data`` has one, megatron's split 1,1,1)."""
    if args.eval_interval is None:
        return
    if args.eval_interval < 1 or args.eval_iters < 1:
        raise ValueError(
            f"--eval-interval {args.eval_interval} and --eval-iters {args.eval_iters} must be >= 1"
        )
    if not (args.data_path or args.mock_data):
        raise ValueError(
            "--eval-interval needs a validation set: the built-in task has none; give --data-path "
            "with a --split whose second weight is above 0 (e.g. 98,2,0), or --mock-data"
        )
    if args.data_path and parse_split(args.split)[1] <= 0:  # DataError naming a bad --split
        raise ValueError(
            f"--eval-interval needs a validation split: --split {args.split} gives it no "
            "documents; e.g. --split 98,2,0"
        )


def _check_overlap_param_gather(args: Flags) -> None:
    """``--overlap-param-gather``: Megatron-LM's conditions (the distributed optimizer and
    ``--overlap-grad-reduce``); Megatron-FSDP and the offloaded optimizer gather their own way."""
    if not args.overlap_param_gather:
        return
    if args.use_megatron_fsdp:
        raise ValueError(
            "--overlap-param-gather is for --use-distributed-optimizer: Megatron-FSDP gathers "
            "parameters in the forward pass already (optim_grads_params); drop the flag"
        )
    if not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        raise ValueError(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce "
            "(as in Megatron-LM); add them or drop the flag"
        )
    if args.optimizer_cpu_offload:
        raise ValueError(
            "--overlap-param-gather with --optimizer-cpu-offload is not validated here (the "
            "host optimizer copies the parameters back itself); drop one of them"
        )


def _loss_chunk_size(args: Flags, tp: int) -> Optional[int]:
    """``--loss-compute-mode chunk``'s tile (``--loss-chunk-size``, else
    :data:`mcore_flash.planning.parallel_layout.DEFAULT_LOSS_CHUNK_SIZE`),
    None in the default mode; ``--mlp-chunk-size`` checked alongside, as the planner checks
    both (:func:`mcore_flash.planning.plan_flags.tiles`). A tile's tokens under
    ``--sequence-parallel`` come from every TP rank alike, so they are a multiple of TP."""
    size, mlp = tiles(args)
    for flag, value in (("--loss-chunk-size", size), ("--mlp-chunk-size", mlp)):
        if value is not None and args.sequence_parallel and value % tp:
            raise ValueError(
                f"{flag} {value}: under --sequence-parallel each tile takes the same number of rows from "
                f"every one of the --tensor-model-parallel-size {tp} ranks; use a multiple of {tp}"
            )
    return size


def _check_activation_offload(args: Flags, pp: int) -> None:
    """``--activation-offload-layers N``: 0..layers per stage; one layer per checkpoint; not with
    Megatron-FSDP (its unsharded weights are gathered buffers, not yet told apart: untested)."""
    n = args.activation_offload_layers
    per_stage = args.num_layers // pp
    if not 0 <= n <= per_stage:
        raise ValueError(
            f"--activation-offload-layers {n}: choose 0..{per_stage} (the layers per pipeline stage)"
        )
    if not n:
        return
    if args.recompute_method == "uniform" and (args.recompute_num_layers or 1) > 1:
        raise ValueError(
            "--activation-offload-layers with --recompute-method uniform needs --recompute-num-layers 1 "
            "(a checkpoint of several layers keeps one input for all; offload parks it per layer)"
        )
    if args.use_megatron_fsdp:
        raise ValueError(
            "--activation-offload-layers and --use-megatron-fsdp exclude each other (not validated: "
            "FSDP's gathered weights must not be parked); drop one"
        )


def _check_model_layout(args: Flags, tp: int, pp: int, cp: int) -> None:
    """The heads, layers and sequence split evenly over the TP/PP/CP ranks."""
    if args.num_attention_heads % tp:
        raise ValueError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if args.kv_channels is not None and args.kv_channels < 1:
        raise ValueError(f"--kv-channels must be >= 1, got {args.kv_channels}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ValueError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}: change one, or give the head size with --kv-channels"
        )
    if args.ffn_hidden_size % tp:
        raise ValueError(
            f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
            f"--tensor-model-parallel-size {tp} (each rank holds an equal slice of the MLP)"
        )
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads {args.num_attention_heads}"
        )
    if args.num_query_groups >= tp and args.num_query_groups % tp:
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}"
        )
    if args.num_layers % pp:
        raise ValueError(
            f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}"
        )
    if cp > 1 and args.seq_length % (2 * cp):
        raise ValueError(
            f"--seq-length {args.seq_length} must be divisible by 2 x --context-parallel-size = {2 * cp} "
            "(load-balanced causal context parallelism splits it into 2*cp chunks)"
        )
    if args.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.sequence_parallel and args.seq_length % (tp * cp):
        raise ValueError(
            f"--seq-length {args.seq_length} must be divisible by --tensor-model-parallel-size {tp} with --sequence-parallel"
        )


def _check_sharding(args: Flags, dp_cp: int) -> dict[str, Any]:
    """``--use-megatron-fsdp`` and the flags that go with it; returns the resolved strategy,
    checkpoint format and optimizer choice.

    Megatron-FSDP shards over the data x context parallel ranks and implies the distributed
    optimizer (megatron-core 0.19 forces it; Megatron-LM requires ``--use-distributed-optimizer``
    with it). Its optimizer state saves only as ``fsdp_dtensor`` (megatron-core's
    ``optimizer/distrib_optimizer.py: sharded_state_dict``), ``torch_dist`` only without it.
    """
    fsdp = args.use_megatron_fsdp
    strategy = args.data_parallel_sharding_strategy
    if strategy is not None and not fsdp:
        raise ValueError(
            f"--data-parallel-sharding-strategy {strategy} is Megatron-FSDP's: add --use-megatron-fsdp "
            "(without it --use-distributed-optimizer shards the optimizer state)"
        )
    ckpt_format = args.ckpt_format or ("fsdp_dtensor" if fsdp else "torch_dist")
    if fsdp and ckpt_format != "fsdp_dtensor":
        raise ValueError(
            "--use-megatron-fsdp saves its sharded parameters and optimizer state as --ckpt-format "
            f"fsdp_dtensor (megatron-core refuses {ckpt_format} for them): pass --ckpt-format fsdp_dtensor"
        )
    if not fsdp and ckpt_format != "torch_dist":
        raise ValueError(
            f"--ckpt-format {ckpt_format} holds Megatron-FSDP's sharded state: add --use-megatron-fsdp, "
            "or use --ckpt-format torch_dist"
        )
    if args.async_save and ckpt_format != "torch_dist":
        raise ValueError(
            f"--async-save writes --ckpt-format torch_dist checkpoints in the background (as Megatron-LM); "
            f"{ckpt_format} (--use-megatron-fsdp) saves synchronously here: drop --async-save"
        )
    if not fsdp:
        return dict(ckpt_format=ckpt_format)
    strategy = strategy or DEFAULT_SHARDING_STRATEGY
    if args.fp16:
        raise ValueError(
            "--use-megatron-fsdp with --fp16 is not supported here (its loss scaling of sharded "
            "gradients is untested); train with --bf16"
        )
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(
            "--use-megatron-fsdp with --pipeline-model-parallel-size > 1 is not supported here: shard with "
            "Megatron-FSDP over data x context parallel ranks at --pipeline-model-parallel-size 1, or "
            "pipeline with --use-distributed-optimizer"
        )
    defect = upstream_defect(strategy, dp_cp)
    if defect:
        raise ValueError(defect)
    return dict(
        ckpt_format=ckpt_format,
        data_parallel_sharding_strategy=strategy,
        use_distributed_optimizer=True,
    )


def _check_optimizer_offload(args: Flags) -> None:
    """``--optimizer-cpu-offload`` (megatron-core's ``HybridDeviceOptimizer``) and its flags.

    It steps the optimizer state of a fraction of the parameters on the host. megatron-core
    builds it only for the distributed optimizer with precision-aware state (Megatron-LM's
    recipe: the three flags together), and its copy of fp32 parameters fails ("can't optimize
    a non-leaf Tensor", ``optimizer/distrib_optimizer.py``), so the parameters are bf16; with
    Megatron-FSDP it fails pinning a DTensor (``cpu_offloading/hybrid_optimizer.py``). Whether
    the device has a host to offload to is checked once the device is known
    (:mod:`mcore_flash.training.offload`).
    """
    offload_flags = {
        "--optimizer-offload-fraction": args.optimizer_offload_fraction != 1.0,
        "--overlap-cpu-optimizer-d2h-h2d": args.overlap_cpu_optimizer_d2h_h2d,
    }
    for flag, given in offload_flags.items():
        if given and not args.optimizer_cpu_offload:
            raise ValueError(
                f"{flag} sets how --optimizer-cpu-offload works: add --optimizer-cpu-offload"
            )
    if not 0.0 <= args.optimizer_offload_fraction <= 1.0:
        raise ValueError(
            f"--optimizer-offload-fraction must be in [0, 1] (the share of the optimizer state on the host), "
            f"got {args.optimizer_offload_fraction}"
        )
    distributed = args.use_distributed_optimizer or args.use_megatron_fsdp  # FSDP implies it
    if args.use_precision_aware_optimizer and not distributed:
        raise ValueError("--use-precision-aware-optimizer needs --use-distributed-optimizer")
    if (
        args.use_precision_aware_optimizer
        and not args.optimizer_cpu_offload
        and importlib.util.find_spec("transformer_engine") is None
    ):
        raise ValueError(
            "--use-precision-aware-optimizer on the device steps with Transformer Engine's FusedAdam, "
            "which is not installed (megatron-core's optimizer/optimizer_config.py): use it with "
            "--optimizer-cpu-offload, or drop it"
        )
    if not args.optimizer_cpu_offload:
        return
    needed = {
        "--use-distributed-optimizer": distributed,
        "--use-precision-aware-optimizer": args.use_precision_aware_optimizer,
        "--bf16": args.bf16,
    }
    for flag, given in needed.items():
        if not given:
            raise ValueError(
                f"--optimizer-cpu-offload needs {flag} (megatron-core offloads the distributed optimizer's "
                "precision-aware state of bf16 parameters: --use-distributed-optimizer "
                "--use-precision-aware-optimizer --bf16)"
            )
    if args.use_megatron_fsdp:
        raise ValueError(
            "--optimizer-cpu-offload with --use-megatron-fsdp fails in megatron-core (HybridDeviceOptimizer "
            "pins DTensor parameters, which torch cannot): offload with --use-distributed-optimizer only"
        )


def _check_moment_dtypes(args: Flags) -> None:
    """``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` bf16: Adam's moments stored narrower. Only the
    offloaded optimizer's host step (:mod:`mcore_flash.optim.host_adam`) has such a step here
    (megatron-core passes the dtypes to Transformer Engine's FusedAdam alone), so all the state
    must be on the host: ``--optimizer-cpu-offload`` at fraction 1."""
    narrow = [
        f"{flag} {dtype}"
        for flag, dtype in (
            ("--exp-avg-dtype", args.exp_avg_dtype),
            ("--exp-avg-sq-dtype", args.exp_avg_sq_dtype),
        )
        if dtype != "fp32"
    ]
    if not narrow:
        return
    if not args.optimizer_cpu_offload:
        raise ValueError(
            f"{narrow[0]} is stepped by the host optimizer only (the device's Adam without Transformer "
            "Engine keeps fp32 moments): add --optimizer-cpu-offload --use-precision-aware-optimizer "
            "--use-distributed-optimizer --bf16, or drop the flag"
        )
    if args.optimizer_offload_fraction != 1.0:
        raise ValueError(
            f"{narrow[0]} with --optimizer-offload-fraction {args.optimizer_offload_fraction}: the part "
            "kept on the device would step with fp32 moments; offload it all (--optimizer-offload-fraction "
            "1) or drop the flag"
        )


def _check_positions(args: Flags) -> None:
    """RoPE extension flags, epsilon and the learned position table."""
    extensions = {
        "--use-rope-scaling": args.use_rope_scaling,
        "--rotary-seq-len-interpolation-factor": args.rotary_seq_len_interpolation_factor,
    }
    rope_flags = [flag for flag, given in extensions.items() if given]
    if rope_flags and args.position_embedding_type != "rope":
        raise ValueError(f"{rope_flags[0]} needs --position-embedding-type rope")
    if len(rope_flags) == 2:
        raise ValueError(
            "--use-rope-scaling and --rotary-seq-len-interpolation-factor are two ways of extending RoPE; pick one"
        )
    if args.rope_scaling_factor <= 0:
        raise ValueError(f"--rope-scaling-factor must be > 0, got {args.rope_scaling_factor}")
    if (
        args.rotary_seq_len_interpolation_factor is not None
        and args.rotary_seq_len_interpolation_factor < 1
    ):
        raise ValueError(
            f"--rotary-seq-len-interpolation-factor must be >= 1, got {args.rotary_seq_len_interpolation_factor}"
        )
    if args.norm_epsilon <= 0:
        raise ValueError(f"--norm-epsilon must be > 0, got {args.norm_epsilon}")
    if (
        args.max_position_embeddings < args.seq_length
        and args.position_embedding_type == "learned_absolute"
    ):
        raise ValueError(
            f"--seq-length {args.seq_length} is above --max-position-embeddings "
            f"{args.max_position_embeddings}: learned_absolute positions are a table of that many "
            f"rows (Megatron-LM refuses it too); pass --max-position-embeddings {args.seq_length}"
        )


def _check_document_flags(args: Flags) -> None:
    """RoPE positions come from the packed layout (megatron-core's THD RoPE restarts them per
    document), so with RoPE the two reset flags only make sense together."""
    if (
        args.position_embedding_type != "rope"
        or args.reset_attention_mask == args.reset_position_ids
    ):
        return
    if args.reset_attention_mask:
        raise ValueError(
            "--reset-attention-mask with RoPE restarts positions at every document (megatron-core's THD "
            "RoPE): pass --reset-position-ids too"
        )
    raise ValueError(
        "--reset-position-ids with RoPE needs --reset-attention-mask (RoPE positions restart per document "
        "only in packed batches); add it, or drop --reset-position-ids"
    )
