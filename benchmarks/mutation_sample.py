"""Sampled mutation testing with Cosmic Ray: bugs nobody planted, over the core, judged by the tests
that run the mutated line.

    pip install -e ".[mutation]"                        # cosmic-ray and coverage
    python benchmarks/mutation_sample.py --sample 60
    python benchmarks/mutation_sample.py --list         # the candidate mutants, counted by module

Why Cosmic Ray (not mutmut): the test ranks fork from a fork server that imported zeroshard once
(tests/helpers/spawn.py). Cosmic Ray's mutants are source rewrites (parso) applied to a file on
disk, so each mutant here is written into a fresh copy of the tree and the tests run in new
processes that import the copy: every rank, and the fork server, sees it. mutmut 3 switches mutants
at run time through an environment variable read inside copied "trampolines", which a fork server
started for an earlier mutant (with its environment) would not see: survivors would be false.

How it goes:
1. Coverage, once per test tree: each test file runs under coverage in every process it starts
   (a .pth hook in the venv while measuring; rank processes included), giving, per line of the
   core, the test files that execute it (cached by a hash of src/ and tests/).
2. The candidates: every mutation Cosmic Ray's core operators make in the modules of CORE (its
   VariableInserter/VariableReplacer, which need settings, are left out). A seeded random sample
   of them is drawn (the same seed and tree, the same sample).
3. Each sampled mutant is applied to a copy of the tree and the test files covering its line run
   in it, fastest first, stopping at the first failure, within --timeout. A mutant no test covers
   survives without a run.
4. Verdicts, as benchmarks/mutations.py judges (a tolerance check must miss by 5x to count):
   killed, survived, timed out, or equivalent where benchmarks/mutation_decisions.json says so,
   with the reason. The report lists every survivor and every decision, and the kill rate over the
   non-equivalent mutants.
A benchmark, not part of CI; its current report is in benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import site
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import mutations
from mutations import ROOT, _copy_tree, run_tests, verdict

CORE = ["core/partition.py", "core/flat_param.py", "core/flat_grad.py", "comm/buckets.py", "core/reduce.py",
        "core/step.py", "core/precision.py", "core/nonfinite.py", "core/optim.py", "core/gather_together.py",
        "checkpoint/load.py", "offload/host.py", "offload/nvme/store.py", "offload/nvme/stream.py"]
SKIPPED_OPERATORS = ("core/VariableInserter", "core/VariableReplacer")  # need per-project settings
DECISIONS = os.path.join(ROOT, "benchmarks", "mutation_decisions.json")
CACHE = os.path.join(ROOT, "benchmarks", "out", "coverage_map.json")
TREE = ROOT  # what is measured and mutated: a snapshot of the repository taken at the start (main)


@dataclass(frozen=True)
class Mutant:
    path: str        # under src/zeroshard
    operator: str
    occurrence: int  # the operator's n-th mutation in the file (Cosmic Ray's numbering)
    line: int
    text: str        # the source line, for the report (and to notice a decision gone stale)

    @property
    def key(self) -> str:
        return f"{self.path}:{self.operator}:{self.occurrence}"


# ---- candidates -----------------------------------------------------------------------------------
def candidates() -> list[Mutant]:
    """Every mutation of Cosmic Ray's operators in CORE, in a fixed order."""
    from cosmic_ray.ast import Visitor, get_ast
    from cosmic_ray.plugins import get_operator, operator_names

    class Positions(Visitor):
        def __init__(self, operator) -> None:
            self.operator, self.lines = operator, []

        def visit(self, node):
            for _ in self.operator.mutation_positions(node):
                self.lines.append(node.start_pos[0])
            return node

    found = []
    for path in CORE:
        source = open(os.path.join(TREE, "src", "zeroshard", path)).read()
        lines = source.splitlines()
        for name in sorted(operator_names()):
            if name.startswith(SKIPPED_OPERATORS) or not name.startswith("core/"):
                continue
            visitor = Positions(get_operator(name)())
            visitor.walk(get_ast(source))
            found += [Mutant(path, name, i, line, lines[line - 1].strip())
                      for i, line in enumerate(visitor.lines)]
    return found


def mutated_source(m: Mutant, tree: str) -> str:
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator
    source = open(os.path.join(tree, "src", "zeroshard", m.path)).read()
    mutated = mutate_code(source, get_operator(m.operator)(), m.occurrence)
    if mutated is None:
        raise SystemExit(f"{m.key} applies to nothing: the candidates are stale")
    return mutated


# ---- which tests run which line -----------------------------------------------------------------------
def _tree_hash() -> str:
    digest = hashlib.sha256()
    for top in ("src", "tests"):
        for folder, _, files in sorted(os.walk(os.path.join(TREE, top))):
            for name in sorted(files):
                if name.endswith(".py"):
                    digest.update(name.encode())
                    digest.update(open(os.path.join(folder, name), "rb").read())
    return digest.hexdigest()[:16]


