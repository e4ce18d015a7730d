"""One GPU, world size 1: zeroshard against torch AMP and FSDP2 on a Llama-shaped model (issue 12's table).

Every implementation trains the same Hugging Face Llama (built from a config, nothing downloaded) on the
same random tokens in bf16 with AdamW (fused where the implementation allows), each in a fresh process
(so its GPU peak is its own), in interleaved rounds. Reported per implementation: median step time over
the timed steps (median over rounds), tokens/s, peak GPU memory allocated, and the last loss.

    python benchmarks/gpu_step.py                         # 1.1B (hidden 2048, 22 layers), seq 1024, batch 8
    python benchmarks/gpu_step.py --device cpu --tiny     # smoke test of the script itself, on the CPU
    python benchmarks/gpu_step.py --impls zeroshard_3 --base-src /tmp/old/src   # A/B of two trees

Writes benchmarks/out/gpu_step.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

IMPLS = ["torch_amp", "fsdp2", "zeroshard_0", "zeroshard_1", "zeroshard_3"]
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def build_model(args: argparse.Namespace, shape: dict | None = None):
    """An HF Llama of `shape` (default: --tiny's, else the 1.1B one), seeded alike for every run."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    shape = shape or (TINY if args.tiny else LLAMA_1B)
    config = LlamaConfig(**shape, max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config), shape["vocab_size"]


def make_step(name: str, model, device, args: argparse.Namespace):
    """(input_ids, mark) -> loss tensor, one optimizer step done; mark(phase) is called as forward,
    backward and the update end (--phases times them)."""
    import torch
    fused = device.type == "cuda"
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4, fused=fused)  # noqa: E731
    if name in ("torch_amp", "fsdp2"):
        model.to(device)
        if name == "fsdp2":  # bf16 compute from fp32 parameters, as AMP, but sharded per layer
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
        opt = adamw(model.parameters())

        def step(ids, mark):
            with torch.autocast(device.type, torch.bfloat16, enabled=name == "torch_amp"):
                loss = model(input_ids=ids, labels=ids).loss
            mark("forward")
            loss.backward()
            mark("backward")
            opt.step()
            opt.zero_grad(set_to_none=True)
            mark("update")
            return loss
        return step
    import zeroshard
    stage = int(name.split("@")[0].rsplit("_", 1)[1])
    engine = zeroshard.initialize(model, adamw, {"zero_optimization": {"stage": stage},
                                                 "bf16": {"enabled": True}})

    def step(ids, mark):
        loss = engine(input_ids=ids, labels=ids).loss
        mark("forward")
        engine.backward(loss)
        mark("backward")
        engine.step()
        mark("update")
        return loss
    return step


def start_process_group(args: argparse.Namespace):
    """The process group for `args.device` (NCCL on cuda, gloo on cpu); returns this rank's device."""
    import torch
    import zeroshard
    device = torch.device(args.device)
    zeroshard.ensure_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device


def worker(name: str, args: argparse.Namespace) -> dict:
    import torch
    device = start_process_group(args)
    model, vocab = build_model(args)
    step = make_step(name, model, device, args)
    g = torch.Generator().manual_seed(1)
    times, phases, loss = [], {"forward": [], "backward": [], "update": []}, float("nan")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
        sync()
        start = last = time.perf_counter()

        def mark(phase: str) -> None:
            # Only under --phases: a sync between phases takes away their overlap, so the step's
            # own time is then not the figure to report.
            nonlocal last
            if args.phases and i >= args.warmup:
                sync()
                phases[phase].append(time.perf_counter() - last)
                last = time.perf_counter()
        loss = step(ids, mark).item()  # .item() waits for the step's kernels
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    if args.profile:
        profile_steps(name, step, vocab, device, args, g)
    result = {"name": name, "step_s": statistics.median(times), "loss": loss, "peak_gib": peak / 2**30}
    if args.phases:
        result.update({f"{k}_s": statistics.median(v) for k, v in phases.items()})
    return result


