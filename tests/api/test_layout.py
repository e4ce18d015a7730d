"""The architecture holds: no import cycle in src/ (imports inside functions and under TYPE_CHECKING
count), the app imports only zeroshard's public names, the paper model and zeroshard.parallel, the
core never imports the app, only comm.py calls torch.distributed's collectives, and the linter passes."""
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


def test_no_import_cycle():
    graph = _graph()
    assert len(graph) > 20 and "zeroshard.engine" in graph["zeroshard"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


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
        if module == "zeroshard.comm":
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


def test_every_module_is_short():
    """One idea per file, readable in one sitting: every module under 300 lines."""
    long = {name: n for name, path in _modules().items() if (n := len(open(path).readlines())) >= 300}
    assert not long, f"modules of 300 lines or more: {long}; split them by concept"
