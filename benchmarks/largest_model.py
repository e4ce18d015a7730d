"""Largest GPT that zeroshard can train within a per-process memory budget, on CPU with gloo.

Configurations: stages 0-3, "3+cpu" (stage 3, optimizer and parameters offloaded to host memory) and
"3+nvme" (both on disk: files in a fresh directory under --nvme-dir, removed after each trial). For
each, at --nproc ranks: doubling then bisection over depth at a fixed width. A trial builds the GPT on
every rank, wraps it with zeroshard and runs 2 fp32 AdamW (fused) steps, in fresh processes. It fits
if every rank exits cleanly and its peak RSS (ru_maxrss) plus the peak page-cache growth (/proc/meminfo
Cached + Buffers against before the trial; the whole growth charged to every rank, as the ranks' shares
are unknown) stays within --budget-gib. A watchdog kills a rank whose RSS + page-cache growth passes the
budget (so the machine never runs out); RLIMIT_AS (budget + 2 GiB, plus the offload files a rank maps)
turns a runaway allocation into an error. Out-of-memory errors count as "does not fit"; any other error
stops the search. Targets at 4 ranks: stage 3 >= 3.5x stage 0 (paper), 3+nvme >= 8x (issue 15).

    python benchmarks/largest_model.py                    # full run: 4 ranks x 5 GiB, width 1024
    python benchmarks/largest_model.py --quick            # smoke test, a few minutes
    python benchmarks/largest_model.py --stages 0,3,3+cpu,3+nvme --start-x 8   # disk search from 8x
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import resource
import shutil
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zeroshard
from zeroshard.app.gpt import GPT, GPTConfig, lm_loss
from ranks import free_port

GiB, MiB = 2**30, 2**20
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
OOM_MARKERS = ("can't allocate memory", "MemoryError", "out of memory", "Cannot allocate memory")
CONFIGS = ("0", "1", "2", "3", "3+cpu", "3+nvme")


@dataclass
class Trial:
    layers: int
    fits: bool
    psi: int = 0
    cache_mib: float = 0.0      # peak page-cache growth during the trial (charged to every rank)
    disk_mib: float = 0.0       # largest rank's bytes in offload files (memory_stats()["disk"])
    peak_init_mib: float = 0.0  # largest rank's peak RSS after zeroshard.initialize
    peak_mib: float = 0.0       # largest rank's peak RSS after the training steps
    model_states_mib: float = 0.0
    reason: str = ""
    seconds: float = 0.0


# ---- one rank of one trial (a fresh forked process) ----------------------------------------------
def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def page_cache_mib() -> float:  # the system's page cache and block buffers
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return (info["Cached"] + info["Buffers"]) / 1024


def zero_config(name: str, args: argparse.Namespace, nvme_dir: str | None) -> dict:
    stage, _, offload = name.partition("+")
    zero: dict = {"stage": int(stage)}
    if offload == "cpu":
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    elif offload == "nvme":
        disk = {"device": "nvme", "nvme_path": nvme_dir}
        # max_in_cpu 0: no host cache of parameter shards (its default would hold them all in memory)
        zero.update(sub_group_size=int(args.sub_group_size), offload_param={**disk, "max_in_cpu": 0},
                    offload_optimizer={**disk, "buffer_count": args.buffer_count})
    return {"zero_optimization": zero}


def rank_main(rank: int, port: int, layers: int, name: str, nvme_dir: str | None, args: argparse.Namespace,
              results: mp.Queue) -> None:
    limit = int(args.budget_gib * GiB) + 2 * GiB
    if nvme_dir:  # the rank maps its offload files (16 bytes per owned element): address space, not memory
        limit += 16 * count_params(layers, args) // args.nproc + GiB
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if args.mmap_threshold_kib:  # glibc: serve blocks >= this from mmap, returned to the OS when freed
        ctypes.CDLL(None).mallopt(-3, args.mmap_threshold_kib * 1024)  # -3 = M_MMAP_THRESHOLD
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=args.nproc)
        torch.manual_seed(0)
        if args.construction == "partitioned":  # no rank ever holds the whole model
            with zeroshard.init():
                model = GPT(gpt_config(layers, args))
        else:
            model = GPT(gpt_config(layers, args))
        engine = zeroshard.initialize(model, config=zero_config(name, args, nvme_dir),
                                      optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True))
        peak_init, states, disk = peak_rss_mib(), 0, 0
        for step in range(args.steps):
            tokens = torch.randint(256, (args.batch, args.seq + 1),
                                   generator=torch.Generator().manual_seed(step))
            engine.backward(lm_loss(engine(tokens[:, :-1]), tokens[:, 1:]))
            stats = engine.memory_stats()
            states, disk = max(states, stats["model_states"]), max(disk, stats.get("disk", 0))
            engine.step()
        results.put((rank, "ok", engine.num_parameters(), peak_init, peak_rss_mib(), states / MiB,
                     disk / MiB))
        dist.destroy_process_group()
    except BaseException as e:  # report every failure, out-of-memory or not, to the parent
        detail = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        results.put((rank, "error", 0, 0.0, peak_rss_mib(), 0.0, 0.0, detail))
        results.close()
        results.join_thread()
        os._exit(3)  # do not wait for peers stuck in a collective


# ---- the parent: run a trial, watch its memory, decide ---------------------------------------------
def gpt_config(layers: int, args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(seq_len=args.seq, layers=layers, width=args.width, heads=max(1, args.width // 64))


def count_params(layers: int, args: argparse.Namespace) -> int:
    with torch.device("meta"):  # no memory: just the shapes
        return sum(p.numel() for p in GPT(gpt_config(layers, args)).parameters())


def run_trial(layers: int, name: str, args: argparse.Namespace) -> Trial:
    ctx, budget_mib, t0 = mp.get_context("fork"), args.budget_gib * 1024, time.time()
    nvme_dir = tempfile.mkdtemp(prefix="largest-nvme-", dir=args.nvme_dir) if name.endswith("nvme") else None
    try:
        results, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=rank_main, args=(r, port, layers, name, nvme_dir, args, results),
                             daemon=True) for r in range(args.nproc)]
        cache = [page_cache_mib(), 0.0]  # before the trial, the peak growth since
        for p in procs:
            p.start()
        reason = watch(procs, budget_mib, args.timeout, cache)
        for p in procs:  # a failed or over-budget trial: stop every rank, so none hangs or holds memory
            if p.is_alive():
                p.kill()
            p.join()
        rows = drain(results)
    finally:
        if nvme_dir:  # what a killed rank left too
            shutil.rmtree(nvme_dir, ignore_errors=True)
    reason = reason or failure(rows, [p.exitcode for p in procs], f"{layers} layers at {name}")
    trial = Trial(layers, fits=False, psi=count_params(layers, args), cache_mib=cache[1], reason=reason,
                  seconds=time.time() - t0)
    trial.peak_mib = max((row[4] for row in rows), default=0.0)
    if not reason:
        trial.peak_init_mib = max(row[3] for row in rows)
        trial.model_states_mib = max(row[5] for row in rows)
        trial.disk_mib = max(row[6] for row in rows)
        trial.fits = trial.peak_mib + trial.cache_mib <= budget_mib
        trial.reason = "" if trial.fits else \
            f"peak RSS {trial.peak_mib:.0f} + page cache {trial.cache_mib:.0f} MiB > budget"
    return trial


def failure(rows: list[tuple], exit_codes: list[int], what: str) -> str:
    """'' if every rank finished; why not, if out of memory or killed; raises on any other error."""
    errors = [row[7] for row in rows if row[1] == "error"]
    oom = [e for e in errors if any(m in e for m in OOM_MARKERS)]
    if oom:
        return "out of memory: " + oom[0].splitlines()[0][:120]
    if any(code is not None and code < 0 for code in exit_codes):  # e.g. SIGKILL, SIGABRT on bad_alloc
        return f"a rank was killed: exit codes {exit_codes}"
    if errors or len(rows) < len(exit_codes):
        raise RuntimeError(f"trial with {what} failed (not out of memory), exit codes {exit_codes}:\n"
                           + (errors[0] if errors else "a rank exited without a report"))
    return ""


def watch(procs: list, budget_mib: float, timeout: float, cache: list[float]) -> str:
    """Poll the ranks' RSS and page-cache growth (its peak: cache[1]) until all exit: why stopped, or ''."""
    start = time.time()
    while any(p.is_alive() for p in procs):
        grown = cache[1] = max(cache[1], page_cache_mib() - cache[0])
        for p in procs:
            try:
                rss = psutil.Process(p.pid).memory_info().rss / MiB
            except psutil.Error:
                continue
            if rss + grown > budget_mib:
                return f"killed: RSS {rss:.1f} + page cache {grown:.1f} MiB > budget {budget_mib:.1f} MiB"
        if any(p.exitcode not in (None, 0) for p in procs):
            time.sleep(0.5)  # let the failing rank's report arrive
            return ""
        if time.time() - start > timeout:
            return f"timeout after {timeout:.0f} s"
        time.sleep(0.05)
    return ""


