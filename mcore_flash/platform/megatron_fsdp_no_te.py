"""Any device without Transformer Engine: Megatron-FSDP's ``isinstance(module, TELinear)``.

``distributed/fsdp/mcore_fsdp_adapter.py: FullyShardedDataParallel._fix_tensor_parallel_attributes``
(megatron-core 0.16.1 line 181, reached at tensor-parallel size > 1) asks
``isinstance(direct_module, (TELinear,))``. Without Transformer Engine,
``megatron.core.extensions.transformer_engine.TELinear`` is a ``MagicMock`` placeholder, not a
class, and ``isinstance`` raises TypeError. No module is a TE linear then, so the adapter
module's ``TELinear`` becomes a class nothing is an instance of. (0.19 compares the class's
name instead and needs nothing.)
"""

from __future__ import annotations

from mcore_flash.import_hooks import on_import

from ._common import once
from .megatron_fsdp_device_mesh import ADAPTER_MODULE


class NoTELinear:
    """Stands for Transformer Engine's ``TELinear`` where TE is not installed."""


def _rebind(module) -> None:
    if not isinstance(getattr(module, "TELinear", NoTELinear), type):
        module.TELinear = NoTELinear


@once
def megatron_fsdp_no_te():
    """Megatron-FSDP's TE check works without TE (now, or when FSDP is imported)."""
    on_import(ADAPTER_MODULE, _rebind)
