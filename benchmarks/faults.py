"""Faults: elastic restart, divergence detection time, the cost of check_collectives, and a soak.

Four parts, each in fresh processes (gloo on the CPU, one thread per rank):

1. restart: `zeroshard train` on 3 ranks (the tiny GPT, 60 steps, --max-restarts 2 --save-every 10),
   once uninterrupted and then --drills times with one rank SIGKILLed before a seeded random step
   (the ZEROSHARD_DRILL_KILL hook of zeroshard/app/restart.py). Reported: the restart time the run
   prints (end of the failed attempt's last step to the end of the first step after resuming), the
   same read here from the progress file, when the launcher reported the failure and when the
   restarted group printed that it resumed, the steps lost, and the max abs difference between the
   final weights (both final checkpoints consolidated) and the losses of the uninterrupted run.
2. divergence: each drill of tests/faults/test_divergence.py (its model, config and faults: rank 1
   skips a unit at stage 3, steps without rank 0, or calls backward twice, at step 2 of 4) with
   check_collectives on, at each --collective-timeouts value: seconds from rank 1's faulty call to
   the DivergenceError on each rank (CLOCK_MONOTONIC, shared by the processes), and what found it.
3. overhead: `"zeroshard": {"check_collectives": true}` on and off, stages 3 and 2, 2 ranks: four
   engines of the same GPT in one world, stepped in interleaved rounds (a stage's on and off back to
   back, their order alternating; a barrier before each step, the slowest rank's time); median step
   time of each, on/off ratios, and the wall time spent inside the engine's check() calls.
4. soak: --steps steps at stage 3 on 2 ranks (defaults: overlap_comm and prefetch on): RSS per rank
   every 100 steps after the warm-up and its linear-fit slope in MiB per 1,000 steps, with glibc's
   heap in use beside it, live tensors (gc.get_objects()) every 500 steps, and the number of distinct
   comm_stats()["last_step"] values.

    .venv/bin/python benchmarks/faults.py            # everything (8 minutes on a quiet 2-core machine)
    .venv/bin/python benchmarks/faults.py --quick    # smoke test of every part, tiny sizes (~1 minute)
    .venv/bin/python benchmarks/faults.py --parts soak --steps 5000

Writes benchmarks/out/faults.{md,json} and the train runs' logs, benchmarks/out/faults_restart_*.log (--stem
renames them).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_step import OUT, write
from ranks import free_port, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ["restart", "divergence", "overhead", "soak"]
DRILLS = [(3, "skip_unit"), (3, "step_alone"), (3, "backward_twice"), (2, "backward_twice"),
          (2, "step_alone")]  # (stage, fault): those of tests/faults/test_divergence.py
MIB = 2**20


def setup(rank: int, world: int, port: int, timeout_s: float = 300) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renamed collectives
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def spawn(worker, args: argparse.Namespace, nproc: int) -> dict:
    """worker(rank, nproc, port, args, out) on nproc fresh ranks; rank 0's JSON at `out`."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        mp.spawn(worker, args=(nproc, free_port(), args, out), nprocs=nproc, join=True)
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def gpt(layers: int, width: int, seq: int):
    from zeroshard.app.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=seq, layers=layers, width=width, heads=max(1, width // 32)))


def corpus_batches(seq: int):
    from zeroshard.app.data import Batches, load_corpus
    return Batches(load_corpus(None, max_bytes=1_000_000), seq)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


# ---- 1. restart -----------------------------------------------------------------------------------
RESTART_LINE = re.compile(r"restarts: (\d+); resumed from step (\d+), steps lost: (\w+)"
                          r"(?:, ([\d.]+) s from the failure)?")


def train_run(out: str, label: str, drill: str | None, args: argparse.Namespace) -> dict:
    """`zeroshard train` as a user types it, its output time-stamped line by line as it comes and
    its progress file polled every 20 ms (rank 0 rewrites it after every step)."""
    from zeroshard.app.restart import DRILL_ENV, PROGRESS
    cmd = [sys.executable, "-m", "zeroshard", "train", "--device", "cpu", "--nproc", str(args.restart_nproc),
           "--size", "tiny", "--steps", str(args.restart_steps), "--max-restarts", "2",
           "--save-every", str(args.save_every), "--out", out]
    env = {k: v for k, v in os.environ.items() if k != DRILL_ENV}
    env.update(PYTHONUNBUFFERED="1", **({DRILL_ENV: drill} if drill else {}))
    lines: list[tuple[float, str]] = []
    os.makedirs(OUT, exist_ok=True)
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)  # its own process group: killed whole on a hang

    def pump() -> None:  # text mode reads tqdm's \r-separated updates as lines too
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    trace, last, path = [], None, os.path.join(out, PROGRESS)
    while proc.poll() is None:
        if time.time() - start > args.run_timeout:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its ranks and their helpers
            lines.append((time.time(), f"faults.py: killed after {args.run_timeout} s (a hang)"))
            proc.wait()
            break
        try:
            with open(path) as f:
                record = json.load(f)
            if (record["step"], record["time"]) != last:
                last = (record["step"], record["time"])
                trace.append(last)
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    reader.join(10)
    wall = time.time() - start
    with open(os.path.join(OUT, f"{args.stem}_restart_{label}.log"), "w") as f:
        f.write(" ".join(cmd) + (f"   ({DRILL_ENV}={drill})" if drill else "") + "\n")
        f.writelines(f"{t - start:9.3f}  {text}\n" for t, text in lines)
    result = {"label": label, "drill": drill, "returncode": proc.returncode, "wall_s": wall,
              "first_step_after_s": trace[0][1] - start if trace else None}
    printed = next((RESTART_LINE.search(text) for _, text in lines if RESTART_LINE.search(text)), None)
    if printed:
        result.update(restarts=int(printed.group(1)), resumed_from=int(printed.group(2)),
                      steps_lost=int(printed.group(3)) if printed.group(3).isdigit() else printed.group(3),
                      restart_s=float(printed.group(4)) if printed.group(4) else None)
    # The failed attempt's last step ends where the step count first goes down (the resumed run
    # rewrites the file from its own first step on).
    drop = next((i for i in range(1, len(trace)) if trace[i][0] < trace[i - 1][0]), None)
    if drop is not None:
        failed_at = trace[drop - 1][1]
        noticed = next((t for t, text in lines if "failed (exitcode" in text and t >= failed_at), None)
        resumed = next((t for t, text in lines if text.startswith("restart ") and "resuming" in text), None)
        result.update(failed_step=trace[drop - 1][0], first_step_seen=trace[drop][0],
                      restart_s_seen=trace[drop][1] - failed_at,
                      launcher_noticed_s=None if noticed is None else noticed - failed_at,
                      resumed_printed_s=None if resumed is None else resumed - failed_at)
    if proc.returncode == 0:
        import zeroshard
        checkpoints = os.path.join(out, "checkpoints")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result["weights"] = zeroshard.consolidate(checkpoints)
                result["losses"] = zeroshard.checkpoint_info(checkpoints)["client_state"]["losses"]
        except Exception as e:  # noqa: BLE001 - reported in the table's place
            lines.append((time.time(), f"faults.py: cannot read the final checkpoint: {e}"))
    if proc.returncode != 0 or "weights" not in result:
        result["tail"] = [text for _, text in lines[-15:]]
    return result


