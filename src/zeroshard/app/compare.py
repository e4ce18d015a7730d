"""`zeroshard compare`: the same model and data trained with torch DDP and with each ZeRO stage,
one fresh set of ranks per run, reported side by side (the seed replication's experiment)."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from zeroshard.paper import BYTES_PER_PARAM, paper_model_state_bytes

from .report import MIB, comparison_table, plot_comparison
from .train import TrainArgs, launch


def compare(args: TrainArgs, stages: list[int]) -> list[dict[str, Any]]:
    rows = []
    for stage, ddp in [(0, True)] + [(s, False) for s in stages]:  # DDP holds what stage 0 holds
        name = "ddp" if ddp else f"stage {stage}"
        print(f"running {name} ...", flush=True)
        result = launch(replace(args, stage=stage, ddp=ddp, quiet=True, sample_tokens=0, resume=False,
                                out=os.path.join(args.out, name.replace(" ", ""))))
        p, g, k = BYTES_PER_PARAM[args.precision]
        rows.append({"name": name, "step_ms": result["step_ms"],
                     "model_states_mib": result["model_states"] / MIB,
                     "paper_mib": paper_model_state_bytes(result["psi"], args.nproc, stage, p, g, k) / MIB,
                     "peak_rss_mib": result["peak_rss"] / MIB,
                     "train_loss": result["train_loss"], "val_loss": result["val_loss"]})
    print(comparison_table(rows))
    chart = os.path.join(args.out, "compare.png")
    plot_comparison(rows, chart)
    print(f"chart: {chart}")
    return rows
