"""What the main job measures and shows at the end: peak memory, memory and traffic beside the paper,
the loss plot, samples."""
from __future__ import annotations

import os
import resource
from typing import Any

import torch

import zeroshard
from zeroshard.paper import BYTES_PER_PARAM, paper_model_state_bytes

MIB = 2**20


def _status_bytes(field: str) -> int | None:
    """A figure of /proc/self/status (VmRSS: resident now; VmHWM: the peak), in bytes; None
    where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> None:
    """Start this process's peak (VmHWM) again from its resident size now, where the kernel lets
    us. getrusage's ru_maxrss cannot be reset, and a forked rank inherits its launcher's: without
    this, a run smaller than its launcher would read no growth at all."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def resident_rss() -> int:
    """This process's resident memory now, in bytes (its peak so far where /proc is missing)."""
    now = _status_bytes("VmRSS")
    return now if now is not None else peak_rss()


def peak_rss() -> int:
    """This process's peak resident memory (since reset_peak_rss, where it could reset), in bytes."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gpu_peak(device: torch.device) -> int:
    """The most GPU memory this process's tensors held at once on `device` (0 off the GPU)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def gpu_reserved_peak(device: torch.device) -> int:
    """The most GPU memory this process's caching allocator held at once on `device`: its tensors,
    its rounding and the blocks it kept cached (0 off the GPU). What a device must have free."""
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0


def bytes_per_param(engine: Any, precision: str) -> tuple[int, int, int]:
    """The paper's (p, g, K) for this run: p and g from the precision; K from what the optimizer
    keeps per element (Adam's two fp32 moments 8, SGD's momentum 4, plain SGD 0; known once it
    has stepped) plus the fp32 master copy that 16-bit training adds, and so does offload (the
    master stays beside the optimizer state, apart from the parameters). Adam gives the paper's K."""
    p, g, _ = BYTES_PER_PARAM[precision]
    kept = getattr(engine, "precision", None)  # (compare's DDP baseline has none: AMP's fp32 weights)
    master = 4 if (kept.separate_master if kept is not None else precision != "fp32") else 0
    optimizer = engine.optimizer
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and param.numel() > 0:
                return p, g, master + sum(v.element_size() for v in state.values()
                                          if isinstance(v, torch.Tensor) and v.numel() == param.numel())
    return p, g, master


def memory_table(per_rank: list[dict[str, int]], psi: int, stage: int, pgk: tuple[int, int, int],
                 dp: int | None = None) -> list[str]:
    """Model-state bytes per rank by category, beside the paper's formula for this stage and N (the
    data-parallel degree dp: every rank by default; under tp, Ψ is a rank's tp part) with `pgk`
    bytes per parameter (bytes_per_param)."""
    p, g, k = pgk
    formula = paper_model_state_bytes(psi, dp or len(per_rank), stage, p, g, k)
    header = ("rank", "params", "grads", "optimizer", "states", "paper")
    lines = [f"{header[0]:>6} " + " ".join(f"{h:>10}" for h in header[1:]) + "  (MiB)"]
    for rank, s in enumerate(per_rank):
        lines.append(f"{rank:>6} {s['params'] / MIB:>10.2f} {s['grads_in_step'] / MIB:>10.2f} "
                     f"{s['optimizer'] / MIB:>10.2f} "
                     f"{s['model_states_in_step'] / MIB:>10.2f} {formula / MIB:>10.2f}")
    if per_rank and per_rank[0].get("host"):  # offload: where the bytes are (transfer buffers included)
        lines.append("offload, rank 0: " + f"{per_rank[0]['device'] / MIB:.2f} MiB on the device, "
                     f"{per_rank[0]['host'] / MIB:.2f} MiB in host memory "
                     f"({per_rank[0]['transfer'] / MIB:.2f} of it transfer buffers)"
                     + (f", {per_rank[0]['disk'] / MIB:.2f} MiB on disk" if per_rank[0].get("disk") else ""))
    return lines


def paper_traffic_factor(stage: int, accumulation: int = 1) -> int:
    """The paper's elements moved per optimizer step, in Ψ: 2Ψ (stages 0-2) or 3Ψ (stage 3) per
    iteration. With `accumulation` micro-batches a step, stages 0-1 still reduce once; stage 2
    reduce-scatters every micro-batch (then gathers Ψ once), stage 3 sends 3Ψ in each."""
    return {0: 2, 1: 2, 2: accumulation + 1, 3: 3 * accumulation}[stage]


def traffic_line(step_bytes: int, psi: int, stage: int, precision: str, accumulation: int = 1) -> str:
    """Bytes moved in the last optimizer step beside the paper's (paper_traffic_factor)."""
    element = BYTES_PER_PARAM[precision][0]
    factor = paper_traffic_factor(stage, accumulation)
    why = f", {accumulation} micro-batches a step" if accumulation > 1 and stage >= 2 else ""
    return (f"traffic per step: {step_bytes / MIB:.2f} MiB (paper: {factor}Ψ x {element} bytes = "
            f"{factor * psi * element / MIB:.2f} MiB{why})")


