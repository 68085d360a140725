"""mcore_flash is layered: every package imports only packages of the layers below it, and no
two modules import each other, directly or round a circle.

Every import counts, at module level and inside functions (a lazy import that hides a cycle
is still a cycle). A top-level module counts as a package of its own; ``from mcore_flash
import x`` imports the module ``x`` where there is one, else the package's ``__init__``. The
layers are declared here, lowest first; packages of one layer do not import each other. A new
package must be given its layer here.
"""

from __future__ import annotations

import ast
import os

import mcore_flash

ROOT = "mcore_flash"
LAYERS = [
    # leaves: the NPU contract, import hooks, version shims, ports, quiet imports, measured
    # bytes, fault injection, figures
    [
        "npu_contract",
        "import_hooks",
        "compat",
        "ports",
        "quiet_imports",
        "measured_memory",
        "faults",
        "plot",
    ],
    ["emulation", "ops", "platform"],  # the emulated NPU, kernels, the device adapter
    ["transformer"],  # Megatron modules and specs
    ["data", "planning", "optim"],  # tokenizers and datasets, the planner, the host optimizer
    ["checkpoint"],  # the checkpoint directory, formats and checkpointer
    ["runtime"],  # flags, config, model, distributed setup, tokenizer, a trained model
    ["conversion"],  # Hugging Face <-> Megatron checkpoints
    ["training", "evaluation", "generate"],  # the trainer, evaluation, generation
    ["benchmarks", "preprocess", "pretrain"],  # benchmarks and the other CLIs
    ["cli", "__init__"],  # mcore-flash and the package's public names
]


def package_modules(root: str) -> dict[str, str]:
    """``{dotted module name: file}`` of every module under the package directory ``root``."""
    modules = {}
    for directory, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path[:-3], os.path.dirname(root)).replace(os.sep, ".")
                modules[dotted.removesuffix(".__init__")] = path
    return modules


def module_imports(modules: dict[str, str]) -> dict[str, set[str]]:
    """Per module, the modules of ``modules`` it imports anywhere in its source (each import
    resolved to the deepest module named; a package stands for its ``__init__``)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        with open(path) as f:
            tree = ast.parse(f.read())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                for alias in node.names:
                    targets.add(resolve(f"{base}.{alias.name}") or resolve(base))
        graph[module] = {target for target in targets if target and target != module}
    return graph


def top(module: str) -> str:
    """The package (or top-level module) of ``module``: ``mcore_flash.a.b`` -> ``a``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Each import of another package that does not point to a lower layer, and each package
    with no layer."""
    level = {package: i for i, layer in enumerate(layers) for package in layer}
    problems = sorted({f"{top(m)} has no layer in LAYERS" for m in graph if top(m) not in level})
    for module in sorted(graph):
        for target in sorted(graph[module]):
            mine, theirs = top(module), top(target)
            if mine == theirs or mine not in level or theirs not in level:
                continue
            if level[theirs] >= level[mine]:
                problems.append(f"{module} imports {target}: {theirs} is not below {mine}")
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


GRAPH = module_imports(package_modules(os.path.dirname(mcore_flash.__file__)))


def test_every_package_imports_only_the_layers_below_it():
    assert layer_violations(GRAPH, LAYERS) == []


def test_no_two_modules_import_each_other_round_a_circle():
    assert cycles(GRAPH) == []


def test_the_checks_see_an_upward_import_a_lazy_one_and_a_circle(tmp_path):
    """The checks themselves on a package written for the purpose: a lazy import inside a
    function that runs upward and closes a circle is reported by both."""
    package = tmp_path / "mcore_flash"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("def f():\n    from mcore_flash.high import b\n")
    (package / "high.py").write_text("from mcore_flash.low import a\n")
    (package / "low" / "b.py").write_text("from .a import f\n")
    graph = module_imports(package_modules(str(package)))
    assert graph["mcore_flash.low.b"] == {"mcore_flash.low.a"}
    assert layer_violations(graph, [["low"], ["high"], ["__init__"]]) == [
        "mcore_flash.low.a imports mcore_flash.high: high is not below low"
    ]
    assert cycles(graph) == [["mcore_flash.high", "mcore_flash.low.a"]]
    assert layer_violations(graph, [["low"]]) == [
        "__init__ has no layer in LAYERS",
        "high has no layer in LAYERS",
    ]