def profile_steps(name: str, step, vocab: int, device, args: argparse.Namespace, g) -> None:
    """Three more steps under torch.profiler; writes where device and host time went to
    `args.profile`/`name`.txt (the kernels by self time, and the wall time against kernel time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(3):
            ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
            step(ids, lambda _: None).item()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events)
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, f"{name.replace('@', '-')}.txt"), "w") as f:
        f.write(f"{name}: 3 steps, wall {wall * 1e3:.1f} ms, kernel time {kernel_us / 1e3:.1f} ms\n")
        if device.type == "cuda":
            f.write(idle_gaps(prof))
        f.write(events.table(sort_by="self_device_time_total" if device.type == "cuda"
                             else "self_cpu_time_total", row_limit=40, max_name_column_width=70))


def idle_gaps(prof, top: int = 12) -> str:
    """Where the GPU waited: the time between kernels (and copies) in the profiled steps, in total
    and the longest gaps, each named by the kernels on either side."""
    from torch.autograd import DeviceType
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    gaps, busy_until, last = [], None, ""
    for start, end, kernel in spans:
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, last[:60], kernel[:60]))
        if busy_until is None or end > busy_until:
            busy_until, last = end, kernel
    gaps.sort(reverse=True)
    lines = [f"GPU events {sum(e - s for s, e, _ in spans) / 1e3:.1f} ms summed (concurrent ones overlap); "
             f"idle between the first and last {sum(g for g, _, _ in gaps) / 1e3:.1f} ms in {len(gaps)} "
             f"gaps; the longest:"]
    lines += [f"  {g / 1e3:8.3f} ms  after {before!r}  before {after!r}" for g, before, after in gaps[:top]]
    return "\n".join(lines) + "\n"


# ---- shared with offload.py: options, one fresh process per run, the report files ----------
def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a 2-layer, width-64 Llama (smoke test)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=7, help="timed steps (default 7: steps 4-10)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)


def parse_run_args(p: argparse.ArgumentParser, worker_fn) -> argparse.Namespace | None:
    """The options; in a --worker process, runs worker_fn(name, args), prints its RESULT, and
    returns None."""
    args = p.parse_args()
    if args.tiny:
        args.seq, args.batch = min(args.seq, 32), min(args.batch, 2)
    if args.worker:
        print("RESULT " + json.dumps(worker_fn(args.worker, args)), flush=True)
        return None
    return args


def run_worker(script: str, name: str, port: int, extra: list[str] = (),
               src: str | None = None) -> dict | None:
    """`script --worker name` with this run's options (and `extra`) in a fresh world of one process;
    with `src`, importing zeroshard from that source tree."""
    cmd = [sys.executable, script, "--worker", name, *sys.argv[1:], *extra]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    if src:
        env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(f"{name}: failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}", flush=True)
        return None
    return json.loads(line[7:])


def write(stem: str, lines: list[str], data: dict) -> None:
    """Print the table and keep it, with the raw data, under benchmarks/out/."""
    text = "\n".join(lines)
    print(text)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"{stem}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(OUT, f"{stem}.json"), "w") as f:
        json.dump(data, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(p)
    p.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS)
    p.add_argument("--phases", action="store_true",
                   help="also time forward, backward and the update apart (a sync between them)")
    p.add_argument("--profile", metavar="DIR",
                   help="after the timed steps, profile three more and write DIR/<run>.txt")
    p.add_argument("--base-src", metavar="DIR",
                   help="an A/B of two trees: each zeroshard run also runs (as NAME@base, in the same "
                        "rounds) importing zeroshard from DIR, another checkout's src/")
    args = parse_run_args(p, worker)
    if args is None:
        return
    names = [m for n in args.impls for m in ([n, f"{n}@base"] if args.base_src and "zeroshard" in n else [n])]
    results: dict[str, list[dict]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for i, name in enumerate(names):
            r = run_worker(__file__, name, 29600 + 20 * round_ + i,
                           src=args.base_src if name.endswith("@base") else None)
            if r is not None:
                results[name].append(r)
                print(f"round {round_ + 1}: {name} {r['step_s']:.3f} s", flush=True)
    tokens = args.batch * args.seq
    phase_keys = ["forward_s", "backward_s", "update_s"] if args.phases else []
    lines = [f"{'run':<18} {'step s':>8} {'tokens/s':>10} {'GPU peak GiB':>13} {'last loss':>10}"
             + "".join(f" {k:>11}" for k in phase_keys)]
    for name, runs in results.items():
        if runs:
            s = statistics.median(r["step_s"] for r in runs)
            lines.append(f"{name:<18} {s:>8.3f} {tokens / s:>10,.0f} {runs[-1]['peak_gib']:>13.2f} "
                         f"{runs[-1]['loss']:>10.4f}"
                         + "".join(f" {statistics.median(r[k] for r in runs):>11.4f}" for k in phase_keys))
    write("gpu_step", lines, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
