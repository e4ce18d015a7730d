"""docs/architecture.md names the code as it is: every reference it makes to a module's function
or class (`core/prefetch.UnitOrder.before_forward`) and to a class's method (`FlatParam.unshard`)
resolves in the package, and every file it names exists, so the walk of one parameter through the
floors uses the code's own verbs."""
from __future__ import annotations

import importlib
import inspect
import os
import re

from helpers import ROOT

DOC = os.path.join(ROOT, "docs", "architecture.md")
SRC = os.path.join(ROOT, "src", "zeroshard")
# The classes the doc names bare (Class.method), and where they live.
CLASSES = {"FlatParam": "core.flat_param", "FlatGrad": "core.flat_grad", "Unit": "core.units",
           "UnitOrder": "core.prefetch", "GradientReducer": "core.reduce", "HostCopies": "offload.host",
           "Copier": "offload.host", "Watch": "comm.watch", "Comm": "comm.collectives",
           "Placeholders": "core.placeholders", "LossScaler": "core.precision",
           "DiskStore": "offload.nvme.store", "Engine": "engine.engine", "GradData": "core.flat_grad"}


def _resolve(module: str, chain: list[str]) -> bool:
    """Does zeroshard.<module>.<chain> exist? An attribute a class sets on its instances
    (`self.name = ...` in its source) counts."""
    obj = importlib.import_module(f"zeroshard.{module}")
    for name in chain:
        if not hasattr(obj, name):
            assigned = rf"self\.{name}\b[^\n]*="
            return inspect.isclass(obj) and re.search(assigned, inspect.getsource(obj)) is not None
        obj = getattr(obj, name)
    return True


def _references(text: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(module, attribute chain) for each `path/module.Name[.attr]` and `Class.attr` in backticks,
    and the .py files named by path."""
    refs, files = [], []
    for code in re.findall(r"`([^`\s]+)`", text):
        code = code.removesuffix("()")
        if m := re.fullmatch(r"([a-z_]+(?:/[a-z_]+)*)\.([A-Za-z_][\w.]*)", code):
            path, chain = m.group(1), m.group(2).split(".")
            if path.endswith("py") or chain == ["py"]:
                continue
            if os.path.isfile(os.path.join(SRC, path + ".py")):
                refs.append((path.replace("/", "."), chain))
        elif m := re.fullmatch(r"([A-Z]\w+)\.(\w+)", code):
            if m.group(1) in CLASSES:
                refs.append((CLASSES[m.group(1)], [m.group(1), m.group(2)]))
        if re.fullmatch(r"[a-z_]+(?:/[a-z_]+)+\.py", code):
            files.append(code)
    return refs, files


def test_the_architecture_doc_names_the_code_as_it_is():
    text = open(DOC).read()
    refs, files = _references(text)
    assert len(refs) > 30, "the doc's references were not found: has its form changed?"
    missing = [f"{m}.{'.'.join(c)}" for m, c in refs if not _resolve(m, c)]
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"
    absent = [f for f in files if not os.path.exists(os.path.join(SRC, f)) and
              not os.path.exists(os.path.join(ROOT, f))]
    assert not absent, f"docs/architecture.md names files that do not exist: {absent}"
    for verb in ("unshard", "reshard", "accumulate", "reduce", "offload", "step", "write back"):
        assert f"**{verb}**" in text, f"the walk of one parameter lost its verb '{verb}'"


def test_the_reference_check_catches_a_renamed_method():
    refs, _ = _references("`FlatParam.gather` and `core/prefetch.UnitOrder.before_forward`")
    assert [(m, c, _resolve(m, c)) for m, c in refs] == [
        ("core.flat_param", ["FlatParam", "gather"], False),
        ("core.prefetch", ["UnitOrder", "before_forward"], True)]
