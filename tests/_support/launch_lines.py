"""The trainer's command line inside a launch line the planner prints.

pretrain_argv(line)                                   # the built-in data, 1000 iterations
pretrain_argv(line, DATA_PATH=prefix, TOKENIZER_MODEL=directory)   # real data
"""

from __future__ import annotations

import shlex

MODULE = "mcore_flash.pretrain"
# the placeholders of mcore_flash.planning.plans.LAUNCH_PLACEHOLDERS that need no file
FILLED = {"TRAIN_ITERS": "1000", "LR": "1e-3"}
# the data flags, dropped (the trainer's built-in data) unless DATA_PATH and TOKENIZER_MODEL are given
DATA_FLAGS = ("--data-path", "--tokenizer-type", "--tokenizer-model")

# the trainer's switches, off unless given (as in `mcore-flash pretrain`) in a one-layout plan,
# on by default in `plan --search`: a one-layout plan of the search's kind of run names them
TRAINER_SWITCHES = ["--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce"]


def pretrain_argv(line: str, **values: str) -> list[str]:
    """The flags after ``-m mcore_flash.pretrain`` in ``line``, each ``$NAME`` replaced by
    ``values[NAME]`` (else :data:`FILLED`'s); without ``DATA_PATH`` the :data:`DATA_FLAGS`
    and their values are left out."""
    tokens = shlex.split(line)
    argv = tokens[tokens.index(MODULE) + 1 :]
    if "DATA_PATH" not in values:
        for flag in DATA_FLAGS:  # each with its one value
            where = argv.index(flag)
            del argv[where : where + 2]
    filled = {**FILLED, **values}
    return [filled[token[1:]] if token.startswith("$") else token for token in argv]
