"""The engine giving malloc's free pages back after an optimizer step that raised the peak, on a CPU
(zeroshard.release_host_memory, core/heap.py), measured side by side: a rank's peak RSS above its
baseline and the median optimizer step, released and kept, in alternating runs of the same
configuration (gloo ranks here, through `zeroshard plan --verify`'s path). Kept, glibc's heap holes
stack up over the steps; released, the peak settles sooner and lower, for the page faults of the
steps after a release.

    python benchmarks/host_memory.py --steps 12 --rounds 2     # 5 configurations, ~7 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from types import SimpleNamespace

from plan_verify import CASES, MIB, SEQ, shape_and_cli
from zeroshard.app.plan_report import config_of
from zeroshard.app.plan_verify import _args, measured_worker, optimizer_step_s
from zeroshard.app.train import launch
from zeroshard.paper.plan_memory import Setup

PICKED = (0, 3, 9, 12, 13)  # plan_verify.py: medium stages 0 and 3, large stage 3 + checkpoints, LLaMA


def run(case: tuple, release: bool, nproc: int, steps: int, folder: str) -> tuple[float, float]:
    """(peak RSS growth in bytes, median optimizer step in s) of one run of a plan_verify case."""
    model, stage, precision, opt, par, ckpt, micro, acc = case
    _, cli = shape_and_cli(model, folder, folder, steps)
    plan = SimpleNamespace(setup=Setup(stage, precision, opt, par, ckpt, 1, micro, acc, SEQ))
    raw = config_of(plan, micro * acc * nproc, folder)
    raw.pop("train_batch_size")
    raw["zeroshard"] = {"release_host_memory": release}
    config = os.path.join(folder, "ds_config.json")
    with open(config, "w") as f:
        json.dump(raw, f)
    here = SimpleNamespace(device="cpu", ranks=nproc)
    result = launch(_args(cli, plan, here, folder, config), measured_worker)
    return float(result["rss_growth"]), optimizer_step_s(result["step_s_each"], acc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (default 12)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting per case (default 2)")
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--cases", type=int, nargs="*", default=PICKED, help="plan_verify.py cases (indices)")
    args = parser.parse_args()
    print("| model | configuration | peak released | kept | ratio | step released | kept | ratio |\n"
          "|---|---|---|---|---|---|---|---|")
    ratios = []
    for index in args.cases:
        case = CASES[index]
        got: dict[bool, list] = {True: [], False: []}
        for r in range(args.rounds):
            for release in (True, False) if r % 2 == 0 else (False, True):  # each goes first in turn
                with tempfile.TemporaryDirectory() as folder:
                    got[release].append(run(case, release, args.nproc, args.steps, folder))
        (peak_on, step_on), (peak_off, step_off) = (
            [statistics.median(x) for x in zip(*got[flag])] for flag in (True, False))
        ratios.append((peak_on / peak_off, step_on / step_off))
        name = Setup(*case[1:6], 1, *case[6:8], SEQ).name
        print(f"| {case[0]} | {name} | {peak_on / MIB:.1f} | {peak_off / MIB:.1f} | {peak_on / peak_off:.2f} "
              f"| {step_on:.3f} | {step_off:.3f} | {step_on / step_off:.2f} |", flush=True)
    peak, step = (statistics.median(r[i] for r in ratios) for i in (0, 1))
    print(f"\nreleased / kept, median over the configurations: peak {peak:.2f}, step {step:.2f}")


if __name__ == "__main__":
    main()
