"""Where a step's time goes: forward, backward, optimizer step and CPU time, DDP beside zeroshard.

`zeroshard compare`'s world (its model, data and side-by-side turns), but each step is split into
its three phases, and the process's CPU time (every thread: compute and gloo's) is taken beside the
wall time. On a machine with as many cores as ranks, communication cannot hide behind compute: a
stage whose CPU time exceeds DDP's pays about that much in wall time.

Extra configurations of stage 3 (or any stage) are named on the command line:

    python benchmarks/step_phases.py                          # DDP, stage 0, stage 3
    python benchmarks/step_phases.py --runs 3:reuse=reuse.json 3:nopf=nopf.json

Each phase is the slowest rank's; the median over the steps after 3 warm-up turns. `x ddp` is the
median over turns of each step's total over DDP's in the same turn (as compare pairs them).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import zeroshard
from zeroshard.app.data import Batches, load_corpus
from zeroshard.app.gpt import lm_loss
from zeroshard.app.train import TrainArgs, build_engine, data_rank, launch, logits_of, start_rank, train_batch

PHASES = ("forward", "backward", "step", "cpu", "total")
WARMUP = 3


def _timed_step(engine, x, y) -> tuple[float, ...]:
    cpu, start = time.process_time(), time.perf_counter()
    loss = lm_loss(logits_of(engine(x)), y)
    forward = time.perf_counter()
    engine.backward(loss)
    backward = time.perf_counter()
    engine.step()
    end = time.perf_counter()
    return tuple(1000 * t for t in (forward - start, backward - forward, end - backward,
                                    time.process_time() - cpu, end - start))


def _rank(args: TrainArgs, runs: list[tuple[str, int, str | None]]) -> dict[str, list[tuple[float, ...]]]:
    start_rank(args)
    engines = {"ddp": build_engine(replace(args, stage=0, ddp=True))}
    for name, stage, config in runs:
        engines[name] = build_engine(replace(args, stage=stage, ddp=False, config=config))
    comm = zeroshard.Comm()
    data = Batches(load_corpus(None), args.seq_len)
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in engines}
    for step in range(args.steps):
        names = list(engines)[step % len(engines):] + list(engines)[:step % len(engines)]
        for name in names:  # rotated, as compare does
            engine = engines[name]
            x, y = train_batch(data, args, step, *data_rank(engine), engine.device)
            comm.barrier()
            times[name].append(_timed_step(engine, x, y))
    every = zeroshard.gather_objects(times)
    return {name: [tuple(max(r[name][i][j] for r in every) for j in range(len(PHASES)))
                   for i in range(WARMUP, args.steps)] for name in times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="*", default=["0:stage 0", "3:stage 3"],
                   help="STAGE:NAME[=CONFIG.json] for each zeroshard run (default: stages 0 and 3)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    runs = []
    for spec in a.runs:
        stage, _, rest = spec.partition(":")
        name, _, config = rest.partition("=")
        runs.append((name, int(stage), config or None))
    args = TrainArgs(nproc=a.nproc, steps=a.steps, quiet=True, sample_tokens=0, resume=False,
                     out="/tmp/zeroshard-step-phases")
    result = launch(args, _rank, runs)
    print(f"{a.nproc} ranks, the compare GPT ({args.size}), {a.steps - WARMUP} timed turns; ms, slowest rank")
    print(f"{'run':14s}" + "".join(f"{h:>10s}" for h in PHASES) + f"{'x ddp':>8s}")
    for name, rows in result.items():
        medians = [statistics.median(column) for column in zip(*rows)]
        paired = statistics.median(r[-1] / d[-1] for r, d in zip(rows, result["ddp"]))
        print(f"{name:14s}" + "".join(f"{m:10.1f}" for m in medians) + f"{paired:8.3f}")


if __name__ == "__main__":
    main()
