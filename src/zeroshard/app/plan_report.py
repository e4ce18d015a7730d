"""What `zeroshard plan` prints: the ranked table (or one JSON object), the config --write writes
and how to train it, the notes on what a CPU run meets beyond the table, and the paper's runs
projected beside its reported figures."""

from __future__ import annotations

GIB = 2**30


def _gib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f}"


def _row(i: int | str, p, cpu: bool, width: int = 44) -> str:
    device = "-" if cpu else _gib(p.peak.device)
    return (
        f"{i!s:>3} {p.setup.name:<{width}} {device:>9} {_gib(p.peak.host):>9} {_gib(p.peak.disk):>8} "
        f"{p.time.total:>9.3f} {p.tokens_per_s:>12,.0f}"
    )


def table(shape, hw, line, plans, batch, args, changes, verified) -> str:
    cpu = hw.device == "cpu"
    fit = [p for p in plans if p.fits]
    nearest, seen = [], set()  # of those that do not fit, the nearest of each kind (6)
    for p in (p for p in plans if not p.fits):
        key = (p.setup.stage, p.setup.offload_optimizer, p.setup.offload_param, p.setup.checkpointing)
        if key not in seen and len(seen) < 6:
            seen.add(key)
            nearest.append(p)
    width = max([44] + [len(p.setup.name) for p in fit[: args.top] + nearest])  # (columns aligned)
    lines = [
        f"model: {shape.name}, Ψ = {shape.psi:,} ({shape.layers} layers, width {shape.width}); "
        f"global batch {batch} x {args.seq_len} tokens, {args.precision}",
        f"hardware: {line}",
        f"peaks per rank ({'one memory: host holds all' if cpu else 'device, host, disk'}); "
        f"step: one optimizer step",
        f"{'#':>3} {'configuration':<{width}} {'dev GiB':>9} {'host GiB':>9} {'disk GiB':>8} {'step s':>9} "
        f"{'tokens/s':>12}",
    ]
    lines += [_row(i + 1, p, cpu, width) for i, p in enumerate(fit[: args.top])]
    if len(fit) > args.top:
        lines.append(f"    ... and {len(fit) - args.top} more that fit")
    over = [p for p in plans if not p.fits]
    if over:
        lines.append(f"{len(over)} do not fit, nearest first:")
        lines += [f"    {p.setup.name:<{width}} {p.misfit}" for p in nearest]
    if not fit:
        lines.append(
            "Nothing fits."
            + (
                " Smallest changes that would fit, each alone: " + "; ".join(changes)
                if changes
                else " No single change tried (nvme offload, up to 1024x "
                "the nodes, a shorter sequence) makes it fit."
            )
        )
    else:
        best = fit[0]
        lines.append(
            f"best: {best.setup.name}" + (f" (train with --tp {best.setup.mp})" if best.setup.mp > 1 else "")
        )
    for v in verified:
        lines.append(f"verified {v['config']['name']}: predicted / measured")
        for key in ("device_peak_bytes", "host_peak_bytes"):
            pred, meas = v["predicted"][key], v["measured"][key]
            err = "" if not pred or not meas else f" ({pred / meas - 1:+.0%})"
            lines.append(f"    {key:<18} {_gib(pred):>9} / {_gib(meas):>9} GiB{err}")
        pred, meas = v["predicted"]["step_s"], v["measured"]["step_s"]
        lines.append(f"    {'step_s':<18} {pred:>9.3f} / {meas:>9.3f} s ({pred / meas - 1:+.0%})")
    return "\n".join(lines)


def _plan_dict(p) -> dict:
    return {
        "config": {**p.setup.__dict__, "name": p.setup.name},
        "fits": p.fits,
        "why_not": p.misfit,
        "device_peak_bytes": p.peak.device,
        "host_peak_bytes": p.peak.host,
        "disk_bytes": p.peak.disk,
        "parts": p.peak.parts,
        "step_s": p.time.total,
        "compute_s": p.time.compute,
        "comm_s": p.time.comm,
        "optimizer_s": p.time.optimizer,
        "tokens_per_s": p.tokens_per_s,
    }


def plan_json(shape, hw, line, plans, batch, args, changes, verified) -> dict:
    fit = [p for p in plans if p.fits]
    return {
        "model": {"name": shape.name, "psi": shape.psi, "layers": shape.layers, "width": shape.width},
        "hardware": line,
        "global_batch": batch,
        "seq_len": args.seq_len,
        "precision": args.precision,
        "fits": [_plan_dict(p) for p in fit[: args.top]],
        "best": _plan_dict(fit[0]) if fit else None,
        "not_fitting": [_plan_dict(p) for p in plans if not p.fits][: args.top],
        "smallest_changes": changes,
        "verified": verified,
    }


