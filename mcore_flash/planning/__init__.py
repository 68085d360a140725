"""Memory planner: per-device bytes of a Megatron-Core layout with the fused attention.

    from mcore_flash.planning import Layout, plan_memory, search_layouts, plan_for_recipe

    plan = plan_memory("llama2-70b", 131072, Layout(tp=8, pp=2, cp=16, recompute="attention"),
                       device_memory="64GB")
    plan.fits, plan.per_device, plan.to_dict(), print(plan.format_text())

Pure Python: only :func:`build_flash_gpt` and :func:`meta_parameter_count` (which uses it)
import torch and megatron-core. The per-layer activation terms (:mod:`.activations`) are
checked against the bytes measured by :func:`mcore_flash.memory.measure_activation_bytes`
(tests/test_planning.py).
"""

from .activations import (
    PROFILES,
    RECOMPUTE_MODES,
    Profile,
    Term,
    by_module,
    korthikanti_model,
    korthikanti_table2,
    layer_terms,
    non_layer_terms,
    sum_terms,
)
from .compare import compare_standard
from .flops import forward_flops, pipeline_bubble, recompute_overhead, step_flops
from .hardware import HARDWARE_PROFILES, HardwareProfile, load_hardware
from .models import MODELS, ModelShape, get_model
from .parameters import (
    build_flash_gpt,
    layer_parameters,
    meta_parameter_count,
    optimizer_bytes_per_parameter,
    stage_parameters,
    total_parameters,
)
from .planner import CATEGORIES, ESTIMATED_CATEGORIES, Layout, MemoryPlan, plan_memory
from .recipes import RECIPE_70B_128K, plan_for_recipe
from .search import Candidate, launch_command, search_layouts
from .step_time import StepTime, predict_step_time
from .units import format_bytes, parse_bytes

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
    "build_flash_gpt",
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
    "meta_parameter_count",
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
