"""`zeroshard plan --verify`: run planned configurations here for a few steps, through the same
path as `zeroshard train` (train.launch with the plan's config), and set the measured peaks and
step time beside the predicted ones.

Measured: on a GPU the device's peak (torch.cuda.max_memory_allocated, the most over the ranks) and
the host's peak RSS above the process's baseline; on a CPU group one memory, so device is None and
host is the peak RSS above the baseline (measured_worker: /proc/self/status, the most over ranks).
The baseline is taken as the rank starts, before its process group;
what the runtime itself then adds (the data, the libraries' workspaces) is not modelled: it is a
pair of reference runs' measured growth against their predicted peaks (runtime_bytes: a fixed part
and an overhead per byte), measured once per machine and applied to the prediction, cached beside
the calibration. Step time: the median micro-batch step times the accumulation steps."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace

from zeroshard.paper.plan import Plan
from zeroshard.paper.plan_memory import Shape


def _args(cli, shape: Shape, p: Plan | None, hw, batch: int, out: str, config: str | None,
          reference: tuple[str, int] | None = None):
    from .train import TrainArgs

    s = p.setup if p is not None else None
    base = dict(
        device=hw.device,
        nproc=hw.ranks,
        save=False,
        quiet=True,
        sample_tokens=0,
        out=out,
        data=[],
        hf_config=cli.hf_config,
        size=cli.model or "small",
        layers=cli.layers,
        width=cli.width,
    )
    if s is None:  # a reference run (runtime_bytes): its built-in size, two steps
        return TrainArgs(
            **{**base, "size": reference[0], "layers": None, "width": None, "hf_config": None},
            stage=0,
            steps=2,
            batch_size=1,
            seq_len=reference[1],
            precision="fp32",
        )
    return TrainArgs(
        **base,
        stage=s.stage,
        steps=cli.verify_steps * s.accumulation,
        batch_size=s.micro_batch,
        seq_len=s.seq,
        precision=s.precision,
        config=config,
        tp=s.mp,
        offload_optimizer=s.offload_optimizer if s.stage >= 1 else None,
        offload_param=s.offload_param if s.stage == 3 else None,
        nvme_path=cli.nvme_path if "nvme" in (s.offload_optimizer, s.offload_param) else None,
        activation_checkpointing=s.checkpointing,
        partition_activations=s.checkpointing and s.mp > 1,
    )


def _status(field: str) -> int:
    """A figure of /proc/self/status in bytes (VmRSS: resident now; VmHWM: this process's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def measured_worker(args) -> dict:
    """train.worker, with the host peak measured from this process's own memory: the resident
    bytes at the start against the peak after (VmHWM, reset first where the kernel lets us). The
    worker's own figure (getrusage's ru_maxrss) starts at the launching process's resident size,
    which a spawned child inherits, and so reads 0 for any run smaller than the launcher."""
    import zeroshard

    from .train import worker

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak to the resident size now
    except OSError:
        pass
    baseline = _status("VmRSS")
    result = worker(args)
    growth = _status("VmHWM") - baseline
    result["rss_growth"] = max(int(g) for g in zeroshard.gather_objects(growth))
    return result


REFERENCES = (("tiny", 16), ("medium", 16))  # the reference runs' built-in sizes and sequence length


def runtime_bytes(cli, shape: Shape, hw, figures: dict | None) -> tuple[float, float]:
    """What a CPU rank holds beyond the model's own bytes, as (fixed, per_byte): the runtime's fixed
    bytes (the corpus, the libraries' workspaces, less what the process had already peaked at before
    its baseline) and the allocator's overhead per predicted byte (freed memory it keeps). From two
    reference runs (a tiny and a medium built-in GPT, stage 0, fp32, one sequence of 16): measured
    growth = fixed + (1 + per_byte) x predicted, solved for both. Measured once per machine and rank
    count, and cached; never fitted to the configurations a plan verifies."""
    from zeroshard.paper.plan_memory import Setup, gpt2_shape, peak
    from .gpt import config_for
    from .plan_hw import cache_dir, machine_key
    from .train import launch

    path = os.path.join(cache_dir(), f"runtime3-{machine_key('fp32', hw.ranks)}.json")
    if os.path.isfile(path):
        with open(path) as f:
            cached = json.load(f)
        return cached["fixed"], cached["per_byte"]
    points = []
    for size, seq in REFERENCES:
        with tempfile.TemporaryDirectory() as out:
            result = launch(_args(cli, shape, None, hw, 0, out, None, reference=(size, seq)), measured_worker)
        cfg = config_for(size, None, None, seq)
        ref = gpt2_shape(size, cfg.layers, cfg.width, cfg.heads, cfg.vocab_size, cfg.seq_len)
        points.append((peak(ref, Setup(0, "fp32", micro_batch=1, seq=seq), hw.ranks, "cpu").host,
                       float(result["rss_growth"])))
    (p0, m0), (p1, m1) = points
    per_byte = max(0.0, (m1 - m0) / (p1 - p0) - 1)
    fixed = max(0.0, m0 - (1 + per_byte) * p0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"fixed": fixed, "per_byte": per_byte, "references": points}, f)
    return fixed, per_byte


def verify(cli, shape: Shape, hw, plans: list[Plan], batch: int, figures: dict | None) -> list[dict]:
    from .options import ranks_report_errors
    from .plan_report import config_of
    from .train import launch

    fixed, per_byte = runtime_bytes(cli, shape, hw, figures) if hw.device == "cpu" else (0.0, 0.0)
    out = []
    for p in plans:
        with tempfile.TemporaryDirectory() as folder:
            config = os.path.join(folder, "ds_config.json")
            raw = config_of(p, batch, cli.nvme_path)
            raw.pop("train_batch_size")  # (the micro-batch and accumulation say it)
            with open(config, "w") as f:
                json.dump(raw, f)
            import argparse

            with ranks_report_errors(argparse.ArgumentParser(prog="zeroshard plan --verify")):
                result = launch(_args(cli, shape, p, hw, batch, folder, config), measured_worker)
        cpu = hw.device == "cpu"
        predicted = {
            "device_peak_bytes": None if cpu else p.peak.device,
            "host_peak_bytes": p.peak.host * (1 + per_byte) + fixed,
            "step_s": p.time.total,
        }
        measured = {
            "device_peak_bytes": None if cpu else float(result["gpu_peak"]),
            "host_peak_bytes": float(result["rss_growth"]),
            "step_s": result["step_ms"] / 1000 * p.setup.accumulation,
        }
        out.append(
            {
                "config": {**replace(p.setup).__dict__, "name": p.setup.name},
                "predicted": predicted,
                "measured": measured,
                "runtime_bytes": fixed + p.peak.host * per_byte,
            }
        )
    return out
