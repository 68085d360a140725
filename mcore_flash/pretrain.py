"""``mcore-flash pretrain`` / ``python -m mcore_flash.pretrain``: GPT pretraining on megatron-core.

With no flags it trains the tiny preset on the CPU on the built-in long-range task
(a few minutes on 2 cores) and writes checkpoints and ``metrics.jsonl`` to ``runs/tiny``.
Under ``torchrun`` it trains on every rank; ``--dry-run`` checks a cluster launch without
allocating the model. Flags follow Megatron-LM (``mcore-flash pretrain --help``).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from mcore_flash.training.arguments import parse_args


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as error:  # bad flags: say which, before anything is allocated
        print(f"mcore-flash pretrain: error: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        from mcore_flash.training.dry_run import dry_run

        from mcore_flash.planning.recipes import plan_for_pretrain_args

        result = dry_run(args)
        for stage, count in enumerate(result["per_stage"]):
            print(f"pipeline stage {stage}: {count:,} parameters per rank")
        print(f"total parameters: {result['total']:,}")
        plan = plan_for_pretrain_args(args, device_memory=args.device_memory)
        print(plan.format_text())
        return 0 if plan.fits else 1

    from mcore_flash.training.distributed import destroy_distributed, init_distributed
    from mcore_flash.training.loop import TrainingDiverged, train

    init_distributed(args)
    try:
        summary = train(args)
    except TrainingDiverged as error:
        print(f"mcore-flash pretrain: error: {error}", file=sys.stderr)
        return 1
    finally:
        destroy_distributed()
    if summary["first_loss"] is not None:
        print(
            f"done: {summary['iteration']} iterations, loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}; "
            f"checkpoints and metrics.jsonl in {summary['save']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
