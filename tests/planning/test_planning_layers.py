"""mcore_flash.planning is a one-way stack: every module imports only from the layers below it,
and besides those only the standard library (no torch, megatron-core or other package of
mcore_flash: the planner is pure Python).

The layers are declared here, lowest first; modules of one layer do not import each other.
Every import counts, at module level and inside functions (a lazy import that hides a
cycle is still a cycle). A new module must be given its layer here.
"""

from __future__ import annotations

import ast
import os
import sys

import mcore_flash.planning

PACKAGE = "mcore_flash.planning"
LAYERS = [
    ["units", "models", "hardware"],  # byte sizes, model shapes, device profiles
    ["activation_bytes", "flops", "parameters"],  # per-layer saved bytes, FLOPs, parameter counts
    ["transient_bytes"],  # the loss's and an MLP backward's bytes at their peaks
    ["fsdp"],  # Megatron-FSDP's parameter groups, padding and bytes per strategy
    ["parallel_layout"],  # the parallel layout and its launch flags
    # the collective library's communicators of a layout; megatron DDP's state bytes per rank;
    # FSDP2 weight streaming's device, host and copy terms
    ["communicators", "ddp_state", "streaming"],
    ["plans"],  # a memory plan's types: a stage's bytes, a node's host bytes, the plan
    ["host_offload"],  # activation offload's bytes of a stage, a node's host bytes
    ["memory", "step_time", "compare"],  # a memory plan, a step time, standard vs fused attention
    ["timeouts"],  # the limits a planned run launches with
    ["fitting"],  # one layout up the memory ladder: the least recompute, ZeRO-3, offload
    ["search"],  # the layouts that fit, ranked
    ["longest"],  # the longest sequence that fits
    ["recipes"],  # the launch scripts' layouts and the trainer's flags as plans
    ["report", "plan_flags"],  # plans as text; plan's flags in both vocabularies
    ["cli"],  # mcore-flash plan
    ["__init__"],  # the package's public names
]


def module_imports(directory: str) -> dict[str, list[str]]:
    """Per module of ``directory`` (the package ``mcore_flash.planning``), what it imports
    anywhere in its source, as dotted names: relative imports under the package's name
    (``from .x import y``: ``mcore_flash.planning.x``), ``from package import x`` as
    ``package.x`` where ``x`` is a module of the package, else as the package."""
    modules = {name[:-3] for name in os.listdir(directory) if name.endswith(".py")}
    imports = {}
    for module in modules:
        with open(os.path.join(directory, module + ".py")) as f:
            tree = ast.parse(f.read())
        targets = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level > 1:
                    raise AssertionError(
                        f"{module}: relative import above the package ({'.' * node.level})"
                    )
                if node.level:
                    base = PACKAGE + (f".{node.module}" if node.module else "")
                else:
                    base = node.module or ""
                # `from package import x` imports module x when x is one, else the package
                targets += [
                    f"{base}.{a.name}" if base == PACKAGE and a.name in modules else base
                    for a in node.names
                ]
        imports[module] = targets
    return imports


def planning_imports(directory: str) -> dict[str, set[str]]:
    """Per module of ``directory``, the planning modules it imports anywhere in its source:
    ``from .x import``, ``from . import x``, ``import mcore_flash.planning.x``,
    ``from mcore_flash.planning import x`` (the package itself counts as ``__init__``, a name
    that is no module as ``__init__`` too)."""
    imports = {}
    for module, targets in module_imports(directory).items():
        found = set()
        for target in targets:
            if target == PACKAGE:
                found.add("__init__")
            elif target.startswith(PACKAGE + "."):
                found.add(target[len(PACKAGE) + 1 :].split(".")[0])
        imports[module] = found
    return imports


def foreign_imports(directory: str) -> list[str]:
    """Each import of a module of ``directory`` from neither the standard library nor the
    package itself: the planner is pure Python (no torch, megatron-core or other package
    of ``mcore_flash``), lazy imports inside functions included."""
    problems = []
    for module, targets in sorted(module_imports(directory).items()):
        for target in sorted(set(targets)):
            own = target == PACKAGE or target.startswith(PACKAGE + ".")
            if not own and target.split(".")[0] not in sys.stdlib_module_names:
                problems.append(f"{module} imports {target}")
    return problems


def layer_violations(imports: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Each import that does not point to a lower layer, and each module with no layer."""
    level = {module: i for i, layer in enumerate(layers) for module in layer}
    problems = [f"{module} has no layer in LAYERS" for module in sorted(set(imports) - set(level))]
    for module in sorted(set(imports) & set(level)):
        for target in sorted(imports[module]):
            if target not in level:
                problems.append(f"{module} imports {target}, which has no layer in LAYERS")
            elif level[target] >= level[module]:
                problems.append(
                    f"{module} (layer {level[module]}) imports {target} (layer {level[target]})"
                )
    return problems


def _package(directory, sources: dict[str, str]) -> str:
    """``directory`` with one file per ``{name: source}``; returns its path."""
    for name, text in sources.items():
        (directory / name).write_text(text)
    return str(directory)


def test_planning_imports_point_down_only():
    directory = os.path.dirname(mcore_flash.planning.__file__)
    assert layer_violations(planning_imports(directory), LAYERS) == []


def test_the_check_sees_lazy_and_same_layer_imports(tmp_path):
    """A function-level import of a higher layer, a same-layer import and an undeclared
    module are reported; imports of the layers below and from outside the package are not."""
    sources = {
        "low.py": "import json\nfrom mcore_flash.ops import flash_attention\n",
        "twin.py": "from . import low\n",
        "mid.py": "from .low import x\nfrom . import twin\n",
        "high.py": "import mcore_flash.planning.mid\n\ndef f():\n    from mcore_flash.planning import low\n",
        "stray.py": "",
        "lazy.py": "def f():\n    from .high import g\n",
    }
    imports = planning_imports(_package(tmp_path, sources))
    assert imports["high"] == {"mid", "low"} and imports["low"] == set()
    layers = [["low"], ["twin", "mid", "lazy"], ["high"]]
    assert layer_violations(imports, layers) == [
        "stray has no layer in LAYERS",
        "lazy (layer 1) imports high (layer 2)",
        "mid (layer 1) imports twin (layer 1)",
    ]


def test_planning_imports_only_the_standard_library_and_itself():
    directory = os.path.dirname(mcore_flash.planning.__file__)
    assert foreign_imports(directory) == []


def test_the_check_sees_torch_megatron_and_other_packages(tmp_path):
    """torch, megatron-core and other packages of mcore_flash are reported wherever they are
    imported (a lazy import inside a function too); the standard library and the package's
    own modules are not."""
    sources = {
        "low.py": "from __future__ import annotations\nimport json\nfrom fractions import Fraction\n",
        "mid.py": "from . import low\nimport mcore_flash.planning.low\n\ndef f():\n    import torch\n",
        "high.py": "from megatron.core import parallel_state\nfrom mcore_flash import ops\n",
        "top.py": "from mcore_flash.planning import mid\nfrom mcore_flash.transformer.specs import x\n",
    }
    assert foreign_imports(_package(tmp_path, sources)) == [
        "high imports mcore_flash",
        "high imports megatron.core",
        "mid imports torch",
        "top imports mcore_flash.transformer.specs",
    ]