def drain(results: mp.Queue) -> list[tuple]:
    rows = []
    while True:
        try:
            rows.append(results.get(timeout=0.2))
        except queue.Empty:
            return rows


# ---- the search ----------------------------------------------------------------------------------
def largest(name: str, start: int, args: argparse.Namespace, log: list[dict]) -> Trial | None:
    """Doubling from `start` layers until a trial does not fit, then bisection to --tol."""
    def attempt(layers: int) -> Trial:
        t = run_trial(layers, name, args)
        log.append({"config": name, **asdict(t)})
        peak = f"peak {t.peak_mib:.0f} MiB (after init {t.peak_init_mib:.0f}) + page cache " \
               f"{t.cache_mib:.0f} MiB" if t.peak_init_mib else ""
        print(f"{name:>6} layers {layers:4d} Ψ={t.psi:,}: {'fits' if t.fits else 'does not fit'} "
              f"{peak} {t.reason} [{t.seconds:.0f} s]", flush=True)
        return t
    best, layers = None, max(1, start)
    while layers <= args.max_layers:
        t = attempt(layers)
        if not t.fits:
            break
        best, layers = t, layers * 2
    lo, hi = (best.layers if best else 0), min(layers, args.max_layers + 1)  # lo fits, hi does not
    while hi - lo > max(1, int(args.tol * lo)):
        mid = (lo + hi) // 2
        t = attempt(mid)
        if t.fits:
            best, lo = t, mid
        else:
            hi = mid
    return best


