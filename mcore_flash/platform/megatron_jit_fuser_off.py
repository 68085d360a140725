"""Every device: megatron's ``jit_fuser`` decorates without compiling.

Answers ``megatron/core/jit.py`` (megatron-core 0.16.1-0.19): ``jit_fuser`` is
``torch.compile``, applied at import to about 40 fused functions (``fusions/``,
``activations.py``, ``transformer/utils.py``, ...); each decoration sets up dynamo, about
2 s of every process's import of megatron-core on the CPU. The flash spec calls none of
them: every ``*_fusion`` of its ``TransformerConfig`` is off (megatron-core's defaults,
which the trainer keeps). megatron's own ``disable_jit_fuser`` runs when ``megatron.core.jit``
is imported, before any fused module is; MindSpeed likewise replaces the JIT decorators on
Ascend. Where megatron was imported before ``platform.setup()`` the decorations are made
already and stay (no harm: the functions are not called).
"""

from __future__ import annotations

from mcore_flash.import_hooks import on_import

from ._common import once

JIT_MODULE = "megatron.core.jit"


def _disable(module) -> None:
    module.disable_jit_fuser()


@once
def megatron_jit_fuser_off():
    """megatron's fused functions stay plain Python (now, or when megatron is imported)."""
    on_import(JIT_MODULE, _disable)
