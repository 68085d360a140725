"""The warnings megatron-core and torch print on every command that a user cannot act on.

Importing megatron-core without Transformer Engine and apex (this project needs neither, and
the PyPI package called ``apex`` is unrelated) warns five times that they are missing;
megatron 0.16's own ``TransformerConfig`` default (``cuda_graph_scope="full"``) trips its own
deprecation warning; loading a ``torch_dist`` checkpoint makes torch warn about megatron's use
of ``ShardedTensor`` and of ``load_state_dict``. :func:`silence` filters exactly these, each by
its category, its full message and the module that raises it: every other warning (from
these libraries too) still prints.

It does nothing when the user chose warning filters (``python -W ...`` or ``PYTHONWARNINGS``):
then those decide. Child processes need nothing: torchrun's workers run the CLI's ``main``
(which calls :func:`silence`), and forked ones inherit the filters.
"""

from __future__ import annotations

import re
import sys
import warnings

_NO_TE_APEX = "Transformer Engine and Apex are not installed. Falling back to "

# (category, the whole message, the module raising it) -- as megatron-core 0.16.1 and torch 2.13
# print them (``mcore-flash convert|generate|pretrain``, a conversion, a resume)
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
)


def silence() -> None:
    """Filter the warnings in :data:`NOISE` (once is enough; calling again changes nothing)."""
    if sys.warnoptions:  # the user's -W / PYTHONWARNINGS decide
        return
    for category, message, module in NOISE:
        warnings.filterwarnings(
            "ignore", message=re.escape(message) + r"\Z", category=category, module=module + r"\Z"
        )
