"""`zeroshard plan`'s hardware: this machine detected and calibrated, or another described by flags.

Calibration is a short micro-benchmark (a few seconds; at most about 20 s on a busy machine): matrix
throughput in the run's precision with the threads one rank gets, torch's fused CPU AdamW (host
Adam), a host memory copy, host <-> device copies on a GPU, and a disk write and read under the
offload path. The figures are cached in the user's cache directory (XDG_CACHE_HOME, else
~/.cache)/zeroshard/, keyed by the machine (host name, processor, cores, GPUs, torch version) and
the precision and rank count; --recalibrate measures again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
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


def _timed(fn, repeat: int) -> float:
    fn()  # warm up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def _measure(precision: str, ranks: int, disk_dir: str, cuda: bool) -> dict:
    import torch
    from tqdm import tqdm

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))  # what one rank gets (train.start_rank)
    out = {}
    try:
        with tqdm(total=5, desc="calibrate", leave=False) as bar:
            # A transformer's MLP, forward and backward: the matrix work as a model does it (with
            # its activation function and the backward's transposes), in the run's precision.
            device = "cuda" if cuda else "cpu"
            d, tokens = (4096, 8192) if cuda else (256, 1024)
            mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
            mlp = mlp.to(device=device, dtype=dtype)
            x = torch.randn(tokens, d, device=device, dtype=dtype, requires_grad=True)
            sync = torch.cuda.synchronize if cuda else (lambda: None)
            seconds = _timed(lambda: (mlp(x).sum().backward(), sync()), 5 if cuda else 3)
            out["matmul"] = 6 * tokens * 8 * d * d / seconds
            bar.update()
            big = torch.empty(16 << 20, dtype=torch.float32)
            target = torch.empty_like(big)
            out["memory"] = 2 * big.numel() * 4 / _timed(lambda: target.copy_(big), 3)  # read + write
            if cuda:
                dev = torch.empty(32 << 20, dtype=torch.float32, device="cuda")
                pinned = torch.empty(32 << 20, dtype=torch.float32, pin_memory=True)
                out["memory"] = 2 * dev.numel() * 4 / _timed(lambda: (dev.clone(), sync()), 3)
                out["host_link"] = dev.numel() * 4 / _timed(lambda: (pinned.copy_(dev), sync()), 3)
            else:
                out["host_link"] = 0.0
            bar.update()
            p = torch.nn.Parameter(torch.zeros(4 << 20))
            p.grad = torch.randn_like(p)
            opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
            out["host_adam"] = p.numel() / _timed(opt.step, 3)
            bar.update()
            out["disk_write"], out["disk_read"] = _disk_rate(disk_dir, bar)
    finally:
        torch.set_num_threads(threads)
    return out


def _disk_rate(folder: str, bar) -> tuple[float, float]:
    """Write 64 MiB with fsync and read it back (dropped from the page cache first, where the
    system lets us), in the folder the offload would use."""
    size, block = 64 << 20, os.urandom(1 << 20)
    fd, path = tempfile.mkstemp(dir=folder, prefix=".zeroshard-plan-")
    try:
        start = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for _ in range(size >> 20):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write = size / (time.perf_counter() - start)
        bar.update()
        with open(path, "rb") as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while f.read(8 << 20):
                pass
        read = size / (time.perf_counter() - start)
        bar.update()
    finally:
        os.unlink(path)
    return write, read


def calibrate(
    precision: str, ranks: int, disk_dir: str, cuda: bool, again: bool = False
) -> tuple[dict, bool]:
    """This machine's rates for one rank, from the cache or measured now: (figures, from_cache)."""
    path = os.path.join(cache_dir(), f"calibration-{machine_key(precision, ranks)}.json")
    if not again and os.path.isfile(path):
        try:
            with open(path) as f:
                return json.load(f), True
        except (OSError, ValueError):
            pass
    figures = _measure(precision, ranks, disk_dir, cuda)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(figures, f, indent=1)
    return figures, False


def rates_of(figures: dict, cuda: bool) -> Rates:
    """A rank's Rates from calibrated figures. On a CPU group the collectives run over gloo on the
    same memory and cores: taken at a quarter of the copy bandwidth, not overlapping compute."""
    memory = figures["memory"]
    return Rates(
        matmul=figures["matmul"],
        memory=memory,
        host_adam=figures["host_adam"],
        host_link=figures.get("host_link", 0.0),
        collective=figures.get("collective", memory / 4),
        mp_collective=memory / 4,
        disk_read=figures["disk_read"],
        disk_write=figures["disk_write"],
        overlap=cuda,
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
        hw = Hardware(
            1, gpus, float(mem), host, float(disk), rates_of(figures, True), "cuda", disk_dir is not None
        )
        line = f"{gpus} x {torch.cuda.get_device_name(0)} ({mem / 2**30:.1f} GiB)"
    else:
        ranks = nproc or 2
        hw = Hardware(
            1, ranks, host, host, float(disk), rates_of(figures, False), "cpu", disk_dir is not None
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
        disk_read=disk_gbps * GB,
        disk_write=disk_gbps * GB,
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
