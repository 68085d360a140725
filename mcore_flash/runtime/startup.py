"""What ``mcore-flash pretrain`` does with a checked config before it builds anything.

* :func:`require_checkpoint`: ``--finetune``, ``--no-load-optim`` and ``--use-checkpoint-args``
  need a checkpoint in ``--load``; a ``--load`` that holds none (a typo, a run not yet saved)
  is refused naming the path, where a plain ``--load`` (resume or start, the main job's
  ``--load runs/tiny``) starts from scratch and says so.
* :func:`announce`: the notes of the launch line (what its Megatron-LM / MindSpeed-LLM flags
  became, the defaults chosen for it), then Megatron-LM's block of resolved arguments
  (``------------------------ arguments ------------------------``, one ``name ..... value``
  line each, sorted), on rank 0.
* :func:`save_arguments`: the same block into ``--save``/:data:`ARGUMENTS_FILE`, rewritten by
  every launch that trains into that directory (never by one that is refused there).

Pure Python: no torch, no process group (rank 0 is the ``RANK`` variable torchrun sets).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from mcore_flash.checkpoint import directory
from mcore_flash.planning.hardware import HardwareProfile

if TYPE_CHECKING:
    from mcore_flash.runtime.config import TrainingConfig

ARGUMENTS_FILE = "arguments.txt"
# derived fields the block leaves out: the recompute flags are listed as given
_NOT_SHOWN = ("notes", "recompute")


def require_checkpoint(config: TrainingConfig) -> None:
    """Raise ValueError naming the path when a flag that loads from ``--load`` finds no
    checkpoint there (:func:`~mcore_flash.checkpoint.directory.check_checkpoint`); a plain ``--load`` may hold none."""
    needing = [
        flag
        for flag, given in (
            ("--finetune", config.finetune),
            ("--no-load-optim", config.no_load_optim),
            ("--use-checkpoint-args", config.use_checkpoint_args),
        )
        if given
    ]
    directory.check_checkpoint(config.load, needing)


def arguments_block(config: TrainingConfig) -> str:
    """Megatron-LM's ``_print_args`` block of the resolved arguments: every flag's value after
    presets and checks, the world size and the derived layout (data-parallel size,
    micro-batches per iteration)."""
    lines = []
    for name, value in config.to_dict().items():
        if name in _NOT_SHOWN:
            continue
        shown = value.name if isinstance(value, HardwareProfile) else value
        lines.append(f"  {name} {'.' * (48 - len(name))} {shown}")
    return "\n".join(
        [
            "------------------------ arguments ------------------------",
            *sorted(lines, key=str.lower),
            "-------------------- end of arguments ---------------------",
        ]
    )


def announce(config: TrainingConfig) -> None:
    """On rank 0: each note of the launch line on stderr, then :func:`arguments_block` on
    stdout."""
    if os.environ.get("RANK", "0") != "0":
        return
    for note in config.notes:
        print(f"[mcore-flash] {note}", file=sys.stderr, flush=True)
    print(arguments_block(config), flush=True)


def save_arguments(config: TrainingConfig) -> str:
    """Write :func:`arguments_block` to ``--save``/:data:`ARGUMENTS_FILE` on rank 0 (after the
    check that this launch may write there: ValueError as training would raise it); returns
    the path."""
    directory.refuse_overwrite(config.save, config.load)
    path = os.path.join(config.save, ARGUMENTS_FILE)
    if os.environ.get("RANK", "0") == "0":
        os.makedirs(config.save, exist_ok=True)
        with open(path, "w") as f:
            f.write(arguments_block(config) + "\n")
    return path
