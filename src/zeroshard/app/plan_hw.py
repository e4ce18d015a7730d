"""`zeroshard plan`'s hardware: this machine detected and calibrated, or another described by flags.

Calibration is a short micro-benchmark (plan_calibrate: about 10 s, at most about 30 s on a busy
machine). The figures are cached in the user's cache directory (XDG_CACHE_HOME, else
~/.cache)/zeroshard/, keyed by the machine (host name, processor, cores, GPUs, torch version) and
the precision and rank count; --recalibrate measures again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time

from zeroshard.paper.plan import Hardware
from zeroshard.paper.plan_time import Rates

GB = 1e9
# Figures for another machine where a flag does not give them (docs/plan.md): a current data-centre
# GPU's sustained bf16 matrix rate and memory bandwidth, PCIe 4 x16, one NVMe drive.
OTHER = {"tflops": 100.0, "memory_gbps": 1500.0, "host_adam": 1.0, "h2d_gbps": 20.0, "disk_gbps": 2.0}


def cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zeroshard")


def host_memory() -> float:
    """Bytes of memory available to new processes (MemAvailable), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def machine_key(precision: str, ranks: int) -> str:
    import torch

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    text = json.dumps(
        [
            platform.node(),
            platform.processor(),
            platform.machine(),
            os.cpu_count(),
            gpus,
            torch.__version__,
            precision,
            ranks,
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def calibration_path(precision: str, ranks: int) -> str:
    """The cache file of `calibrate`'s figures; its number changes when the figures are measured or
    fitted differently, so that a cache written before is measured again rather than read."""
    return os.path.join(cache_dir(), f"calibration4-{machine_key(precision, ranks)}.json")


def calibrate(
    precision: str, ranks: int, disk_dir: str, cuda: bool, again: bool = False, max_age: float | None = None
) -> tuple[dict, float | None]:
    """This machine's rates for one rank, from the cache or measured now: (figures, the cached
    figures' age in seconds, None if measured now). `max_age`: older cached figures are measured
    again (a shared machine's rates drift with its neighbours' load)."""
    path = calibration_path(precision, ranks)
    if not again and os.path.isfile(path):
        age = time.time() - os.path.getmtime(path)
        try:
            with open(path) as f:
                if max_age is None or age <= max_age:
                    return json.load(f), age
        except (OSError, ValueError):
            pass
    from .plan_calibrate import measure

    figures = measure(precision, ranks, disk_dir, cuda)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(figures, f, indent=1)
    return figures, None


def rates_of(figures: dict, cuda: bool, ranks: int = 1) -> Rates:
    """A rank's Rates from calibrated figures (plan_calibrate). On a CPU group the collectives are
    gloo's, measured among the run's ranks, and do not overlap compute (they take the same cores);
    a GPU's collectives, not measured on one GPU, are taken at NVLink's rate within a node. The
    disk is the machine's: its measured rate is shared by the `ranks` that offload to it at once."""
    memory = figures["memory"]
    measured = {k: figures.get(k, 0.0) for k in ("all_reduce", "reduce_scatter", "all_gather", "latency")}
    return Rates(
        matmul=figures["matmul"],
        memory=memory,
        host_adam=figures["host_adam"],
        host_link=figures.get("host_link", 0.0),
        collective=memory / 4 if not cuda else 150 * GB,
        mp_collective=memory / 4 if not cuda else 150 * GB,
        disk_read=figures["disk_read"] / ranks,
        disk_write=figures["disk_write"] / ranks,
        overlap=cuda,
        layer_fixed=figures.get("layer_fixed", 0.0),
        elementwise=figures.get("elementwise", 0.0),
        weights=figures.get("weights", 0.0),
        device_adam=figures.get("device_adam", 0.0),
        recompute=figures.get("recompute", 0.0),
        **measured,
    )


def local_hardware(nproc: int | None, figures: dict, disk_dir: str | None) -> tuple[Hardware, str]:
    """This machine: every GPU (one rank each), else `nproc` (default 2) CPU ranks sharing host
    memory. Returns the hardware and a line describing it."""
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    host = host_memory()
    disk = shutil.disk_usage(disk_dir).free if disk_dir else 0.0
    if cuda:
        gpus = nproc or torch.cuda.device_count()
        mem = torch.cuda.get_device_properties(0).total_memory
        rates = rates_of(figures, True, gpus)
        hw = Hardware(1, gpus, float(mem), host, float(disk), rates, "cuda", disk_dir is not None)
        line = f"{gpus} x {torch.cuda.get_device_name(0)} ({mem / 2**30:.1f} GiB)"
    else:
        ranks = nproc or 2
        hw = Hardware(
            1, ranks, host, host, float(disk), rates_of(figures, False, ranks), "cpu", disk_dir is not None
        )
        line = f"{ranks} CPU ranks (gloo) on {os.cpu_count()} cores"
    line += f", {host / 2**30:.1f} GiB host memory available"
    if disk_dir:
        line += f", {disk / 2**30:.1f} GiB free under {disk_dir}"
    return hw, line


def given_hardware(args) -> tuple[Hardware, str]:
    """Another machine, from --nodes, --gpus-per-node, --gpu-mem, --host-mem, --link-gbps and the
    rate flags (defaults: OTHER)."""

    def pick(name: str, default: float) -> float:
        value = getattr(args, name, None)
        return default if value is None else value

    tflops, mem_gbps = pick("tflops", OTHER["tflops"]), OTHER["memory_gbps"]
    link = pick("link_gbps", 100.0) * GB / 8  # Gbit/s -> bytes/s per node
    per_node = int(pick("gpus_per_node", 8))
    disk_gbps = pick("disk_gbps", OTHER["disk_gbps"])
    rates = Rates(
        matmul=tflops * 1e12,
        memory=mem_gbps * GB,
        host_adam=pick("host_adam", OTHER["host_adam"]) * GB,
        host_link=pick("h2d_gbps", OTHER["h2d_gbps"]) * GB,
        collective=link / per_node if pick("nodes", 1) > 1 else 150 * GB,
        mp_collective=150 * GB,
        disk_read=disk_gbps * GB / per_node,  # (one node's disks, shared by its ranks)
        disk_write=disk_gbps * GB / per_node,
    )
    hw = Hardware(
        int(pick("nodes", 1)),
        per_node,
        pick("gpu_mem", 80.0) * GB,
        pick("host_mem", 1000.0) * GB,
        pick("disk", 4000.0) * GB,
        rates,
        "cuda",
        True,
    )
    line = (
        f"{hw.nodes} node(s) x {per_node} GPUs of {hw.device_bytes / GB:.0f} GB, {hw.host_bytes / GB:.0f} GB "
        f"host memory per node, {pick('link_gbps', 100.0):.0f} Gb/s between nodes, {tflops:.0f} TFLOP/s"
    )
    return hw, line
