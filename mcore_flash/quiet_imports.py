"""The warnings megatron-core and torch print on every command that a user cannot act on.

:data:`NOISE` lists warnings, each by its category, its full message and the module that raises
it (megatron-core without Transformer Engine and apex, megatron's own ``TransformerConfig``
default, torch on megatron's use of its checkpoint API). :data:`LOG_NOISE` lists log records
(the ``logging`` module, which ``-W`` does not reach), each by its level, its full message and
the logger it is logged on. Both are pinned to megatron-core 0.16.1 / 0.19.2 and torch 2.13.

:func:`silence` filters exactly these: every other warning and log record still prints, and
nothing is filtered when the user chose warning filters (``python -W ...`` or
``PYTHONWARNINGS``). It must run before megatron-core (and torch's ``cpp_extension``) is
imported: the CLI calls it before it imports a subcommand.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

_NO_TE_APEX = "Transformer Engine and Apex are not installed. Falling back to "

# (category, the whole message, the module raising it) -- as megatron-core 0.16.1 / 0.19.2 and
# torch 2.13 print them (``mcore-flash convert|generate|pretrain``, a conversion, a resume).
# Importing megatron-core without Transformer Engine and apex (this project needs neither, and
# the PyPI package called ``apex`` is unrelated) warns five times that they are missing;
# megatron's own ``TransformerConfig`` default (``cuda_graph_scope="full"`` in 0.16,
# ``cuda_graph_modules="full"`` in 0.19) trips its own deprecation warning; loading a
# ``torch_dist`` checkpoint makes torch warn about megatron's use of its checkpoint API (0.16:
# ``ShardedTensor`` and ``load_state_dict``; 0.19: ``load`` with a positional storage reader and
# ``no_dist=True``).
NOISE = (
    (
        UserWarning,
        _NO_TE_APEX + "local implementations of multi_tensor_applier and multi_tensor_scale",
        r"(megatron\.core\.distributed\.fsdp\.src\.)?megatron_fsdp\.mixed_precision",
    ),
    (UserWarning, _NO_TE_APEX + "Torch optimizers.", r"megatron\.core\.optimizer"),
    (
        UserWarning,
        _NO_TE_APEX + "local implementations of multi_tensor_applier and multi_tensor_scale",
        r"megatron\.core\.optimizer\.optimizer",
    ),
    (
        UserWarning,
        _NO_TE_APEX
        + "local implementations of multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale",
        r"megatron\.core\.optimizer\.clip_grads",
    ),
    (
        UserWarning,
        "Apex is not installed. Falling back to Torch Norm",
        r"megatron\.core\.models\.backends",
    ),
    (
        UserWarning,
        "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
        r"megatron\.core\.transformer\.transformer_config",
    ),
    (  # 0.19
        UserWarning,
        "full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.",
        r"megatron\.core\.transformer\.transformer_config",
    ),
    (
        FutureWarning,
        "`load_state_dict` is deprecated and will be removed in future versions. "
        "Please use `load` instead.",
        r"megatron\.core\.dist_checkpointing\.strategies\.torch",
    ),
    (
        FutureWarning,
        "Please use DTensor instead and we are deprecating ShardedTensor.",
        r"torch\.distributed\.checkpoint\.(planner_helpers|default_planner)",
    ),
    (  # 0.19 passes its storage reader positionally (attributed to DCP's logging decorator)
        UserWarning,
        "The argument order of load has been changed. "
        "Please check the document to avoid future breakages.",
        r"torch\.distributed\.checkpoint\.logger",
    ),
    (  # 0.19 loads with no_dist=True, on every rank (attributed to DCP's argument-order wrapper)
        UserWarning,
        "torch.distributed is disabled, unavailable or uninitialized, "
        "assuming the intent is to load in a single process.",
        r"torch\.distributed\.checkpoint\.utils",
    ),
)

# (level, the whole message as a regular expression, the logger) -- log records megatron-core
# 0.19.2 and torch 2.13's CUDA build print on stderr (no handler configured: logging's last resort,
# or torch's own handler for its ``torch`` loggers) on every command: torch's ``cpp_extension``,
# imported by megatron, that its CUDA build finds a ``CUDA_HOME`` but no CUDA runtime (a machine
# without a GPU); megatron that ``GPTModel`` is deprecated (in favour of ``HybridModel``, every
# time one is built); megatron that its ``load_common`` is deprecated (it reads the
# ``common.pt`` of a checkpoint that ``mcore-flash convert hf-to-mcore`` wrote).
LOG_NOISE = (
    (
        logging.WARNING,
        re.escape("No CUDA runtime is found, using CUDA_HOME='") + ".+'",
        "torch.utils.cpp_extension",
    ),
    (
        logging.WARNING,
        re.escape(
            "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new "
            "features. Please reference the migration guide "
            "`docs/user-guide/hybrid-model-migration.md` for details on how to use `HybridModel`"
        ),
        "megatron.core.models.gpt.gpt_model",
    ),
    (
        logging.WARNING,
        re.escape(
            "load_common is deprecated and will be removed in a future release. "
            "`torch_dist` now handles all non-tensor data as part of default PyTorch DCP behavior."
        ),
        "megatron.core.dist_checkpointing.strategies.common",
    ),
)


class _DropRecord(logging.Filter):
    """Drops the records of one level whose whole message matches one pattern (a filter on the
    logger they are logged on: the other records of that logger pass)."""

    def __init__(self, level: int, pattern: str):
        super().__init__()
        self.level, self.pattern = level, re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == self.level and self.pattern.fullmatch(record.getMessage()))


# one instance per entry, so that adding them again adds nothing
_LOG_FILTERS = tuple((logger, _DropRecord(level, pattern)) for level, pattern, logger in LOG_NOISE)


def silence() -> None:
    """Filter the warnings in :data:`NOISE` and the log records in :data:`LOG_NOISE` (once is
    enough; calling again changes nothing).

    Every other warning and log record (from these libraries and these loggers too) still
    prints. It does nothing when the user chose warning filters (``python -W ...`` or
    ``PYTHONWARNINGS``): then those decide, and the log records print too, so that one switch
    shows everything this module would hide (a log record has no option of its own that could
    bring it back past a filter). Child processes need nothing: torchrun's workers run the
    CLI's ``main`` (which calls this), and forked ones inherit the filters. The import-time
    messages need this before megatron-core (and torch's ``cpp_extension``) is imported: the
    CLI calls it before it imports a subcommand.
    """
    if sys.warnoptions:  # the user's -W / PYTHONWARNINGS decide
        return
    for category, message, module in NOISE:
        warnings.filterwarnings(
            "ignore", message=re.escape(message) + r"\Z", category=category, module=module + r"\Z"
        )
    for logger, drop in _LOG_FILTERS:
        logging.getLogger(logger).addFilter(drop)
