"""megatron-core version differences, in one place.

Supported: megatron-core 0.16.1 (the newest for Python 3.11) through 0.19.x (Python 3.12);
CI runs the whole suite on both ends (``docs/megatron-versions.md``). Each function names
the megatron-core file/function it answers to and the release that changed it.

What megatron needs on a *device* (the CPU's missing CUDA, the NPU's tensor types) is not a
version difference and lives in :mod:`mcore_flash.platform`, even where a newer release
added a call (0.19's ``torch.cuda.current_stream()`` in DDP: ``platform.megatron_torch_view``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Optional

from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec


def mlp_spec(submodules: MLPSubmodules, module: type = MLP, params: Optional[dict] = None):
    """The ``TransformerLayerSubmodules.mlp`` entry for megatron's dense ``MLP`` (or a subclass
    ``module``, built with the extra keyword arguments ``params``).

    0.18+ (``transformer/mlp.py: MLP.as_mlp_submodule``): the layer builds its MLP by calling
    ``submodules.mlp(config=, pg_collection=, is_mtp_layer=, name=)``; a ``ModuleSpec(MLP)`` is
    still accepted but rewrapped in ``transformer/transformer_layer.py: TransformerLayer.__init__``
    with the warning "Rewrapping ModuleSpec with module ...".
    0.16-0.17: a ``ModuleSpec(module=MLP)``, built by ``build_module`` with ``tp_group``.
    """
    params = params or {}
    if hasattr(MLP, "as_mlp_submodule"):
        return functools.partial(module.as_mlp_submodule, submodules=submodules, **params)
    return ModuleSpec(module=module, submodules=submodules, params=params)


def megatron_get_batch_on_this_cp_rank(batch: dict, cp_group) -> dict:
    """megatron's own context-parallel batch split (``utils.py: get_batch_on_this_cp_rank``).

    0.18+ added a required ``is_hybrid_cp`` (False: the zigzag split of every sequence, the
    0.16 behaviour) and reads the group's size and rank through ``torch.distributed``
    instead of ``utils.get_pg_size`` / ``get_pg_rank``.
    """
    from megatron.core import utils

    split = utils.get_batch_on_this_cp_rank
    if "is_hybrid_cp" in inspect.signature(split).parameters:
        return split(batch, is_hybrid_cp=False, cp_group=cp_group)
    return split(batch, cp_group=cp_group)


def hybrid_stack_parts():
    """``(HybridStack, HybridStackSubmodules, MLPLayer)`` for our ``HybridModel`` spec.

    0.19+: ``models/hybrid/hybrid_block.py`` (``HybridModel``'s stack) and
    ``ssm/mlp_layer.py``. Before 0.19 there is no ``HybridModel``: ImportError with the fix.
    """
    from importlib.metadata import version

    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
        from megatron.core.ssm.mlp_layer import MLPLayer
    except ImportError as error:
        raise ImportError(
            f"HybridModel needs megatron-core 0.19 or later (installed: {version('megatron-core')}); "
            "upgrade megatron-core (Python 3.12), or build GPTModel with get_gpt_decoder_block_flash_spec"
        ) from error
    return HybridStack, HybridStackSubmodules, MLPLayer


def static_inference_scope():
    """The scope megatron's static inference engine runs the model in.

    0.19 (``inference/utils.py: InferenceMode``, set by ``engines/static_engine.py``): the
    model reads a process-wide flag instead of ``inference_context is not None``; while it is
    set ``GPTModel._postprocess`` computes only the last position's logits of a prefill.
    0.16.1 has no such flag (the context alone marks inference): a no-op scope.
    """
    from megatron.core.inference import utils

    mode = getattr(utils, "InferenceMode", None)
    return contextlib.nullcontext() if mode is None else mode.active()
