"""plan_verify.py's rows refitted offline: the calibration's block fit weighted two ways, and each
row's step predicted again with the refitted rates, beside what was measured. For a step-time miss
on a machine lent for minutes (a GPU): the calibration's block timings travel in plan_verify's
JSON, so weightings can be compared afterwards, anywhere, without running anything again.

- whole: each shape's error relative to the block's whole time (the calibration's own fit). Its
  prediction must equal the row's recorded one: the check that this script rebuilds the plan.
- remainder: relative to what the block's matmuls leave at the measured matrix rate (the fit before
  62a87ef; on a CPU in bf16 a remainder near 0 outweighed every other shape).

Everything else in the rows' rates is kept as measured (on a CPU the engine's reference terms were
fitted against the calibration's own rates, so there a refit row is approximate; on a GPU they are 0).

    python benchmarks/plan_refit.py benchmarks/out/gpu_checks/plan_verify.json
    python benchmarks/plan_refit.py plan_verify.json --nproc 2      # a CPU run's rows (its gloo ranks)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_verify import shape_and_cli  # noqa: E402  (the benchmark's own models)

from zeroshard.app.plan_calibrate import GPU_SHAPES, SEQ, block_rows, fit, rates_of_fit  # noqa: E402
from zeroshard.paper.plan_memory import Setup  # noqa: E402
from zeroshard.paper.plan_time import Rates, step_time  # noqa: E402

WEIGHTINGS = ("whole", "remainder")


def refit(calibration: dict, weighting: str) -> dict:
    """The block's fitted rates (layer_fixed, elementwise, weights) from the calibration's kept
    timings, in the given weighting."""
    shapes = [tuple(b[:2]) for b in calibration["blocks"]]
    seq = SEQ["cuda" if shapes == GPU_SHAPES else "cpu"]
    rows, seconds, matmuls = block_rows([b[:3] for b in calibration["blocks"]], calibration["matmul"], seq)
    if weighting == "whole":
        return rates_of_fit(fit(rows, seconds, matmuls))
    # (fit with nothing known is least squares in the relative error of what it is given)
    return rates_of_fit(fit(rows, [max(s - m, 1e-6) for s, m in zip(seconds, matmuls)]))


def predicted(row: dict, rates: dict, nproc: int, folder: str) -> float:
    """The row's step with these rates, as the planner weighs it."""
    setup = Setup(**{f.name: row["config"][f.name] for f in dataclasses.fields(Setup)})
    shape, _ = shape_and_cli(row["model"], folder, folder, 1, setup.seq)
    return step_time(shape, setup, nproc, Rates(**{**row["rates"], **rates})).total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="plan_verify.py --json's file")
    parser.add_argument("--nproc", type=int, help="the run's ranks (default: 1 for a GPU's rows, else 2)")
    args = parser.parse_args()
    with open(args.json) as f:
        rows = [r for r in json.load(f) if "blocks" in r.get("calibration", {})]
    if not rows:
        raise SystemExit(f"{args.json}: no row keeps its calibration's block timings (plan_verify.py at "
                         f"0263b9e or later writes them)")
    errors: dict[str, list[float]] = {w: [] for w in WEIGHTINGS}
    print(f"{'model':8} {'configuration':45} {'measured':>9} {'recorded':>9} "
          + " ".join(f"{w:>10}" for w in WEIGHTINGS))
    with tempfile.TemporaryDirectory() as folder:
        for row in rows:
            gpu = row["measured"]["device_peak_bytes"] is not None
            nproc = args.nproc or (1 if gpu else 2)
            measured = row["measured"]["step_s"]
            steps = {w: predicted(row, refit(row["calibration"], w), nproc, folder) for w in WEIGHTINGS}
            for w, s in steps.items():
                errors[w].append(abs(measured / s - 1))
            recorded = row["predicted"]["step_s"]
            print(f"{row['model']:8} {row['config']['name']:45} {measured:9.3f} {recorded:9.3f} "
                  + " ".join(f"{steps[w]:10.3f}" for w in WEIGHTINGS))
    for w in WEIGHTINGS:
        e = errors[w]
        print(f"{w}: within 25% for {sum(x <= 0.25 for x in e)} of {len(e)}, median error "
              f"{statistics.median(e):.1%}, worst {max(e):.1%}")


if __name__ == "__main__":
    main()
