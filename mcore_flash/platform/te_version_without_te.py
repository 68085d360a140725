"""Any device without Transformer Engine: megatron's ``is_te_min_version`` in the optimizer config.

``optimizer/optimizer_config.py: OptimizerConfig.__post_init__`` (megatron-core 0.16.1 line 383),
reached with ``use_precision_aware_optimizer=True`` (Megatron-LM's
``--use-precision-aware-optimizer``, which ``--optimizer-cpu-offload`` needs), calls
``is_te_min_version("2.1.0")``, and ``utils.py`` compares ``get_te_version()`` - None without
TE - with a ``Version``: "TypeError: '>=' not supported between instances of 'NoneType' and
'Version'". Without TE no version of it is installed, so the answer is False; the optimizer
config module gets that function, the rest of megatron keeps its own. (0.19's
``get_te_version()`` answers ``Version("0.0.0")`` without TE: nothing to adapt, skipped.)
"""

from __future__ import annotations

from ._common import once


def _no_te_is_older(version, check_equality=True) -> bool:
    """``is_te_min_version`` where Transformer Engine is not installed: never."""
    return False


@once
def te_version_without_te():
    """``OptimizerConfig`` checks the TE version as "not installed" instead of raising."""
    try:
        from megatron.core.optimizer import optimizer_config
        from megatron.core.utils import get_te_version
    except ImportError:
        return False
    if get_te_version() is not None or not hasattr(optimizer_config, "is_te_min_version"):
        return False
    optimizer_config.is_te_min_version = _no_te_is_older