def config_of(p, global_batch: int, nvme_path: str | None) -> dict:
    """The DeepSpeed-style config of a plan, as `zeroshard train --config` and ZeroTrainer take it."""
    s = p.setup
    zero: dict = {"stage": s.stage}
    for key, where in (("offload_optimizer", s.offload_optimizer), ("offload_param", s.offload_param)):
        if where != "none":  # pinned, as `zeroshard train --offload-*` pins (and pinned_rounding counts)
            zero[key] = {"device": where, "pin_memory": True,
                         **({"nvme_path": nvme_path} if where == "nvme" else {})}
    config = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": s.accumulation,
        "zero_optimization": zero,
        "bf16": {"enabled": s.precision == "bf16"},
        "fp16": {"enabled": s.precision == "fp16"},
    }
    if s.mics:
        zero["mics_shard_size"] = s.mics
    if s.hpz:
        zero["zero_hpz_partition_size"] = s.hpz
    if s.checkpointing:
        config["activation_checkpointing"] = {"partition_activations": s.mp > 1}
    return config


def paper_text(as_json: bool = False) -> str:
    import json
    from zeroshard.paper.plan import paper_projection

    rows = paper_projection()
    if as_json:
        return json.dumps({"paper": rows}, indent=1)
    lines = [
        "The paper's runs on its hardware by public specifications (V100 32 GB, 125 TFLOP/s fp16 peak; "
        "DGX-2 nodes of 16; docs/plan.md)",
        f"{'run':<26} {'Ψ':>8} {'stage':>5} {'fits':>5} {'predicted TFLOP/s/GPU':>22} {'PFLOP/s':>8} "
        f"{'reported':>34} {'error':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r['case']:<26} {r['psi'] / 1e9:>7.1f}B {r['stage']:>5} {'yes' if r['fits'] else 'no':>5} "
            f"{r['predicted_tflops_per_gpu']:>22.1f} {r['predicted_pflops']:>8.1f} {r['reported']:>34} "
            f"{r['error']:>+7.0%}"
        )
    return "\n".join(lines)


def unwritten_why(args, best) -> str:
    """Why --write writes nothing ("" where it writes)."""
    if best is None:
        return "nothing fits"
    nvme = "nvme" in (best.setup.offload_optimizer, best.setup.offload_param)
    if nvme and not args.nvme_path:
        return ("the best offloads to nvme: give --nvme-path DIR, the directory on the machine that "
                "trains, to write it into the config")
    return ""


def cpu_notes(shape, hw, precision: str, mp: int = 1) -> list[str]:
    """What a CPU run meets that the table does not count. bf16 matmuls on a CPU go through
    oneDNN, which keeps a kernel (and its buffers) for every new shape, up to 1024 of them; a mixture
    of experts sends each expert a different number of tokens every step, so its matmuls keep
    meeting new shapes and the process grows step after step until the cache is full. fp32 takes
    another path and does not grow. And MP's DTensor work per op, which no calibration measures."""
    if hw.device != "cpu":
        return []
    notes = []
    if precision == "bf16" and shape.experts[0]:
        notes.append("bf16 on a CPU with a mixture of experts: oneDNN keeps a kernel for each new matmul "
                     "shape (up to 1024) and the experts' batches change shape every step, so RSS grows over "
                     "the steps beyond these peaks; fp32 does not, and ONEDNN_PRIMITIVE_CACHE_CAPACITY=64 "
                     "LRU_CACHE_CAPACITY=64 bound it at a slower step (docs/plan.md, Known limits)")
    if mp > 1:
        notes.append(f"mp {mp} on a CPU: the step counts MP's all-reduces but not DTensor's own work per op, "
                     f"which no calibration measures; such steps have measured several times the "
                     f"prediction (--verify measures it)")
    return notes


def train_command(args, best, hw) -> str:
    """How to train the written config: the `zeroshard train` line that runs it as planned (the
    model, the ranks, and --tp, which the config file cannot carry: tensor parallelism is the
    model's split), where zeroshard train can run it: one machine, a model it builds."""
    if args.params is not None or hw.nodes > 1:
        where = (f"under torchrun on each of {hw.nodes} nodes (--nnodes {hw.nodes} --nproc-per-node "
                 f"{hw.per_node})" if hw.nodes > 1 else f"with {hw.ranks} ranks")
        return (f"give it to zeroshard.initialize(model, config=...) or ZeroTrainer in your script, "
                f"{where}" + (f", with the model split --tp {best.setup.mp}" if best.setup.mp > 1 else ""))
    model = (f"--hf-config {args.hf_config}" if args.hf_config else
             f"--size {args.model or 'small'}" + "".join(f" --{k} {v}" for k in ("layers", "width")
                                                          if (v := getattr(args, k)) is not None))
    tp = f" --tp {best.setup.mp}" if best.setup.mp > 1 else ""
    return f"train it with: zeroshard train --config {args.write} {model} --seq-len {args.seq_len}{tp} " \
           f"--nproc {hw.per_node}"
