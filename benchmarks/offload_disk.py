"""Disk offload (ZeRO-Infinity) beside host offload and no offload: the same GPT, the same run, on CPU.

For each mode (none, cpu, nvme) at --nproc gloo ranks, stage 3, fp32 AdamW (fused), one fresh process
group per mode: median step time and median `engine.step()` time (where the optimizer streams the
states), bytes read and written per step per rank (`engine.io_stats()`), the I/O rate this gives
during `engine.step()`, and per rank: RSS after training, peak RSS (ru_maxrss) and the system's page
cache growth over the run (/proc/meminfo Cached). Before and after the runs, the disk's own
sequential write and read rates are measured on the same directory (pwrite + fdatasync, then pread
after posix_fadvise(DONTNEED)); the higher of each is the limit the nvme run is compared with.

The disk's share of its own rate: for each timed step, all ranks' bytes read (r) and written (w) in a
phase (forward + backward: the parameter shards' reads; `engine.step()`: the optimizer's stream and the
shards' writes) and the phase's window (first rank's start to last rank's end). The disk needs
r / read rate + w / write rate seconds for that mix at its sequential rates; its share is that time
over the window (1.0: the disk ran at its sequential rate throughout). Median over the timed steps;
also for the whole training step (forward, backward and `engine.step()`; its window starts at a barrier).

    python benchmarks/offload_disk.py                      # 2 ranks, width 512, 8 layers
    python benchmarks/offload_disk.py --quick              # smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zeroshard  # noqa: E402
from ranks import free_port  # noqa: E402
from zeroshard.app.gpt import GPT, GPTConfig, lm_loss  # noqa: E402

MiB = 2**20
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def page_cache() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Cached:"))


def disk_rate(directory: str, nbytes: int, chunk: int = 64 * MiB) -> tuple[float, float]:
    """(write, read) MiB/s of one file written sequentially (then synced) and read back uncached."""
    path = os.path.join(directory, ".rate-probe")
    data = os.urandom(chunk)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.pwrite(fd, data, offset)
        os.fdatasync(fd)
        write = nbytes / MiB / (time.perf_counter() - start)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.pread(fd, chunk, offset)
        read = nbytes / MiB / (time.perf_counter() - start)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        os.remove(path)
    return write, read


def config(mode: str, directory: str, sub_group: int) -> dict:
    zero: dict = {"stage": 3, "sub_group_size": sub_group}
    if mode != "none":
        zero["offload_optimizer"] = {"device": mode, "nvme_path": directory, "buffer_count": 4}
        zero["offload_param"] = {"device": mode, "nvme_path": directory}
        if mode == "nvme":  # every shard from its file, every time: the streaming is what is measured
            zero["offload_param"]["max_in_cpu"] = 0
    return {"zero_optimization": zero}


def io_total(engine) -> tuple[int, int]:
    total = engine.io_stats()["total"]
    return total["read"], total["written"]


def worker(rank: int, world: int, port: int, args: argparse.Namespace, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    with zeroshard.init():
        model = GPT(GPTConfig(seq_len=args.seq, layers=args.layers, width=args.width, heads=8))
    engine = zeroshard.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
                                  config(mode, args.dir, args.sub_group))
    cache_before = page_cache()
    g = torch.Generator().manual_seed(rank)
    steps, updates, io, phases = [], [], [], []
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
        dist.barrier()  # the ranks' phases line up, so the windows below are the ranks' common ones
        io0, start = io_total(engine), time.time()
        loss = lm_loss(engine(x[:, :-1]), x[:, 1:])
        engine.backward(loss)
        io1, middle = io_total(engine), time.time()
        engine.step()
        io2, end = io_total(engine), time.time()
        if step >= args.warmup:
            steps.append(end - start)
            updates.append(end - middle)
            io.append(engine.io_stats()["last_step"])
            phases.append({"times": (start, middle, end), "fb": (io1[0] - io0[0], io1[1] - io0[1]),
                           "step": (io2[0] - io1[0], io2[1] - io1[1])})
    stats = engine.memory_stats()
    row = {"mode": mode, "rank": rank, "step_s": statistics.median(steps),
           "update_s": statistics.median(updates),
           "read_mib": statistics.median(i["read"] for i in io) / MiB,
           "written_mib": statistics.median(i["written"] for i in io) / MiB,
           "rss_mib": psutil.Process().memory_info().rss / MiB,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "cache_growth_mib": (page_cache() - cache_before) / MiB,
           "device_mib": stats["device"] / MiB, "host_mib": stats["host"] / MiB,
           "disk_mib": stats.get("disk", 0) / MiB, "loss": loss.item(), "psi": engine.num_parameters(),
           "phases": phases}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(row, f)
    del engine
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sub-group", type=int, default=1_000_000, help="sub_group_size (elements)")
    parser.add_argument("--dir", default=None, help="disk offload directory (default: a temporary one)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.steps = 2, 128, 2
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir or OUT) as directory:
        args.dir = directory
        probe = 512 * MiB if not args.quick else 64 * MiB
        rates = [disk_rate(directory, probe)]
        rows = []
        for mode in ("none", "cpu", "nvme"):
            out = os.path.join(OUT, f"offload_disk.{mode}")
            mp.start_processes(worker, args=(args.nproc, free_port(), args, mode, out), nprocs=args.nproc,
                               start_method="spawn")
            rows += [json.load(open(f"{out}.{r}.json")) for r in range(args.nproc)]
        rates.append(disk_rate(directory, probe))
    report(rows, args, rates)


def disk_share(rows: list[dict], phase: str, write: float, read: float) -> dict:
    """Median over the timed steps of the disk's share of its sequential rate in `phase` (module notes)."""
    per_step = []
    for k in range(len(rows[0]["phases"])):
        steps = [r["phases"][k] for r in rows]
        a, b = {"fb": (0, 1), "step": (1, 2), "all": (0, 2)}[phase]
        window = max(s["times"][b] for s in steps) - min(s["times"][a] for s in steps)
        parts = ("fb", "step") if phase == "all" else (phase,)
        rd, wr = (sum(s[p][i] for s in steps for p in parts) / MiB for i in (0, 1))
        need = rd / read + wr / write
        per_step.append({"read": rd, "written": wr, "window": window, "need": need, "share": need / window})
    return sorted(per_step, key=lambda x: x["share"])[len(per_step) // 2]


def report(rows: list[dict], args: argparse.Namespace, rates: list[tuple[float, float]]) -> None:
    write, read = max(w for w, _ in rates), max(r for _, r in rates)
    lines = [f"GPT width {args.width}, {args.layers} layers, Ψ = {rows[0]['psi']:,}, {args.nproc} ranks, "
             f"stage 3, fp32 fused AdamW, batch {args.batch} x seq {args.seq}, "
             f"sub_group_size {args.sub_group}",
             "disk, sequential, same directory: " + ", ".join(f"write {w:,.0f} MiB/s, read {r:,.0f} MiB/s"
                                                                for w, r in rates) + " (before, after)",
             f"{'mode':<6}{'step s':>8}{'step() s':>10}{'read MiB':>10}{'written':>9}{'I/O MiB/s':>11}"
             f"{'RSS MiB':>9}{'peak':>8}{'cache +':>9}{'host MiB':>10}{'disk MiB':>10}{'loss':>9}"]
    for mode in ("none", "cpu", "nvme"):
        mine = [r for r in rows if r["mode"] == mode]
        r0 = mine[0]
        rate = (r0["read_mib"] + r0["written_mib"]) * args.nproc / r0["update_s"] if r0["update_s"] else 0
        lines.append(f"{mode:<6}{r0['step_s']:>8.3f}{r0['update_s']:>10.3f}{r0['read_mib']:>10.1f}"
                     f"{r0['written_mib']:>9.1f}{rate:>11.0f}{max(r['rss_mib'] for r in mine):>9.0f}"
                     f"{max(r['peak_rss_mib'] for r in mine):>8.0f}{r0['cache_growth_mib']:>9.0f}"
                     f"{r0['host_mib']:>10.1f}{r0['disk_mib']:>10.1f}{r0['loss']:>9.4f}")
    lines.append("I/O MiB/s: all ranks' bytes read + written per step / engine.step() time (the step's "
                 "forward/backward reads of parameter shards included); RSS, peak: the largest rank's; "
                 "cache +: system page cache growth over rank 0's run")
    nvme = [r for r in rows if r["mode"] == "nvme"]
    lines.append(f"disk offload's share of the disk's sequential rate (write {write:,.0f}, read {read:,.0f} "
                 "MiB/s: the higher of the two probes), all ranks, median step; need = read / read rate "
                 "+ written / write rate, share = need / window (target >= 70% during the step):")
    for phase, name in (("step", "engine.step()"), ("fb", "forward + backward"), ("all", "the whole step")):
        d = disk_share(nvme, phase, write, read)
        lines.append(f"  {name:<19} read {d['read']:7.1f} MiB, written {d['written']:7.1f} MiB, need "
                     f"{d['need']:6.3f} s, window {d['window']:6.3f} s: share {d['share']:6.1%}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(OUT, "offload_disk.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
