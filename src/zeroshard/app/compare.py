"""`zeroshard compare`: the same model and data trained with plain torch (DDP across ranks) and with
each ZeRO stage, reported side by side (the seed replication's experiment).

Two kinds of run, because time and memory need opposite conditions:

* **Time: side by side, in one world.** Every implementation is built in the same ranks and they
  take turns step by step (DDP, stage 0, ..., stage 3, then again, the order rotated each step).
  A slow spell of the machine, or a launch that lands badly on the cores, slows all of them alike;
  separate launches of one configuration differed by 30% here, and rounds of separate launches
  could not average that out. Each step counts at the slowest rank (from a barrier to the end of
  the optimizer step). `rounds` such worlds run one after another: the time shown is the median
  over rounds of each round's median step, the ratio the median over every step of its ratio to
  the baseline's step in the same turn.
* **Memory and loss: each implementation alone, in a fresh world** (train's worker): model-state
  bytes per rank beside the paper's formula, and peak resident memory *above the process's own
  baseline* (taken before the model is built; the runtime alone is ~450 MiB), plus the GPU's peak
  allocation on cuda.

The side-by-side world holds every implementation's model states at once (at 2 ranks, about 3.9x
DDP's alone); narrow it with --stages for a model near the machine's memory.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from typing import Any

import zeroshard
from zeroshard.paper import paper_model_state_bytes

from .data import Batches, load_corpus
from .report import MIB, comparison_table, plot_comparison
from .train import TrainArgs, build_engine, data_rank, launch, start_rank, train_batch, train_step

Run = tuple[str, int, bool]  # (name, stage, DDP baseline)


def compare(args: TrainArgs, stages: list[int], rounds: int = 3) -> list[dict[str, Any]]:
    baseline = "ddp" if args.nproc > 1 else "torch"  # one rank: plain torch, no DDP wrapper
    runs: list[Run] = [(baseline, 0, True)] + [(f"stage {s}", s, False) for s in stages]
    names = ", ".join(name for name, _, _ in runs)
    timings = []
    for round_ in range(1, rounds + 1):
        print(f"round {round_}/{rounds}: {names}, side by side ...", flush=True)
        timings.append(launch(replace(args, quiet=True, sample_tokens=0, resume=False, save=False),
                              time_side_by_side, runs))
    alone = {}
    for name, stage, ddp in runs:
        print(f"alone: {name} (memory, loss) ...", flush=True)
        alone[name] = launch(replace(args, stage=stage, ddp=ddp, quiet=True, sample_tokens=0, resume=False,
                                     save=False))  # compare writes only what it reports: its chart
    rows = [_row(name, stage, [t[name] for t in timings], alone[name], args) for name, stage, _ in runs]
    for row in rows:  # paired by turn: a spell that slowed the baseline's step slowed this one too
        row["vs_baseline"] = statistics.median(
            a / b for t in timings for a, b in zip(t[row["name"]], t[baseline]))
    print(comparison_table(rows, rounds, baseline, args.device == "cuda"))
    if args.precision != "fp32":
        print(f"{baseline}: torch AMP (fp32 weights, {args.precision} autocast), plain torch's mixed "
              f"precision; its losses differ from ZeRO's {args.precision} weights with fp32 masters in the "
              f"last digits")
    chart = os.path.join(args.out, "compare.png")
    plot_comparison(rows, chart)
    print(f"chart: {chart}")
    return rows


def time_side_by_side(args: TrainArgs, runs: list[Run]) -> dict[str, list[float]]:
    """Rank worker: build every implementation in this world, then train them in turns, one step
    each, for args.steps turns. Returns each one's step times in ms (the slowest rank's), the first
    (warm-up) turn left out."""
    start_rank(args)
    engines = {name: build_engine(replace(args, stage=stage, ddp=ddp)) for name, stage, ddp in runs}
    comm = zeroshard.Comm()  # (its barrier: the turns start together)
    data = Batches(load_corpus(args.data or None), args.seq_len)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(args.steps):
        order = list(engines)[step % len(engines):] + list(engines)[:step % len(engines)]
        for name in order:  # rotated: no implementation always follows the same one
            x, y = train_batch(data, args, step, *data_rank(engines[name]), engines[name].device)  # as alone
            comm.barrier()
            start = time.perf_counter()
            train_step(engines[name], x, y)
            times[name].append(1000 * (time.perf_counter() - start))
    slowest = {name: [max(column) for column in zip(*(r[name] for r in zeroshard.gather_objects(times)))]
               for name in times}
    return {name: t[1:] or t for name, t in slowest.items()}


def _row(name: str, stage: int, timed: list[list[float]], alone: dict[str, Any],
         args: TrainArgs) -> dict[str, Any]:
    """One implementation's line: the median over rounds of each round's median step (side by side);
    memory and losses from its run alone."""
    p, g, k = alone["bytes_per_param"]
    each = [statistics.median(t) for t in timed]
    return {"name": name, "step_ms": statistics.median(each), "step_ms_each": each,
            "model_states_mib": alone["model_states"] / MIB,
            "paper_mib": paper_model_state_bytes(alone["psi"], args.nproc, stage, p, g, k) / MIB,
            "rss_growth_mib": alone["rss_growth"] / MIB,
            "gpu_peak_mib": alone["gpu_peak"] / MIB,
            "train_loss": alone["train_loss"], "val_loss": alone["val_loss"]}
