"""Any device without Transformer Engine: megatron's ``CheckpointWithoutOutput()`` fp8 bug.

``tensor_parallel/random.py:589`` (megatron-core 0.16.1): ``__init__(self, fp8=False)`` sets
``self.fp8 = fp8 is not None`` - True for the default - and then calls Transformer Engine's
``activation_recompute_forward`` (NameError without TE). It is hit by selective recompute
of ``layernorm`` / ``mlp`` / ``moe_act`` (``transformer/transformer_layer.py:577``) on every
install without TE: the CPU, and every Ascend host. Here ``fp8`` False or None means no fp8.
"""

from __future__ import annotations

import functools
import inspect

from ._common import once


@once
def checkpoint_without_output_no_te():
    """``CheckpointWithoutOutput(fp8=False)`` takes the non-fp8 path when TE is absent."""
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:
        return False
    cls = getattr(mrandom, "CheckpointWithoutOutput", None)
    if cls is None or getattr(mrandom, "HAVE_TE", False):
        return False
    if getattr(cls.__init__, "__mcore_flash__", False):
        return
    if "fp8" not in inspect.signature(cls.__init__).parameters:
        return False
    megatron_init = cls.__init__

    @functools.wraps(megatron_init)
    def __init__(self, *args, **kwargs):
        megatron_init(self, *args, **kwargs)
        fp8 = (
            inspect.signature(megatron_init).bind(self, *args, **kwargs).arguments.get("fp8", False)
        )
        if fp8 is None or fp8 is False:
            self.fp8 = False

    __init__.__mcore_flash__ = True
    cls.__init__ = __init__