def _test_files() -> list[str]:
    out = []
    for folder, _, files in sorted(os.walk(os.path.join(TREE, "tests"))):
        out += [os.path.relpath(os.path.join(folder, f), TREE) for f in sorted(files)
                if f.startswith("test_") and f.endswith(".py")]
    return [f for f in out if "tests/cuda/" not in f]


def coverage_map(refresh: bool = False) -> dict:
    """{"files": {test file: seconds}, "lines": {"core/x.py:LINE": [test files]}} for this tree."""
    tree = _tree_hash()
    if not refresh and os.path.exists(CACHE):
        cached = json.load(open(CACHE))
        if cached.get("tree") == tree:
            return cached
    import coverage
    hook = os.path.join(site.getsitepackages()[0], "zz_zeroshard_mutation_coverage.pth")
    work = tempfile.mkdtemp(prefix="zeroshard-cov-")
    result: dict = {"tree": tree, "files": {}, "lines": {}}
    try:
        with open(hook, "w") as f:  # every Python process of the venv measures itself while it exists
            f.write("import os, coverage; "
                    "os.environ.get('COVERAGE_PROCESS_START') and coverage.process_startup()\n")
        for i, test in enumerate(_test_files()):
            data = os.path.join(work, f"t{i}")
            os.makedirs(data)
            rc = os.path.join(data, "rc")
            with open(rc, "w") as f:
                f.write(f"[run]\nparallel = True\nsource = zeroshard\ndata_file = {data}/.coverage\n")
            start = time.time()
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=TREE,
                           env={**os.environ, "COVERAGE_PROCESS_START": rc,
                                "PYTHONPATH": os.path.join(TREE, "src")}, capture_output=True)
            result["files"][test] = round(time.time() - start, 1)
            cov = coverage.Coverage(config_file=rc)
            cov.combine([data], keep=False)
            measured = cov.get_data()
            for path in measured.measured_files():
                rel = os.path.relpath(path, os.path.join(TREE, "src", "zeroshard"))
                if rel in CORE:
                    for line in measured.lines(path) or []:
                        result["lines"].setdefault(f"{rel}:{line}", []).append(test)
            print(f"coverage {i + 1}/{len(_test_files())}: {test} ({result['files'][test]} s)", flush=True)
    finally:
        if os.path.exists(hook):
            os.remove(hook)
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(CACHE), exist_ok=True)
    json.dump(result, open(CACHE, "w"))
    return result


# ---- running a mutant -------------------------------------------------------------------------------
def run_mutant(m: Mutant, tests: list[str], timeout: float) -> dict:
    if not tests:
        return {"verdict": "survived", "how": "no test runs this line", "seconds": 0.0, "tests": 0}
    dest = tempfile.mkdtemp(prefix="zeroshard-mutant-")
    try:
        _copy_tree(dest)
        mutated = mutated_source(m, dest)  # (read before the file is opened for writing)
        with open(os.path.join(dest, "src", "zeroshard", m.path), "w") as f:
            f.write(mutated)
        result = run_tests(dest, ("-x", *tests), timeout)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
    if result["outcome"] == "hung":
        return {"verdict": "timed out", "how": f"past {timeout:g} s", "seconds": result["seconds"],
                "tests": len(tests)}
    caught, how = verdict(result)
    return {"verdict": "killed" if caught == "CAUGHT" else "survived", "how": how,
            "seconds": round(result["seconds"], 1), "tests": len(tests)}


def report(rows: list[dict], decisions: dict) -> str:
    counts = {v: sum(r["verdict"] == v for r in rows)
              for v in ("killed", "survived", "timed out", "equivalent")}
    judged = len(rows) - counts["equivalent"]
    rate = (counts["killed"] + counts["timed out"]) / judged if judged else 0.0
    lines = [f"{len(rows)} mutants: {counts['killed']} killed, {counts['survived']} survived, "
             f"{counts['timed out']} timed out, {counts['equivalent']} equivalent; killed (or timed out) "
             f"{100 * rate:.1f}% of the {judged} non-equivalent", "",
             "| mutant | line | verdict | how |", "|---|---|---|---|"]
    for r in rows:
        if r["verdict"] != "killed":
            lines.append(f"| `{r['key']}` | `{r['text'][:60]}` | {r['verdict']} | "
                         f"{decisions.get(r['key'], {}).get('why', r['how'])} |")
    return "\n".join(lines)


