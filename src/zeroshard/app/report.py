"""What the main job shows at the end: memory and traffic beside the paper, the loss plot, samples."""
from __future__ import annotations

import os
from typing import Any

from zeroshard.paper import BYTES_PER_PARAM, paper_model_state_bytes

MIB = 2**20


def memory_table(per_rank: list[dict[str, int]], psi: int, stage: int, precision: str) -> list[str]:
    """Model-state bytes per rank by category, beside the paper's formula for this stage and N."""
    p, g, k = BYTES_PER_PARAM[precision]
    formula = paper_model_state_bytes(psi, len(per_rank), stage, p, g, k)
    header = ("rank", "params", "grads", "optimizer", "states", "paper")
    lines = [f"{header[0]:>6} " + " ".join(f"{h:>10}" for h in header[1:]) + "  (MiB)"]
    for rank, s in enumerate(per_rank):
        lines.append(f"{rank:>6} {s['params'] / MIB:>10.2f} {s['grads'] / MIB:>10.2f} "
                     f"{s['optimizer'] / MIB:>10.2f} "
                     f"{s['model_states'] / MIB:>10.2f} {formula / MIB:>10.2f}")
    return lines


def traffic_line(step_bytes: int, psi: int, stage: int, precision: str) -> str:
    """Bytes moved in the last step beside the paper's 2Ψ (stages 0-2) or 3Ψ (stage 3) elements."""
    element = BYTES_PER_PARAM[precision][0]
    factor = 3 if stage == 3 else 2
    return (f"traffic per step: {step_bytes / MIB:.2f} MiB (paper: {factor}Ψ x {element} bytes = "
            f"{factor * psi * element / MIB:.2f} MiB)")


def plot_losses(train: list[float], val: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(train) + 1), train, label="train (mean over ranks)")
    ax.scatter([len(train)], [val], color="C3", zorder=3, label=f"validation {val:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title("zeroshard train")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_comparison(rows: list[dict[str, Any]], path: str) -> None:
    """Bars of step time and peak memory per rank for each run of `zeroshard compare`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, label in zip(axes, ["step_ms", "model_states_mib", "peak_rss_mib"],
                              ["median step (ms)", "model states per rank (MiB)", "peak RSS per rank (MiB)"]):
        ax.bar(names, [r[key] for r in rows], color=["C7"] + ["C0"] * (len(rows) - 1))
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def comparison_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'run':<10} {'step ms':>9} {'states MiB':>11} {'paper MiB':>10} {'peak RSS MiB':>13} "
            f"{'train loss':>11} {'val loss':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        paper = f"{r['paper_mib']:.2f}" if r["paper_mib"] is not None else "-"
        lines.append(f"{r['name']:<10} {r['step_ms']:>9.1f} {r['model_states_mib']:>11.2f} {paper:>10} "
                     f"{r['peak_rss_mib']:>13.0f} {r['train_loss']:>11.4f} {r['val_loss']:>9.4f}")
    return "\n".join(lines)
