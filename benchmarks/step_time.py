"""Step time of zeroshard against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed on CPU with gloo.

Every implementation trains the same GPT (same weights and batches, fp32 AdamW) in one world of --nproc
ranks x 1 thread, in interleaved rounds (A B C .., B C .. A, ..); a step is timed from a barrier to the end
of the optimizer step on the slowest rank. Reported: median step time and ratio to DDP, losses (must agree
to ~1e-4), peak RSS per rank (each implementation alone in a fresh world), zeroshard's model states and
traffic per step beside the paper's formulas. Writes benchmarks/out/step_time.{md,json,png}.

    python benchmarks/step_time.py --nproc 4              # full run (6 layers x 256, seq 128, batch 4)
    python benchmarks/step_time.py --quick                # smoke test, < 1 minute (add --rss: ~2 minutes)
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import sysconfig
import tempfile
import time
import warnings
from collections import Counter
from contextlib import nullcontext
from typing import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zeroshard.app.gpt import GPT, GPTConfig, lm_loss
from step_report import report
from wiretap import wiretap
from ranks import free_port, write_json

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, y) -> detached loss
ALL = (["ddp", "zero_optim", "fsdp2_reshard", "fsdp2_keep"]
       + [f"{lib}_{stage}" for lib in ("zeroshard", "deepspeed") for stage in range(4)]
       + [f"zeroshard-overlap_{stage}" for stage in (0, 1, 2)]  # overlap_comm forced on (default at 3)
       + ["zeroshard-sync_3"])  # overlap_comm forced off
COMPILED = "+compiled"  # any name with this suffix: the same, with each block torch.compile'd first
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


# ---- data and model: identical on every rank and for every implementation ------------------------
def corpus(max_bytes: int = 1_000_000) -> torch.Tensor:
    """Bytes of the Python standard library's own source (real text, nothing downloaded)."""
    root, data = sysconfig.get_paths()["stdlib"], bytearray()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and len(data) < max_bytes:
            with open(os.path.join(root, name), "rb") as f:
                data += f.read()
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


