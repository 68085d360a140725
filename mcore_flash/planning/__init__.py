"""Memory planner: per-device bytes of a Megatron-Core layout with the fused attention, its
predicted step time and the layouts that fit (docs/planner.md, docs/step-time.md).

    from mcore_flash.planning import Layout, plan_memory, search_layouts, plan_for_recipe
    from mcore_flash.planning.report import format_plan

    plan = plan_memory("llama2-70b", 131072, Layout(tp=8, pp=2, cp=16, recompute="attention"),
                       device_memory="64GB")
    plan.fits, plan.per_device, plan.to_dict(), print(format_plan(plan))

The modules form a one-way stack, lowest first, declared and checked by
tests/planning/test_planning_layers.py (``LAYERS``; docs/planner.md says what each holds).
Inside the stack a model is a :class:`ModelShape`, a device a :class:`HardwareProfile`
and a size an int of bytes. This package's functions also take preset names (``"tiny"``,
``"llama2-70b"``), profile names or JSON paths (``"h100-80g"``) and sizes (``"64GB"``):
they resolve them once and call the stack (:func:`_resolving`). Pure Python: nothing here
imports torch, megatron-core or another mcore_flash package.
"""

import functools
import inspect

from . import activation_bytes as _activation_bytes
from . import compare as _compare
from . import flops as _flops
from . import memory as _memory
from . import parameters as _parameters
from . import search as _search
from . import step_time as _step_time
from .activation_bytes import (
    PROFILES,
    RECOMPUTE_MODES,
    Profile,
    Term,
    by_module,
    korthikanti_model,
    korthikanti_table2,
    sum_terms,
)
from .flops import pipeline_bubble
from .hardware import HARDWARE_PROFILES, HardwareProfile, load_hardware
from .models import MODELS, ModelShape, get_model
from .parallel_layout import Layout
from .parameters import optimizer_bytes_per_parameter
from .plans import CATEGORIES, ESTIMATED_CATEGORIES, MemoryPlan, launch_command
from .recipes import RECIPE_70B_128K, plan_for_recipe
from .search import Candidate
from .step_time import StepTime
from .units import format_bytes, parse_bytes

# argument name -> how a name or text becomes the typed value the stack takes
_RESOLVERS = {
    "model": get_model,
    "hardware": load_hardware,
    "device_memory": parse_bytes,
    "runtime_reserve": parse_bytes,
}


def _resolving(function):
    """``function`` taking a preset name for ``model``, a profile name or JSON path for
    ``hardware`` and sizes such as ``"64GB"`` for ``device_memory`` / ``runtime_reserve``
    (typed values pass as they are; None stays None)."""
    signature = inspect.signature(function)
    # the **keywords a function passes on (search_layouts' plan_kwargs) are resolved too
    passed_on = next(
        (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
    )

    @functools.wraps(function)
    def resolved(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        for arguments in (bound.arguments, bound.arguments.get(passed_on, {})):
            for name, resolve in _RESOLVERS.items():
                if arguments.get(name) is not None:
                    arguments[name] = resolve(arguments[name])
        return function(*bound.args, **bound.kwargs)

    return resolved


layer_terms = _resolving(_activation_bytes.layer_terms)
non_layer_terms = _resolving(_activation_bytes.non_layer_terms)
compare_standard = _resolving(_compare.compare_standard)
forward_flops = _resolving(_flops.forward_flops)
step_flops = _resolving(_flops.step_flops)
recompute_overhead = _resolving(_flops.recompute_overhead)
layer_parameters = _resolving(_parameters.layer_parameters)
stage_parameters = _resolving(_parameters.stage_parameters)
total_parameters = _resolving(_parameters.total_parameters)
plan_memory = _resolving(_memory.plan_memory)
search_layouts = _resolving(_search.search_layouts)
predict_step_time = _resolving(_step_time.predict_step_time)

__all__ = [
    "CATEGORIES",
    "Candidate",
    "HARDWARE_PROFILES",
    "HardwareProfile",
    "StepTime",
    "load_hardware",
    "predict_step_time",
    "ESTIMATED_CATEGORIES",
    "Layout",
    "MODELS",
    "MemoryPlan",
    "ModelShape",
    "PROFILES",
    "Profile",
    "RECIPE_70B_128K",
    "RECOMPUTE_MODES",
    "Term",
    "by_module",
    "compare_standard",
    "format_bytes",
    "forward_flops",
    "get_model",
    "korthikanti_model",
    "korthikanti_table2",
    "launch_command",
    "layer_parameters",
    "layer_terms",
    "non_layer_terms",
    "optimizer_bytes_per_parameter",
    "parse_bytes",
    "pipeline_bubble",
    "plan_for_recipe",
    "plan_memory",
    "recompute_overhead",
    "search_layouts",
    "stage_parameters",
    "step_flops",
    "sum_terms",
    "total_parameters",
]