def depth_for(psi: float, args: argparse.Namespace) -> int:
    """The fewest layers whose GPT has at least `psi` parameters."""
    one, two = count_params(1, args), count_params(2, args)
    return max(1, -int(-(psi - one) // (two - one)) + 1)


def paper_ratio(name: str, n: int) -> str:
    """Largest Ψ relative to stage 0 if only fp32 Adam model states (16 bytes/param at stage 0) counted
    (host offload on a CPU machine moves them from host memory to host memory: stage 3's; "-": 3+nvme)."""
    bytes_per_param = {"0": 16, "1": 8 + 8 / n, "2": 4 + 12 / n, "3": 16 / n, "3+cpu": 16 / n}.get(name)
    return f"{16 / bytes_per_param:.2f}" if bytes_per_param else "-"


def report(args: argparse.Namespace, best: dict[str, Trial | None]) -> str:
    base = best.get("0")
    nvme = f"; 3+nvme: sub_group_size {args.sub_group_size:g}, buffer_count {args.buffer_count}"
    lines = [f"Largest GPT (width {args.width}, seq {args.seq}, batch {args.batch}/rank, {args.steps} "
             f"fp32 AdamW steps) within {args.budget_gib:g} GiB peak RSS + page-cache growth per rank, "
             f"{args.nproc} ranks x 1 thread, gloo, glibc mmap threshold "
             f"{args.mmap_threshold_kib or 'default'}, "
             f"{args.construction} construction" + (nvme if "3+nvme" in best else ""), "",
             "| config | layers | Ψ | x stage 0 | paper, model states only | peak RSS/rank (MiB) | "
             "page cache + (MiB) | RSS + cache (MiB) | peak after init (MiB) | model states/rank (MiB) | "
             "disk/rank (MiB) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in best.items():
        if t is None:
            lines.append(f"| {name} | none fits | - | - | {paper_ratio(name, args.nproc)} |" + " - |" * 6)
            continue
        ratio = f"{t.psi / base.psi:.2f}" if base else "-"
        lines.append(f"| {name} | {t.layers} | {t.psi:,} | {ratio} | {paper_ratio(name, args.nproc)} | "
                     f"{t.peak_mib:.0f} | {t.cache_mib:.0f} | {t.peak_mib + t.cache_mib:.0f} | "
                     f"{t.peak_init_mib:.0f} | {t.model_states_mib:.0f} | {t.disk_mib:.0f} |")
    for name, target in (("3", 3.5), ("3+nvme", 8.0)):
        if base and best.get(name) and args.nproc == 4:
            ratio = best[name].psi / base.psi
            lines += ["", f"{name} / stage 0 = {ratio:.2f} (target at 4 ranks: >= {target:g}): "
                          f"{'met' if ratio >= target else 'NOT met'}"]
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--stages", default=",".join(CONFIGS), help=f"configurations, of {', '.join(CONFIGS)}")
    p.add_argument("--budget-gib", type=float, default=5.0,
                   help="peak RSS + page-cache growth per rank (default 5: 4 ranks in 20 GiB)")
    p.add_argument("--width", type=int, default=1024, help="fixed width; the search is over depth")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1,
                   help="per rank (small: model states dominate, as in the paper)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tol", type=float, default=0.05, help="stop bisecting when hi - lo <= tol * lo layers")
    p.add_argument("--max-layers", type=int, default=1024)
    p.add_argument("--start-x", type=float, default=0.0,
                   help="start 3+nvme's search at this multiple of stage 0's Ψ (0: where the previous "
                        "configuration's search ended)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per trial")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="3+nvme: trials' files go under it")
    p.add_argument("--sub-group-size", type=float, default=5e6, help="3+nvme: sub_group_size (elements)")
    p.add_argument("--buffer-count", type=int, default=2, help="3+nvme: offload_optimizer.buffer_count")
    p.add_argument("--mmap-threshold-kib", type=int, default=0,
                   help="pin glibc's mmap threshold (e.g. 64), so freed tensors leave RSS; "
                        "default: glibc's own")
    p.add_argument("--construction", choices=["partitioned", "ordinary"], default="partitioned",
                   help="build the model under zeroshard.init() (default) or in full on every rank")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2 ranks x 0.6 GiB, width 256, coarse search")
    args = p.parse_args()
    if args.quick:
        args.nproc, args.budget_gib, args.width, args.seq, args.tol = 2, 0.6, 256, 32, 0.25
    args.stages = args.stages.split(",")
    if not set(args.stages) <= set(CONFIGS):
        p.error(f"--stages: unknown {sorted(set(args.stages) - set(CONFIGS))}")
    return args


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # torch.optim's first use imports ~3 s of
    # modules (torch._dynamo): do it once here, where every forked trial inherits it
    best: dict[str, Trial | None] = {}
    log: list[dict] = []
    start = 1
    for name in args.stages:  # a later one holds less per rank: start where the previous one ended
        if name == "3+nvme" and args.start_x and best.get("0"):
            start = depth_for(args.start_x * best["0"].psi, args)
        best[name] = largest(name, start, args, log)
        start = best[name].layers if best[name] else 1
    text = report(args, best)
    print(text)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "largest_model.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(OUT, "largest_model.json"), "w") as f:
        json.dump({"args": vars(args), "trials": log}, f, indent=1)


if __name__ == "__main__":
    main()
