"""The architecture holds: the package is built in floors (subpackages), each importing only the
floors below it (LAYERS states which may import which; imports inside functions and under
TYPE_CHECKING count), no import cycle, the top level holds only the public API, the app imports
only zeroshard's public names, only comm/collectives.py calls torch.distributed's collectives, no
file is over 400 lines, and the linter passes."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest

import zeroshard
from helpers import ROOT

SRC = os.path.join(ROOT, "src")
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "barrier",
               "all_to_all", "all_to_all_single", "gather", "scatter", "reduce", "send", "recv"}


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(os.path.join(SRC, "zeroshard")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """Every zeroshard module `module` imports, wherever the import statement stands."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            submodules = [f"{base}.{alias.name}" for alias in node.names]
            # `from . import a, b` imports submodules a and b; `from .m import x` imports m
            names = submodules if node.module is None else [base] + submodules
        else:
            continue
        targets.update(n for n in names if n in modules and n != module)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, path, modules) for m, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None
    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


# Which floor may import which (each floor's __init__ docstring says the same). Public shims at the
# top level (zeroshard.hf) and the package itself (the public API) stand above every floor.
LAYERS: dict[str, set[str]] = {
    "common": set(),                      # guarded states and modes
    "config": set(),                      # DeepSpeed-compatible keys, validated
    "paper": set(),                       # the paper's analytic model
    "construct": set(),                   # partitioned construction (deferred tensors)
    "comm": {"common", "config"},         # every collective, counted; devices; divergence
    "parallel": {"common", "config", "comm", "construct"},  # tensor parallelism, ZeRO-R activations
    "offload": {"common", "config", "comm"},              # host copies, disk files
    "core": {"common", "config", "comm", "parallel", "offload", "construct"},  # the mechanism
    "checkpoint": {"common", "config", "comm", "parallel", "offload", "core"},
    "engine": {"common", "config", "comm", "parallel", "offload", "core", "checkpoint", "construct"},
    "integrations": {"common", "config", "comm", "core", "engine", "public"},
    "app": {"public", "paper", "parallel"},  # a user like any other: the public API
}
PUBLIC = {"zeroshard", "zeroshard.hf"}  # the public API's modules, importable by the floors above


def _floor(module: str) -> str:
    """The floor a module belongs to ("top" for the package and its public shims)."""
    parts = module.split(".")
    return "top" if len(parts) == 1 or module in PUBLIC or module == "zeroshard.__main__" else parts[1]


def test_no_import_cycle():
    graph = _graph()
    assert len(graph) > 20 and "zeroshard.engine.engine" in graph["zeroshard"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        floor = _floor(module)
        if floor == "top":
            continue
        assert floor in LAYERS, f"{module}: floor '{floor}' is not in LAYERS (state what it may import)"
        for target in targets:
            to = _floor(target)
            allowed = LAYERS[floor] | {floor} | ({"top"} if "public" in LAYERS[floor] else set())
            if to not in allowed or (to == "top" and target not in PUBLIC):
                wrong.append(f"{module} -> {target}")
    return wrong


def test_floors_import_only_the_floors_below():
    wrong = _upward_imports(_graph())
    assert not wrong, "imports against LAYERS: " + "; ".join(wrong)


def test_the_layering_check_finds_an_upward_import():
    graph = _graph()
    graph["zeroshard.comm.collectives"] = graph["zeroshard.comm.collectives"] | {"zeroshard.core.units"}
    graph["zeroshard.core.units"] = graph["zeroshard.core.units"] | {"zeroshard.engine.engine"}
    assert sorted(_upward_imports(graph)) == ["zeroshard.comm.collectives -> zeroshard.core.units",
                                              "zeroshard.core.units -> zeroshard.engine.engine"]


def test_the_top_level_holds_only_the_public_api():
    top = {name for name in os.listdir(os.path.join(SRC, "zeroshard")) if name.endswith(".py")}
    assert top == {"__init__.py", "__main__.py", "hf.py"}, top
    for folder in LAYERS:  # each floor says what it owns and what it may import
        init = os.path.join(SRC, "zeroshard", folder, "__init__.py")
        doc = ast.get_docstring(ast.parse(open(init).read())) or ""
        assert "May import" in doc and len(doc) > 120, f"{init}: say what the floor owns and may import"


def test_the_cycle_check_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_app_uses_only_the_public_api_and_the_core_never_the_app():
    graph = _graph()
    allowed = ("zeroshard", "zeroshard.hf", "zeroshard.paper", "zeroshard.parallel", "zeroshard.app")
    for module, targets in graph.items():
        if module.startswith("zeroshard.app") or module == "zeroshard.__main__":  # the app's entry point
            wrong = [t for t in targets
                     if not (t in allowed or t.startswith(("zeroshard.paper.", "zeroshard.app.")))]
            assert not wrong, f"{module} imports zeroshard's internals {wrong}: use the public API"
        else:
            assert not [t for t in targets if t.startswith("zeroshard.app")], f"{module} imports the app"
    for path in _modules().values():  # names taken from the package itself must be public
        if os.sep + "app" + os.sep in path:
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom) and node.module == "zeroshard":
                    private = [a.name for a in node.names if a.name not in zeroshard.__all__]
                    assert not private, f"{path} imports {private}, not in zeroshard.__all__"


def test_only_comm_calls_collectives():
    for module, path in _modules().items():
        if module in ("zeroshard.comm.collectives", "zeroshard.comm.gloo"):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and \
                    isinstance(node.value, ast.Name) and node.value.id == "dist":
                raise AssertionError(f"{module} calls dist.{node.attr}: collectives go through comm.py")


def test_lint():
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    done = subprocess.run([ruff, "check", "src", "tests", "benchmarks", "examples"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_module_is_over_400_lines():
    """One idea per file, as long as the idea needs, readable in one sitting: none over 400 lines."""
    long = {name: n for name, path in _modules().items() if (n := len(open(path).readlines())) > 400}
    assert not long, f"modules over 400 lines: {long}; split them by concept"