def restart(args: argparse.Namespace) -> tuple[list[str], dict]:
    root = tempfile.mkdtemp(prefix="zeroshard-faults-")
    rng = random.Random(args.seed)
    targets = [(rng.randrange(args.restart_nproc), rng.randrange(1, args.restart_steps))
               for _ in range(args.drills)]
    try:
        clean = train_run(os.path.join(root, "clean"), "clean", None, args)
        runs = [train_run(os.path.join(root, f"drill{i}"), f"drill{i}", f"{rank}:{step}", args)
                for i, (rank, step) in enumerate(targets)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [f"## 1. Restart: `zeroshard train --nproc {args.restart_nproc} --size tiny --steps "
             f"{args.restart_steps} --max-restarts 2 --save-every {args.save_every}`, one rank SIGKILLed",
             "", f"uninterrupted: exit {clean['returncode']}, wall {clean['wall_s']:.1f} s "
             f"(first step done {_fmt(clean['first_step_after_s'])} s after launch)", "",
             "| killed | exit | restarts | resumed from | steps lost | restart s (printed) | restart s "
             "(progress file) | launcher noticed s | resumed printed s | wall s | extra wall s "
             "| max abs weight diff | max abs loss diff |", "|" + "---|" * 13]
    for run in runs:
        diff = loss_diff = None
        if "weights" in run and "weights" in clean:
            a, b = run["weights"], clean["weights"]
            diff = float("inf") if a.keys() != b.keys() else max(
                (x.float() - b[k].float()).abs().max().item() for k, x in a.items() if x.numel())
            loss_diff = float("inf") if len(run["losses"]) != len(clean["losses"]) else max(
                abs(x - y) for x, y in zip(run["losses"], clean["losses"]))
        run["max_abs_weight_diff"], run["max_abs_loss_diff"] = diff, loss_diff
        rank, step = run["drill"].split(":")
        lines.append(f"| rank {rank} before step {step} | {run['returncode']} | {run.get('restarts', '-')} | "
                     f"{run.get('resumed_from', '-')} | {run.get('steps_lost', '-')} | "
                     f"{_fmt(run.get('restart_s'))} | {_fmt(run.get('restart_s_seen'))} | "
                     f"{_fmt(run.get('launcher_noticed_s'))} | {_fmt(run.get('resumed_printed_s'))} | "
                     f"{run['wall_s']:.1f} | {run['wall_s'] - clean['wall_s']:+.1f} | {_fmt(diff, '.1e')} | "
                     f"{_fmt(loss_diff, '.1e')} |")
        if "tail" in run:
            lines += ["", f"drill {run['drill']} failed; its last lines:", *("    " + t for t in run["tail"])]
    if "tail" in clean:
        lines += ["", "the uninterrupted run failed; its last lines:", *("    " + t for t in clean["tail"])]
    lines += ["", "restart s: from the end of the failed attempt's last step (the kill follows at once) to "
              "the end of the first step after resuming; launcher noticed / resumed printed: when the "
              "launcher logged the failure and when the restarted rank 0 printed `restart 1: resuming`, "
              "from the same origin. Weights: both final checkpoints consolidated."]
    for run in [clean, *runs]:
        run.pop("weights", None)
    return lines, {"targets": targets, "clean": clean, "drills": runs}


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


# ---- 2. divergence --------------------------------------------------------------------------------
def drill_worker(rank: int, world: int, port: int, stage: int, fault: str, timeout: float, out: str) -> None:
    """One rank of a drill of tests/faults/test_divergence.py, its faulty call time-stamped."""
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "faults")]
    from helpers.models import loss_fn
    from test_divergence import Stack  # the drills' own model
    import zeroshard
    setup(rank, world, port, timeout_s=60)
    torch.manual_seed(0)
    config = {"zero_optimization": {"stage": stage},
              "zeroshard": {"check_collectives": True, "collective_timeout": timeout}}
    engine = zeroshard.initialize(Stack(), lambda p: torch.optim.SGD(p, lr=0.1), config)
    result: dict = {"error": None, "fault_at": None}
    try:  # test_divergence._train, with the moment of rank 1's faulty call noted
        g = torch.Generator().manual_seed(rank)
        for step in range(4):
            x = torch.randint(0, 37, (2, 8), generator=g)
            faulty = rank == 1 and step == 2
            if faulty and fault == "skip_unit":
                result["fault_at"] = time.monotonic()
            skip = 1 if fault == "skip_unit" and faulty else None
            engine.backward(loss_fn(engine(x, skip=skip), x))
            if fault == "backward_twice" and faulty:
                result["fault_at"] = time.monotonic()
                engine.backward(loss_fn(engine(x), x))
            if fault == "step_alone" and faulty:
                result["fault_at"] = time.monotonic()
                continue  # rank 0 steps alone
            engine.step()
    except Exception as e:  # noqa: BLE001 - reported, judged by the parent
        result.update(error=type(e).__name__, message=str(e))
    result["error_at"] = time.monotonic()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # a collective may still be in flight: no orderly teardown of the group