def node_line(step: dict[str, dict[str, int]]) -> str:
    """The last step's bytes split by where they went: between ranks of one node, or across nodes
    (a collective's bytes count as inter-node when its group spans nodes, the paper's way)."""
    inter = sum(v["inter_node_bytes"] for v in step.values())
    intra = sum(v["intra_node_bytes"] for v in step.values())
    return f"  inside nodes: {intra / MIB:.2f} MiB, across nodes: {inter / MIB:.2f} MiB"


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
    """Bars of step time, model states and memory growth per rank for each run of `zeroshard compare`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["name"] for r in rows]
    panels = [("step_ms", "median step (ms)"), ("model_states_mib", "model states per rank (MiB)"),
              ("rss_growth_mib", "peak RSS above baseline per rank (MiB)")]
    if any(r["gpu_peak_mib"] for r in rows):
        panels.append(("gpu_peak_mib", "GPU peak allocated per rank (MiB)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for ax, (key, label) in zip(axes, panels):
        ax.bar(names, [r[key] for r in rows], color=["C7"] + ["C0"] * (len(rows) - 1))
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def comparison_table(rows: list[dict[str, Any]], rounds: int, baseline: str, cuda: bool) -> str:
    """step: the median over rounds of each round's median step (every implementation side by side
    in one world per round); x: the median over every step of its ratio to the baseline's step in
    the same turn.
    states: model-state bytes per rank (paper: the formula); RSS+: peak RSS above the process's
    baseline before the model was built; GPU: peak allocated on the GPU."""
    columns = [("run", 9, lambda r: r["name"]), ("step ms", 9, lambda r: f"{r['step_ms']:.1f}"),
               (f"x {baseline}", 7, lambda r: f"{r['vs_baseline']:.2f}"),
               ("states MiB", 11, lambda r: f"{r['model_states_mib']:.2f}"),
               ("paper MiB", 10, lambda r: f"{r['paper_mib']:.2f}"),
               ("RSS+ MiB", 9, lambda r: f"{r['rss_growth_mib']:.0f}")]
    if cuda:
        columns.append(("GPU peak MiB", 13, lambda r: f"{r['gpu_peak_mib']:.0f}"))
    columns += [("train loss", 11, lambda r: f"{r['train_loss']:.4f}"),
                ("val loss", 9, lambda r: f"{r['val_loss']:.4f}")]
    head = f"{columns[0][0]:<{columns[0][1]}}" + "".join(f" {c:>{w}}" for c, w, _ in columns[1:])
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f(r) for _, _, f in columns]
        lines.append(f"{cells[0]:<{columns[0][1]}}" + "".join(f" {c:>{w}}" for c, (_, w, _)
                                                             in zip(cells[1:], columns[1:])))
    each = "; ".join(f"{r['name']} " + "/".join(f"{t:.1f}" for t in r["step_ms_each"]) for r in rows)
    lines.append(f"step ms in each of {rounds} round(s), side by side: {each}")
    lines.append(f"x {baseline} = the median of each step's time over {baseline}'s in the same turn (paired, "
                 f"so a slow spell cancels out), not the ratio of the step ms column's medians")
    lines.append("RSS+ = peak resident memory above the process's own before the model was built")
    return "\n".join(lines)


def _print_traffic(engine, args: Any, psi: int, world: int) -> None:
    """The last step's bytes beside the paper's; none for one rank (its counters hold what the
    collectives it skips would carry, which is no traffic)."""
    if world == 1:
        print("traffic per step: none (one rank: nothing crosses a wire; the paper's 2Ψ and 3Ψ are "
              "for N > 1 ranks)")
        return
    step_bytes = sum(v["bytes"] for v in engine.comm_stats()["last_step"].values())
    accumulation = engine.config.gradient_accumulation_steps
    print(traffic_line(step_bytes, psi, args.stage, args.precision, accumulation))
    print(node_line(engine.comm_stats()["last_step"]))
    paper_bytes = paper_traffic_factor(args.stage, accumulation) * psi * BYTES_PER_PARAM[args.precision][0]
    if args.stage == 3 and step_bytes < paper_bytes:
        print("  (below 3Ψ: the root, and units kept gathered from forward into backward, are not "
              "gathered again; see stage3_max_reuse_distance in docs/configuration.md)")


def print_report(engine, args: Any, per_rank: list[dict[str, int]], history: list[float], val: float,
                 text: str, seconds: float, checkpoints: str) -> None:
    """Rank 0, at the end of `zeroshard train`: the model, memory and traffic beside the paper's
    formulas, the losses and their plot, where the checkpoint is, and the sample."""
    psi, world = engine.num_parameters(), zeroshard.rank_and_world_size()[1]
    split = f" (this rank's tp part; tp {args.tp} x dp {world // args.tp})" if args.tp > 1 else ""
    pgk = bytes_per_param(engine, args.precision)
    where = "cuda (NCCL)" if engine.device.type == "cuda" else f"{engine.device.type} (gloo)"
    rank_word = "rank" if world == 1 else "ranks"
    print(f"\nmodel: {type(engine.module).__name__}, Ψ = {psi:,} parameters{split}; ZeRO stage {args.stage}, "
          f"{world} {rank_word} on {where}, {args.precision} {type(engine.optimizer).__name__} "
          f"({'+'.join(map(str, pgk))} bytes/param)")
    for line in memory_table(per_rank, psi, args.stage, pgk, dp=world // args.tp):
        print(line)
    _print_traffic(engine, args, psi, world)
    first = f"{history[0]:.4f} at step 1 -> " if history else ""
    skipped = getattr(engine, "skipped_steps", 0)  # (fp16 overflows, skipped non-finite steps)
    skips = f"; {skipped} optimizer steps skipped (fp16 overflow or non-finite gradients)" if skipped else ""
    print(f"loss: train {first}{history[-1]:.4f} at step {len(history)}, validation {val:.4f}; "
          f"{seconds:.1f} s in training steps this run{skips}")
    plot = os.path.join(args.out, "loss.png")
    plot_losses(history, val, plot)
    print(f"loss curve: {plot}; checkpoint: {checkpoints} (resume with --resume)")
    print("sample:\n" + "\n".join("  | " + line for line in text.splitlines()[:8]))
