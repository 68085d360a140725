"""``mcore-flash pretrain`` / ``python -m mcore_flash.pretrain``: GPT pretraining on megatron-core.

With no flags it trains the tiny preset on the CPU on the built-in long-range task
(a few minutes on 2 cores) and writes checkpoints and ``metrics.jsonl`` to ``runs/tiny``.
Under ``torchrun`` it trains on every rank; ``--dry-run`` checks a cluster launch without
allocating the model. Flags follow Megatron-LM (``mcore-flash pretrain --help``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from mcore_flash.planning.recipes import PlannedRun
    from mcore_flash.runtime.config import TrainingConfig


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse and check ``argv`` into the run's config once (a ``--load`` the flags need a
    checkpoint in included), print its notes and resolved arguments (saved into ``--save``
    too: :mod:`.runtime.startup`), then dry-run or train; returns the exit code (0 done or
    fits, 1 diverged / save failed / does not fit, 2 bad flags)."""
    # Imported here, not at the top: megatron's checkpoint writer starts a helper process
    # with the spawn method, which re-imports this module (``python -m mcore_flash.pretrain``);
    # a top-level megatron import made that cost ~8 s at the first save of every launch.
    from mcore_flash.runtime import startup
    from mcore_flash.runtime.arguments import parse_config

    try:
        config = parse_config(argv)
        startup.require_checkpoint(config)
        startup.announce(config)
        if not config.dry_run:
            startup.save_arguments(config)
    except ValueError as error:  # bad flags: say which, before anything is allocated
        print(f"mcore-flash pretrain: error: {error}", file=sys.stderr)
        return 2
    if config.dry_run:
        return _dry_run(config)
    if config.emulate_npu:
        from mcore_flash import emulation

        emulation.install()  # platform.setup() now finds the emulated torch_npu
    code, summary = _train(config)
    if code == 0 and config.emulate_npu:
        _write_rehearsal_report(config.save, summary["optimizer_state"], summary["model_state"])
    return code


def planned_run(argv: Sequence[str], world_size: Optional[int] = None) -> "PlannedRun":
    """What ``pretrain ARGV --dry-run`` plans (``mcore-flash plan --from-pretrain-args``): the
    flags read by the trainer's parser with its defaults, for ``world_size`` ranks (None:
    WORLD_SIZE, else TP x PP x CP); ValueError naming a flag it refuses."""
    from mcore_flash.planning.recipes import planned_run_for_pretrain_args
    from mcore_flash.runtime.arguments import parse_config

    argv = list(argv)
    return planned_run_for_pretrain_args(
        parse_config(argv if "--dry-run" in argv else [*argv, "--dry-run"], world_size)
    )


def _dry_run(config: TrainingConfig) -> int:
    """Count each pipeline stage's parameters on the meta device, build each stage's DDP (or
    FSDP) and optimizer from these flags at a shrunk shape (:mod:`.training.dry_run`), and
    print the planner's memory plan for this layout; 0 when it fits ``--device-memory``, 2
    when a constructor refuses the flags."""
    from mcore_flash.planning.recipes import plan_for_pretrain_args
    from mcore_flash.planning.report import format_plan
    from mcore_flash.training.dry_run import dry_run

    try:
        result = dry_run(config)
    except ValueError as error:  # a flag the DDP / optimizer / offload constructors refuse
        print(f"mcore-flash pretrain: error: {error}", file=sys.stderr)
        return 2
    for stage, count in enumerate(result["per_stage"]):
        print(f"pipeline stage {stage}: {count:,} parameters per rank")
    print(f"total parameters: {result['total']:,}")
    shape = ", ".join(f"{name} {value}" for name, value in result["shrunk"].items())
    print(f"built for training on {result['device']}, at a shrunk shape ({shape}):")
    for stage, built in enumerate(result["built"]):
        print(
            f"pipeline stage {stage}: {built['chunks']} x {built['model']}, optimizer {built['optimizer']}"
        )
    plan = plan_for_pretrain_args(config, device_memory=config.device_memory)
    print(format_plan(plan))
    return 0 if plan.fits else 1


def _train(config: TrainingConfig) -> tuple[int, Optional[dict]]:
    """Train on this process's ranks; prints the summary (or the error) and returns the exit
    code and the summary (None after an error)."""
    from mcore_flash.checkpoint.failures import CheckpointSaveError
    from mcore_flash.runtime.distributed import destroy_distributed, init_distributed
    from mcore_flash.training.loop import TrainingDiverged, train

    init_distributed(config)
    try:
        summary = train(config)
    except (TrainingDiverged, CheckpointSaveError) as error:
        print(f"mcore-flash pretrain: error: {error}", file=sys.stderr)
        return 1, None
    except ValueError as error:  # a checkpoint that does not fit the flags: say which flag
        print(f"mcore-flash pretrain: error: {error}", file=sys.stderr)
        return 2, None
    finally:
        destroy_distributed()
    return 0, summary  # the done line: the last rank's, from the loop


def _write_rehearsal_report(save_dir: str, optimizer_state: dict, model_state: dict) -> None:
    """``emulated_npu_rank<r>.json`` in ``--save``: what this rank's rehearsal exercised, and
    where its optimizer state and its weights live (``{device type: {dtype: bytes}}``)."""
    import json
    import os

    from mcore_flash import emulation

    rank = int(os.environ.get("RANK", "0"))
    report = {
        **emulation.report(),
        "optimizer_state_bytes": optimizer_state,
        "model_state_bytes": model_state,
    }
    path = os.path.join(save_dir, f"emulated_npu_rank{rank:05d}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    if rank == 0:
        calls = sum(report["op_calls"].values())
        copies = sum(report["inputs_the_kernels_would_copy"].values())
        print(
            f"emulated npu: {calls} torch_npu op calls, {copies} inputs the kernels would copy; report in {path}"
        )


if __name__ == "__main__":
    sys.exit(main())