def snapshot(rev: str) -> str:
    """The tree at commit `rev`: the run measures and mutates it, not the working tree, which may
    change while a run of hours goes on."""
    global TREE
    TREE = tempfile.mkdtemp(prefix="zeroshard-snapshot-")
    archive = subprocess.run(["git", "archive", rev, "src", "tests", "benchmarks", "examples", "docs",
                              "pyproject.toml", "README.md"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", TREE], input=archive, check=True)
    mutations.ROOT = TREE  # _copy_tree copies each mutant's tree from here
    return TREE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=60, help="mutants drawn (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1500, help="seconds per mutant (default 1500)")
    parser.add_argument("--list", action="store_true", help="count the candidates by module and stop")
    parser.add_argument("--only", nargs="*", help="mutant keys to run (path:operator:occurrence)")
    parser.add_argument("--refresh-coverage", action="store_true")
    parser.add_argument("--rejudge", action="store_true",
                        help="take --out's rows and judge its survivors again at --rev (tests added since): "
                             "equivalents from the decisions file, the others re-run")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in --out (same seed, sample and rev) and run the rest")
    parser.add_argument("--rev", default="HEAD", help="the commit to mutate (default HEAD)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "mutation_sample.json"))
    args = parser.parse_args()
    try:
        snapshot(args.rev)
        sample_and_run(args)
    finally:
        shutil.rmtree(TREE, ignore_errors=True)


def rejudge(args: argparse.Namespace, by_key: dict, decisions: dict) -> None:
    """The earlier run's survivors judged again: a decided equivalent is marked so (with why), any
    other survivor runs again at --rev against the test files that covered its line then plus every
    test file changed since (the coverage map of the earlier tree, not measured again: an unchanged
    test file covers what it did); the row says at which revision."""
    earlier = json.load(open(args.out))
    covered = json.load(open(CACHE))
    changed = subprocess.run(["git", "diff", "--name-only", earlier["rev"], args.rev, "--", "tests"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    changed = [t for t in changed if os.path.basename(t).startswith("test_") and os.path.exists(
        os.path.join(TREE, t)) and "tests/cuda/" not in t]
    for row in earlier["rows"]:
        if row["verdict"] != "survived":
            continue
        decided = decisions.get(row["key"])
        if decided and decided["verdict"] == "equivalent" and decided.get("text") == row["text"]:
            row.update(verdict="equivalent", how=decided["why"])
            continue
        m = by_key[row["key"]]
        tests = sorted(set(covered["lines"].get(f"{m.path}:{m.line}", [])) | set(changed))
        row.update(run_mutant(m, tests, args.timeout), judged_at=args.rev)
        print(f"{row['verdict']:10s} {row['key']}  {row['how'][:120]}", flush=True)
    json.dump(earlier, open(args.out, "w"), indent=1)
    print(report(earlier["rows"], decisions))


def resumed_rows(args: argparse.Namespace) -> list[dict]:
    """The rows of an earlier run of the same draw, when --resume asks for them."""
    if not (args.resume and os.path.exists(args.out)):
        return []
    earlier = json.load(open(args.out))
    if (earlier["seed"], earlier["sample"], earlier["rev"]) != (args.seed, args.sample, args.rev):
        raise SystemExit(f"{args.out} holds another draw (seed {earlier['seed']}, "
                         f"sample {earlier['sample']}, "
                         f"rev {earlier['rev']}): drop --resume or pass the same ones")
    return earlier["rows"]


def sample_and_run(args: argparse.Namespace) -> None:
    everything = candidates()
    if args.list:
        for path in CORE:
            print(f"{sum(m.path == path for m in everything):5d}  {path}")
        print(f"{len(everything):5d}  in all")
        return
    sample = sorted(random.Random(args.seed).sample(everything, min(args.sample, len(everything))),
                    key=lambda m: (m.path, m.line, m.operator, m.occurrence))
    if args.only:
        sample = [m for m in everything if m.key in set(args.only)]
    decisions = json.load(open(DECISIONS)) if os.path.exists(DECISIONS) else {}
    if args.rejudge:
        return rejudge(args, {m.key: m for m in everything}, decisions)
    covered = coverage_map(args.refresh_coverage)
    rows = resumed_rows(args)
    done = {r["key"] for r in rows}
    for i, m in enumerate(sample):
        if m.key in done:
            continue
        tests = sorted(set(covered["lines"].get(f"{m.path}:{m.line}", [])), key=lambda t: covered["files"][t])
        decided = decisions.get(m.key)
        if decided and decided["verdict"] == "equivalent":
            if decided.get("text") != m.text:
                raise SystemExit(f"the decision on {m.key} was made for `{decided.get('text')}`, now the "
                                 f"line is `{m.text}`: look again and update {DECISIONS}")
            result = {"verdict": "equivalent", "how": decided["why"], "seconds": 0.0, "tests": len(tests)}
        else:
            result = run_mutant(m, tests, args.timeout)
        rows.append({**asdict(m), "key": m.key, **result})
        print(f"{i + 1:3d}/{len(sample)} {result['verdict']:10s} {result['seconds']:7.1f} s  {m.key}  "
              f"`{m.text[:70]}`  {result['how'][:120]}", flush=True)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        json.dump({"seed": args.seed, "sample": args.sample, "rev": args.rev, "rows": rows},
                  open(args.out, "w"), indent=1)
    print()
    print(report(rows, decisions))


if __name__ == "__main__":
    main()