def drill(stage: int, fault: str, timeout: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    port, directory = free_port(), tempfile.mkdtemp(prefix="zeroshard-drill-")
    procs = [ctx.Process(target=drill_worker, args=(r, 2, port, stage, fault, timeout, directory))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    ranks = []
    for r in range(2):
        try:
            with open(os.path.join(directory, f"{r}.json")) as f:
                ranks.append(json.load(f))
        except OSError:
            ranks.append({"error": "hung" if r in hung else "no report"})
    shutil.rmtree(directory, ignore_errors=True)
    fault_at = ranks[1].get("fault_at")
    for r in ranks:
        r["seconds"] = r["error_at"] - fault_at if fault_at is not None and "error_at" in r else None
        message = r.pop("message", "") or ""
        r["reason"] = message.split("\n")[0].split(": ", 1)[-1]
        r["found_by"] = found_by(r["reason"]) if r["error"] == "DivergenceError" else r["error"] or "-"
        r["named"] = "collectives diverged at call #" in message
    return {"stage": stage, "fault": fault, "timeout": timeout, "ranks": ranks}


def found_by(reason: str) -> str:
    """The mechanism behind a DivergenceError, from the first line of its message (diverge.py)."""
    if "differ from rank 0's at the start of" in reason:
        return "check at " + reason.rsplit("start of ", 1)[1].rstrip(".")
    if "did not reach" in reason:
        return "check: rank 0 absent"
    if "calls differ from this rank's" in reason:
        return "stalled ranks compared"
    if "waited" in reason:
        return "bounded wait"  # the timeout, or a peer's alarm seen between 1 s slices
    return "collective failed" if "failed" in reason else reason[:60]


def divergence(args: argparse.Namespace) -> tuple[list[str], dict]:
    runs = [drill(stage, fault, t) for t in args.collective_timeouts for stage, fault in args.drill_list]
    lines = ["## 2. Divergence detection (2 ranks, check_collectives on; the drills of "
             "tests/faults/test_divergence.py)", "",
             "| stage | drill | collective_timeout s | rank 0 s | rank 1 s | error (0 / 1) | first "
             "difference named | found by (rank 0 / rank 1) |", "|" + "---|" * 8]
    for run in runs:
        r0, r1 = run["ranks"]
        lines.append(f"| {run['stage']} | {run['fault']} | {run['timeout']:g} | "
                     f"{_fmt(r0['seconds'], '.2f')} | {_fmt(r1['seconds'], '.2f')} | "
                     f"{r0['error']} / {r1['error']} | {'yes' if r0['named'] and r1['named'] else 'NO'} | "
                     f"{r0['found_by']} / {r1['found_by']} |")
    lines += ["", "seconds: from rank 1's faulty call (the forward that skips a unit, the second forward + "
              "backward, or the skipped step()) to the DivergenceError on each rank. Found by: the store "
              "check at the start of backward/step, stalled ranks comparing how far they got (each "
              "second of a stalled wait), or a bounded wait (a collective that waited "
              "collective_timeout, or saw a peer's alarm; waits look for one every second)."]
    return lines, {"runs": runs}


# ---- 3. overhead of check_collectives -------------------------------------------------------------
def overhead_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import zeroshard
    from zeroshard.app.gpt import lm_loss
    setup(rank, world, port)
    data = corpus_batches(args.seq)
    names = [f"stage{s}_{'on' if on else 'off'}" for s in args.stages for on in (True, False)]
    engines, in_check = {}, {}
    for name in names:
        config = {"zero_optimization": {"stage": int(name[5])}}
        if name.endswith("_on"):
            config["zeroshard"] = {"check_collectives": True}
        engine = zeroshard.initialize(gpt(args.layers, args.width, args.seq),
                                      lambda p: torch.optim.AdamW(p, lr=1e-3), config)
        engines[name], in_check[name] = engine, [0.0]
        watch = engine.comm.watch  # the time spent in its check() calls (a no-op when off)

        def timed(phase: str, check=watch.check, spent=in_check[name]) -> None:
            t0 = time.perf_counter()
            try:
                check(phase)
            finally:
                spent[0] += time.perf_counter() - t0
        watch.check = timed
    rounds = args.warmup + args.timed
    shape = (len(names), rounds)
    times, losses, checks = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    pairs = [names[i:i + 2] for i in range(0, len(names), 2)]  # (on, off) of one stage
    for r in range(rounds):
        x, y = data.get("train", args.batch, torch.Generator().manual_seed(1_000_003 * r + rank))
        # on and off of a stage run back to back (their ratio is paired); which goes first, and
        # which stage, alternate from round to round
        order = [n for pair in pairs[r % len(pairs):] + pairs[:r % len(pairs)]
                 for n in (pair if (r // len(pairs)) % 2 == 0 else pair[::-1])]
        for name in order:
            i, engine = names.index(name), engines[name]
            in_check[name][0] = 0.0
            dist.barrier()
            start = time.perf_counter()
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            times[i, r] = time.perf_counter() - start
            losses[i, r], checks[i, r] = loss.detach(), in_check[name][0]
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's
    dist.all_reduce(losses)
    per_rank = zeroshard.gather_objects(checks[:, args.warmup:].tolist())
    psi = engines[names[0]].num_parameters()
    write_json(out, {"names": names, "times": times[:, args.warmup:].tolist(),
                     "losses": (losses / world).tolist(), "check_s": per_rank, "psi": psi}, rank)


def overhead(args: argparse.Namespace) -> tuple[list[str], dict]:
    raw = spawn(overhead_worker, args, 2)
    times = dict(zip(raw["names"], raw["times"]))
    losses = dict(zip(raw["names"], raw["losses"]))
    checks = [dict(zip(raw["names"], mine)) for mine in raw["check_s"]]
    lines = [f"## 3. check_collectives overhead (2 ranks, GPT {args.layers} x {args.width}, "
             f"Ψ = {raw['psi']:,}, seq {args.seq}, batch {args.batch}/rank, fp32 AdamW; "
             f"{args.timed} interleaved rounds after {args.warmup} warm-up)", "",
             "| stage | median step off (ms) | median step on (ms) | on / off (medians) | on / off (median "
             "of per-round ratios) | per-round ratio IQR | in check() per step, rank 0 / 1 (ms) | "
             "check / step off | losses on = off |", "|" + "---|" * 9]
    summary = {}
    for stage in args.stages:
        on, off = times[f"stage{stage}_on"], times[f"stage{stage}_off"]
        ratios = sorted(a / b for a, b in zip(on, off))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        same = losses[f"stage{stage}_on"] == losses[f"stage{stage}_off"]
        in_check = [1e3 * statistics.median(c[f"stage{stage}_on"]) for c in checks]
        off_ms = 1e3 * statistics.median(off)
        summary[stage] = {"off_ms": off_ms, "on_ms": 1e3 * statistics.median(on),
                          "ratio": statistics.median(on) / statistics.median(off),
                          "paired_ratio": statistics.median(ratios), "iqr": [q[0], q[2]],
                          "check_ms": in_check, "check_share": max(in_check) / off_ms, "same_losses": same}
        s = summary[stage]
        lines.append(f"| {stage} | {s['off_ms']:.1f} | {s['on_ms']:.1f} | {s['ratio']:.4f} | "
                     f"{s['paired_ratio']:.4f} | {q[0]:.3f}-{q[2]:.3f} | "
                     f"{' / '.join(f'{c:.2f}' for c in in_check)} | {100 * s['check_share']:.2f}% | "
                     f"{'yes' if same else 'NO'} |")
    lines += ["", "a step: from a barrier to the end of engine.step() (forward, backward, step), the slowest "
              "rank's; in check(): the wall time inside the engine's two checks per step (backward, step; "
              "the store round trips, and on rank 1 the wait for rank 0's record), median over rounds; "
              "target: on / off <= 1.02"]
    return lines, {"summary": summary, **raw}


# ---- 4. soak --------------------------------------------------------------------------------------
def live_tensors() -> tuple[int, int]:
    """Tensors the garbage collector can see, and the bytes of their distinct storages."""
    gc.collect()
    count, storages = 0, {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor):
                count += 1
                if obj.device.type != "meta":
                    storage = obj.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        except Exception:  # noqa: BLE001 - a deferred or odd tensor: counted, not sized
            pass
    return count, sum(storages.values())


def heap_in_use_mib() -> float | None:
    """glibc's bytes handed out and not freed, over every arena and mmap (malloc_info), in MiB:
    what RSS would be without the allocator's free lists. None where glibc's malloc_info is missing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.fdopen.restype, libc.fdopen.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_char_p]
        libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
        with tempfile.TemporaryFile() as f:
            stream = libc.fdopen(os.dup(f.fileno()), b"w")
            libc.malloc_info(0, stream)
            libc.fclose(stream)
            f.seek(0)
            xml = f.read().decode()
        totals = xml[xml.rfind("</heap>"):]  # the totals over all arenas follow the last arena

        def size(tag: str, kind: str) -> int:
            return int(re.search(rf'<{tag} type="{kind}"[^>]*size="(\d+)"', totals).group(1))
        return (size("system", "current") + size("total", "mmap") - size("total", "fast")
                - size("total", "rest")) / MIB
    except (OSError, AttributeError, ValueError):
        return None


def soak_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import zeroshard
    from zeroshard.app.gpt import lm_loss
    if args.mmap_threshold_kib:  # glibc: blocks >= this from mmap, returned to the OS when freed
        ctypes.CDLL(None).mallopt(-3, args.mmap_threshold_kib * 1024)  # -3 = M_MMAP_THRESHOLD
    setup(rank, world, port)
    data = corpus_batches(args.soak_seq)
    engine = zeroshard.initialize(gpt(args.soak_layers, args.soak_width, args.soak_seq),
                                  lambda p: torch.optim.AdamW(p, lr=1e-3),
                                  {"zero_optimization": {"stage": 3}})  # overlap_comm, prefetch: defaults
    rss, tensors, kinds, first_seen, losses = [], [], Counter(), {}, []
    times = torch.zeros(args.steps, dtype=torch.float64)  # allocated once: the soak's own lists stay small
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = data.get("train", args.soak_batch, torch.Generator().manual_seed(1_000_003 * step + rank))
        t0 = time.perf_counter()
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        times[step - 1] = time.perf_counter() - t0
        key = json.dumps(engine.comm_stats()["last_step"], sort_keys=True)
        kinds[key] += 1
        first_seen.setdefault(key, step)
        if step >= args.soak_warmup and step % args.rss_every == 0:
            rss.append((step, rss_mib(), heap_in_use_mib()))
        if step == args.soak_warmup or step % args.tensors_every == 0:
            tensors.append((step, *live_tensors(), len(gc.get_objects())))
        if step % args.rss_every == 0:
            losses.append((step, loss.item()))
    wall = time.perf_counter() - start
    mine = {"rss": rss, "tensors": tensors, "distinct_last_step": len(kinds),
            "last_step_values": [{"first_step": first_seen[k], "steps": n, "value": json.loads(k)}
                                 for k, n in kinds.most_common()],
            "median_step_ms": 1e3 * statistics.median(times.tolist()), "wall_s": wall, "losses": losses}
    per_rank = zeroshard.gather_objects(mine)
    write_json(out, {"ranks": per_rank, "psi": engine.num_parameters()}, rank)


def soak(args: argparse.Namespace) -> tuple[list[str], dict]:
    raw = spawn(soak_worker, args, 2)
    malloc = f"glibc mmap threshold {args.mmap_threshold_kib} KiB" if args.mmap_threshold_kib else \
        "glibc malloc defaults"
    lines = [f"## 4. Soak: {args.steps} steps, stage 3 (overlap_comm and prefetch: defaults), 2 ranks, GPT "
             f"{args.soak_layers} x {args.soak_width} (Ψ = {raw['psi']:,}), seq {args.soak_seq}, batch "
             f"{args.soak_batch}/rank, fp32 AdamW, {malloc}", "",
             "| rank | median step ms | wall s | RSS first / last (MiB) | RSS slope (MiB / 1000 steps) | "
             "heap in use first / last (MiB) | heap slope | live tensors (step: count) | tensor bytes "
             "first / last (MiB) | Python objects first / last | distinct last_step (from step 2) |",
             "|" + "---|" * 11]

    def slope(points: list[tuple[int, float]]) -> float:
        if len(points) < 2 or any(v is None for _, v in points):
            return float("nan")
        return 1000 * statistics.linear_regression(*zip(*points)).slope
    for r, mine in enumerate(raw["ranks"]):
        mib, heap = [(s, m) for s, m, _ in mine["rss"]], [(s, h) for s, _, h in mine["rss"]]
        mine["rss_slope_mib_per_1000"], mine["heap_slope_mib_per_1000"] = slope(mib), slope(heap)
        t = mine["tensors"]
        later = sum(1 for v in mine["last_step_values"] if v["steps"] > 1 or v["first_step"] > 1)
        lines.append(f"| {r} | {mine['median_step_ms']:.1f} | {mine['wall_s']:.0f} | {mib[0][1]:.1f} / "
                     f"{mib[-1][1]:.1f} | {slope(mib):+.3f} | {_fmt(heap[0][1])} / {_fmt(heap[-1][1])} | "
                     f"{slope(heap):+.3f} | {', '.join(f'{x[0]}: {x[1]}' for x in t)} | "
                     f"{t[0][2] / MIB:.2f} / {t[-1][2] / MIB:.2f} | {t[0][3]:,} / {t[-1][3]:,} | "
                     f"{mine['distinct_last_step']} ({later}) |")
    lines += ["", f"RSS and heap in use (glibc malloc_info: allocated and not freed, all arenas) sampled "
              f"every {args.rss_every} steps from step {args.soak_warmup}; live tensors (gc.get_objects(), "
              f"after gc.collect()) at step {args.soak_warmup} and every {args.tensors_every}; targets: RSS "
              "slope < 1 MiB / 1000 steps, tensors not growing, 1 distinct comm_stats()['last_step']"]
    for r, mine in enumerate(raw["ranks"]):
        usual = mine["last_step_values"][0]
        lines.append(f"rank {r}: last_step on {usual['steps']} of {args.steps} steps: {usual['value']}")
        for v in mine["last_step_values"][1:4]:
            lines.append(f"rank {r}: a different last_step on {v['steps']} step(s), first at step "
                         f"{v['first_step']}: {v['value']}")
    return lines, raw


# ---- main -----------------------------------------------------------------------------------------
def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    p.add_argument("--quick", action="store_true", help="smoke test: tiny sizes and few steps everywhere")
    p.add_argument("--seed", type=int, default=0, help="picks the killed rank and step (restart)")
    p.add_argument("--stem", default="faults", help="writes benchmarks/out/STEM.{md,json} (default faults)")
    g = p.add_argument_group("restart")
    g.add_argument("--restart-nproc", type=int, default=3)
    g.add_argument("--restart-steps", type=int, default=60)
    g.add_argument("--save-every", type=int, default=10)
    g.add_argument("--drills", type=int, default=2, help="killed runs, each at a seeded random rank and step")
    g.add_argument("--run-timeout", type=int, default=600, help="seconds before a train run counts as hung")
    g = p.add_argument_group("divergence")
    g.add_argument("--collective-timeouts", default="2,60", help="zeroshard.collective_timeout values, "
                   "seconds (default 2,60; the drill tests use 2 and 45)")
    g.add_argument("--drill-list", default=",".join(f"{s}:{f}" for s, f in DRILLS),
                   help="stage:fault pairs (default: every drill of tests/faults/test_divergence.py)")
    g = p.add_argument_group("overhead")
    for flag, default in dict(layers=6, width=256, seq=128, batch=4, warmup=3, timed=40).items():
        g.add_argument(f"--{flag}", type=int, default=default, help=f"default {default}")
    g.add_argument("--stages", default="3,2")
    g = p.add_argument_group("soak")
    g.add_argument("--steps", type=int, default=2000, help="soak steps (default 2000)")
    for flag, default in dict(soak_layers=4, soak_width=128, soak_seq=64, soak_batch=8, soak_warmup=200,
                              rss_every=100, tensors_every=500).items():
        g.add_argument(f"--{flag.replace('_', '-')}", type=int, default=default, help=f"default {default}")
    g.add_argument("--mmap-threshold-kib", type=int, default=0,
                   help="pin glibc's mmap threshold in the soak's ranks (e.g. 64: freed blocks of 64 KiB "
                        "and more go back to the OS); default: glibc's own, dynamic")
    args = p.parse_args()
    if args.quick:
        args.restart_nproc, args.restart_steps, args.save_every, args.drills = 2, 12, 4, 1
        args.collective_timeouts, args.drill_list = "2", "3:skip_unit,2:backward_twice"
        args.layers, args.width, args.seq, args.batch, args.warmup, args.timed = 2, 64, 32, 2, 2, 6
        args.steps, args.soak_layers, args.soak_width, args.soak_seq, args.soak_batch = 300, 2, 64, 32, 4
        args.soak_warmup, args.rss_every, args.tensors_every = 100, 25, 100
    args.collective_timeouts = [float(t) for t in args.collective_timeouts.split(",")]
    args.drill_list = [(int(s), f) for s, f in (d.split(":") for d in args.drill_list.split(","))]
    args.stages = [int(s) for s in args.stages.split(",")]
    return args


def main() -> None:
    args = parse()
    begun = time.time()
    header = [f"# Faults ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPU cores, "
              f"torch {torch.__version__}, gloo, 1 thread per rank{'; --quick' if args.quick else ''})", ""]
    data = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
            "torch": torch.__version__, "args": vars(args)}
    lines = list(header)
    for part in args.parts:
        began = time.time()
        print(f"[{part}] ...", flush=True)
        text, data[part] = globals()[part](args)
        data[part]["wall_s"] = time.time() - began
        lines += text + ["", f"({part}: {time.time() - began:.0f} s of wall time)", ""]
        print("\n".join(text), flush=True)
    lines.append(f"total wall time {time.time() - begun:.0f} s")
    print()
    write(args.stem, lines, data)


if __name__ == "__main__":
    main()
