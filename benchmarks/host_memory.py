"""A CPU rank's heap, measured side by side: the engine giving malloc's free pages back after an
optimizer step that raised the peak (zeroshard.release_host_memory, core/heap.py; a CPU's default)
against keeping them, and against the same release with glibc's mmap threshold fixed (the
MALLOC_MMAP_THRESHOLD_ tunable, set for the ranks only). Each: a rank's peak RSS above its baseline
and the median optimizer step, in rotated runs of the same configuration (gloo ranks here, through
`zeroshard plan --verify`'s path).

Why the third: glibc serves a large request from mmap (unmapped again when freed) until the first
such buffer is freed; then it raises its threshold to that buffer's size (up to 32 MiB), and every
buffer below it comes from the heap, where what is freed in a step leaves holes. Kept, the holes
stack up over the steps; released, they are handed back after each step that raised the peak, but
the holes within a step remain and the peak can still creep. A fixed threshold keeps buffers above
it out of the heap, for the page faults of mapping them afresh each time.

    python benchmarks/host_memory.py --steps 12 --rounds 2     # 5 configurations
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
THRESHOLD = 1 << 20  # bytes: buffers from 1 MiB up always mapped (glibc's own default starts at 128 KiB)
# setting: (release_host_memory, glibc's mmap threshold or None for its dynamic default)
SETTINGS = {"released": (True, None), "kept": (False, None), "threshold": (True, THRESHOLD)}


def run(case: tuple, setting: str, nproc: int, steps: int, folder: str) -> tuple[float, float]:
    """(peak RSS growth in bytes, median optimizer step in s) of one run of a plan_verify case."""
    model, stage, precision, opt, par, ckpt, micro, acc = case
    release, threshold = SETTINGS[setting]
    _, cli = shape_and_cli(model, folder, folder, steps)
    plan = SimpleNamespace(setup=Setup(stage, precision, opt, par, ckpt, 1, micro, acc, SEQ))
    raw = config_of(plan, micro * acc * nproc, folder)
    raw.pop("train_batch_size")
    raw["zeroshard"] = {"release_host_memory": release}
    config = os.path.join(folder, "ds_config.json")
    with open(config, "w") as f:
        json.dump(raw, f)
    here = SimpleNamespace(device="cpu", ranks=nproc)
    if threshold is not None:  # read by each rank's C library as it starts; this process's is set
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(threshold)
    try:
        result = launch(_args(cli, plan, here, folder, config), measured_worker)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    return float(result["rss_growth"]), optimizer_step_s(result["step_s_each"], acc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (default 12)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting per case (default 2)")
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--cases", type=int, nargs="*", default=PICKED, help="plan_verify.py cases (indices)")
    args = parser.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        parser.error("MALLOC_MMAP_THRESHOLD_ is set: unset it, the runs set it themselves where compared")
    names = list(SETTINGS)
    print("| model | configuration | peak released | kept | threshold | step released | kept | threshold |\n"
          "|---|---|---|---|---|---|---|---|")
    ratios = []
    for index in args.cases:
        case = CASES[index]
        got: dict[str, list] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # each goes first in turn
                with tempfile.TemporaryDirectory() as folder:
                    got[name].append(run(case, name, args.nproc, args.steps, folder))
        peak, step = ({n: statistics.median(x[i] for x in got[n]) for n in names} for i in (0, 1))
        ratios.append([peak[n] / peak["released"] for n in names[1:]]
                      + [step[n] / step["released"] for n in names[1:]])
        label = Setup(*case[1:6], 1, *case[6:8], SEQ).name
        print(f"| {case[0]} | {label} | " + " | ".join(f"{peak[n] / MIB:.1f}" for n in names) + " | "
              + " | ".join(f"{step[n]:.3f}" for n in names) + " |", flush=True)
    med = [statistics.median(r[i] for r in ratios) for i in range(4)]
    print(f"\nover released, median over the configurations: kept peak {med[0]:.2f}, step {med[2]:.2f}; "
          f"threshold peak {med[1]:.2f}, step {med[3]:.2f}")


if __name__ == "__main__":
    main()
