"""step_time.py's report: the timing table (ratios to DDP), loss agreement, bytes sent, and
zeroshard's model states and traffic beside the paper's formulas; and the bar chart."""
from __future__ import annotations

import argparse
import os
import statistics

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def report(args: argparse.Namespace, timing: dict, rss: dict) -> str:
    names, n, mib = args.impls, args.nproc, 2**20
    med = {m: statistics.median(timing["times"][i][args.warmup:]) * 1e3 for i, m in enumerate(names)}
    loss = {m: timing["losses"][i] for i, m in enumerate(names)}
    ref = "ddp" if "ddp" in names else names[0]
    lines = [f"GPT {args.layers} layers x {args.width}, seq {args.seq}, batch {args.batch}/rank, fp32 AdamW, "
             f"{n} ranks x 1 thread, gloo; median of {args.steps} steps after {args.warmup} warm-up, "
             "interleaved", "",
             f"| implementation | median step (ms) | x {ref} | final loss | max abs loss diff vs {ref} | "
             "peak RSS/rank (MiB) | RSS added/rank (MiB) | sent/step at the API (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    wire = timing.get("wire", {})
    diff = {m: max(abs(a - b) for a, b in zip(loss[m], loss[ref])) for m in names}  # over all steps
    for m in names:
        r = rss.get(m)
        mem = f"{r['peak']:.0f} | {r['peak'] - r['base']:.0f}" if r else "- | -"
        sent = f"{sum(wire[m].values()) / mib:.2f}" if wire.get(m) else "-"
        lines.append(f"| {m} | {med[m]:.1f} | {med[m] / med[ref]:.2f} | {loss[m][-1]:.6f} | {diff[m]:.1e} "
                     f"| {mem} | {sent} |")
    worst = max(diff.values())
    lines += ["", f"losses agree to 1e-4: {'YES' if worst <= 1e-4 else 'NO'} (worst {worst:.1e})", "",
              "sent/step: bytes per rank through torch.distributed's Python API in one warm step, paper "
              "convention (all-reduce 2x); '-': nothing seen there (DDP's C++ reducer)"]
    if timing["zeroshard"]:
        lines += ["", "| zeroshard | stage | Ψ | model states (MiB) | paper (MiB) | traffic/step (MiB) "
                  "| paper (MiB) |",
                  "|---|---|---|---|---|---|---|"]
        for m, z in timing["zeroshard"].items():
            s, psi = int(m.removesuffix("+compiled")[-1]), z["psi"]
            paper = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[s]
            lines.append(f"| {m} | {s} | {psi:,} | {z['model_states'] / mib:.2f} | {paper / mib:.2f} | "
                         f"{sum(z['traffic'].values()) / mib:.2f} | "
                         f"{(3 if s == 3 else 2) * 4 * psi / mib:.2f} |")
    plot(med, ref, os.path.join(OUT, "step_time.png"), lines[0])
    return "\n".join(lines)


def plot(med: dict[str, float], ref: str, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.bar(list(med), list(med.values()),
           color=["tab:blue" if m.startswith("zeroshard") else "tab:gray" for m in med])
    ax.axhline(med[ref], color="black", linewidth=0.8, linestyle="--", label=f"{ref} {med[ref]:.0f} ms")
    ax.set(ylabel="median step time (ms)")
    ax.set_title(title, fontsize=8)
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.savefig(path, dpi=120, bbox_inches="tight")