def batch(tokens: torch.Tensor, step: int, rank: int,
          args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    starts = torch.randint(len(tokens) - args.seq - 1, (args.batch,), generator=g)
    window = torch.stack([tokens[s:s + args.seq + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


def new_model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)
    return GPT(GPTConfig(seq_len=args.seq, layers=args.layers, width=args.width,
                         heads=max(1, args.width // 32)))


def adamw(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=args.lr, foreach=False)


# ---- one builder per implementation: model -> step function --------------------------------------
def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def build_ddp(model: GPT, args: argparse.Namespace, zero_optim: bool) -> Step:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model)
    opt = (ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr,
                                   foreach=False)
           if zero_optim else adamw(ddp.parameters(), args))
    return plain_step(ddp, opt)


def build_fsdp2(model: GPT, args: argparse.Namespace, reshard: bool) -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return plain_step(model, adamw(model.parameters(), args))


def engine_step(engine, after_backward: Callable[[], None] = lambda: None) -> Step:  # zeroshard, DeepSpeed
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        after_backward()
        engine.step()
        return loss.detach()
    return step


def build_zeroshard(model: GPT, args: argparse.Namespace, stage: int, stats: dict,
                    overlap: bool | None) -> Step:
    import zeroshard
    zero = {"stage": stage} if overlap is None else {"stage": stage, "overlap_comm": overlap}  # None: default
    config = {"zero_optimization": zero}
    if overlap and stage in (1, 2):  # the -overlap rows also hide the post-step all-gather
        config["zeroshard"] = {"defer_param_gather": True}
    engine = zeroshard.initialize(model, optimizer=lambda p: adamw(p, args), config=config)
    stats.update(calls=0, summary=lambda: {
        "psi": engine.num_parameters(), "model_states": stats["model_states"],
        "traffic": {k: v["bytes"] for k, v in engine.comm_stats()["last_step"].items()}})

    def record() -> None:  # on the second (warm-up) step: gradients held, optimizer state created
        stats["calls"] += 1
        if stats["calls"] == 2:
            stats["model_states"] = engine.memory_stats()["model_states"]
    return engine_step(engine, record)


def build_deepspeed(model: GPT, args: argparse.Namespace, stage: int) -> Step:
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              # memory_efficient_linear would replace torch.nn.functional.linear for the whole process
              "zero_optimization": {"stage": stage, "memory_efficient_linear": False},
              "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9, "gradient_clipping": 0.0}  # DeepSpeed's default clips at 1.0
    engine, *_ = deepspeed.initialize(model=model, optimizer=lambda p: adamw(p, args),
                                      model_parameters=model.parameters(), config=config)
    torch.set_num_threads(1)
    return engine_step(engine)


def build(name: str, args: argparse.Namespace, stats: dict) -> Step:
    model = new_model(args)
    if name.endswith(COMPILED):  # FSDP2's pattern: one graph per block, the wrappers' hooks between
        name = name.removesuffix(COMPILED)
        for block in model.blocks:
            block.compile()
    stage = name.rpartition("_")[2]
    if name in ("ddp", "zero_optim"):
        return build_ddp(model, args, zero_optim=name == "zero_optim")
    if name.startswith("fsdp2"):
        return build_fsdp2(model, args, reshard=name.endswith("reshard"))
    if name.startswith("zeroshard"):
        overlap = True if "-overlap" in name else False if "-sync" in name else None
        return build_zeroshard(model, args, int(stage), stats, overlap)
    return build_deepspeed(model, args, int(stage))


# ---- the ranks ------------------------------------------------------------------------------------
def setup(rank: int, world: int, port: int) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renamed collectives
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def time_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """All implementations in one world, interleaved; rank 0 writes times, losses, zeroshard stats."""
    setup(rank, world, port)
    tokens, names = corpus(), args.impls
    stats = {n: {} for n in names}
    linear = torch.nn.functional.linear
    steps = {n: build(n, args, stats[n]) for n in names}
    assert torch.nn.functional.linear is linear, "an implementation patched F.linear for everyone"
    rounds = args.warmup + args.steps
    times, losses = torch.zeros(len(names), rounds), torch.zeros(len(names), rounds)
    traffic: dict[str, dict[str, int]] = {}
    for r in range(rounds):
        x, y = batch(tokens, r, rank, args)
        for k in range(len(names)):
            i = (k + r) % len(names)  # rotate the order so no implementation always goes first
            dist.barrier()
            with wiretap() if r == args.warmup - 1 else nullcontext(Counter()) as sent:
                t0 = time.perf_counter()
                losses[i, r] = steps[names[i]](x, y)
                times[i, r] = time.perf_counter() - t0
            traffic[names[i]] = traffic.get(names[i]) or dict(sent)  # a warm step, seen at the API
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(losses)
    write_json(out, {"times": times.tolist(), "losses": (losses / world).tolist(), "wire": traffic,
                     "zeroshard": {n: s["summary"]() for n, s in stats.items() if "summary" in s}}, rank)


def rss_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One implementation alone in a fresh world: RSS before building it and peak after a few steps."""
    setup(rank, world, port)
    tokens, name = corpus(), args.impls[0]
    base = psutil.Process().memory_info().rss / 2**20
    step = build(name, args, {})
    for r in range(args.warmup):
        step(*batch(tokens, r, rank, args))
    row = torch.tensor([base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])  # KiB on Linux
    dist.all_reduce(row, op=dist.ReduceOp.MAX)  # the largest rank's
    write_json(out, {"base": row[0].item(), "peak": row[1].item()}, rank)


def launch(worker: Callable, args: argparse.Namespace) -> dict:
    port = free_port()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    mp.spawn(worker, args=(args.nproc, port, args, out), nprocs=args.nproc, join=True)
    result = json.load(open(out))
    os.unlink(out)
    return result


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, choices=[2, 4])
    for flag, default in dict(layers=6, width=256, seq=128, batch=4, warmup=3, steps=20, seed=0).items():
        p.add_argument(f"--{flag}", type=int, default=default, help=f"default {default}")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--impls", default=",".join(ALL), help="comma-separated subset of: " + ",".join(ALL)
                   + f" (a name ending in {COMPILED}: each block torch.compile'd)")
    p.add_argument("--rss", action=argparse.BooleanOptionalAction, default=None,
                   help="measure peak RSS, each implementation in a fresh world "
                        "(default: on, off with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2 layers x 64, seq 32, 2+3 steps, no RSS")
    args = p.parse_args()
    if args.quick:
        args.layers, args.width, args.seq, args.warmup, args.steps = 2, 64, 32, 2, 3
    args.rss = not args.quick if args.rss is None else args.rss
    args.warmup = max(2, args.warmup)  # zeroshard's model states are read on the second step
    args.impls = [m for m in args.impls.split(",") if m]
    if bad := [m for m in args.impls if m.removesuffix(COMPILED) not in ALL]:
        p.error(f"unknown implementations {bad}; choose from {ALL}, each optionally with '{COMPILED}'")
    return args


def main() -> None:
    args = parse()
    if any(m.startswith("deepspeed") for m in args.impls):
        try:
            import deepspeed  # noqa: F401
        except Exception as e:  # not installed, or it fails to import here
            print(f"note: DeepSpeed is not importable ({type(e).__name__}: {e}); skipping it",
                  file=sys.stderr)
            args.impls = [m for m in args.impls if not m.startswith("deepspeed")]
    os.makedirs(OUT, exist_ok=True)
    alone = {m: argparse.Namespace(**{**vars(args), "impls": [m]}) for m in args.impls}
    rss = {m: launch(rss_worker, alone[m]) for m in args.impls if args.rss}  # each alone in a fresh world
    timing = launch(time_worker, args)
    text = report(args, timing, rss)
    print(text)
    open(os.path.join(OUT, "step_time.md"), "w").write(text + "\n")
    json.dump({"args": vars(args), "timing": timing, "rss": rss},
              open(os.path.join(OUT, "step_time.json"), "w"))


if __name__ == "__main__":
    main()
