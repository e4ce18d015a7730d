"""`zeroshard compare`: the same model and data trained with plain torch (DDP across ranks) and with
each ZeRO stage, reported side by side (the seed replication's experiment).

Every run starts a fresh set of ranks. Runs are interleaved in rounds (DDP, stage 0, ..., stage 3,
then again), and each time shown is the median over rounds of that run's median step. The ratio to
the baseline is the median over rounds of each round's own ratio: a machine that slows down for a
while slows a round's runs alike, and that round's ratio keeps little of it. Memory is
shown where ZeRO's saving is visible: model-state bytes per rank beside the paper's formula, and peak
resident memory *above the process's own baseline* (taken before the model is built; the runtime
alone is ~450 MiB), plus the GPU's peak allocation on cuda.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import replace
from typing import Any

from zeroshard.paper import BYTES_PER_PARAM, paper_model_state_bytes

from .report import MIB, comparison_table, plot_comparison
from .train import TrainArgs, launch


def compare(args: TrainArgs, stages: list[int], rounds: int = 3) -> list[dict[str, Any]]:
    baseline = "ddp" if args.nproc > 1 else "torch"  # one rank: plain torch, no DDP wrapper
    runs = [(baseline, 0, True)] + [(f"stage {s}", s, False) for s in stages]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in runs}
    for round_ in range(1, rounds + 1):
        for name, stage, ddp in runs:
            print(f"round {round_}/{rounds}: {name} ...", flush=True)
            results[name].append(launch(replace(
                args, stage=stage, ddp=ddp, quiet=True, sample_tokens=0, resume=False,
                out=os.path.join(args.out, name.replace(" ", "")))))
    rows = [_row(name, stage, results[name], args) for name, stage, _ in runs]
    base = rows[0]["step_ms_each"]
    for row in rows:  # paired by round: a round that ran slow is slow for the baseline too
        row["vs_baseline"] = statistics.median(t / b for t, b in zip(row["step_ms_each"], base))
    print(comparison_table(rows, rounds, baseline, args.device == "cuda"))
    chart = os.path.join(args.out, "compare.png")
    plot_comparison(rows, chart)
    print(f"chart: {chart}")
    return rows


def _row(name: str, stage: int, runs: list[dict[str, Any]], args: TrainArgs) -> dict[str, Any]:
    """One implementation's line: median step time over rounds; memory and losses of the last round
    (they do not depend on the round)."""
    last = runs[-1]
    p, g, k = BYTES_PER_PARAM[args.precision]
    return {"name": name, "step_ms": statistics.median(r["step_ms"] for r in runs),
            "step_ms_each": [r["step_ms"] for r in runs],
            "model_states_mib": last["model_states"] / MIB,
            "paper_mib": paper_model_state_bytes(last["psi"], args.nproc, stage, p, g, k) / MIB,
            "rss_growth_mib": last["rss_growth"] / MIB,
            "gpu_peak_mib": last["gpu_peak"] / MIB,
            "train_loss": last["train_loss"], "val_loss": last["val_loss"]}
