"""The paper's ZeRO-R configurations C1-C5 at small scale: 4 gloo ranks, dp 2 x tp 2, a GPT split by
its own tensor-parallel plan, one activation checkpoint per block.

    C1 P_os (stage 1)   C2 C1 + P_a   C3 P_os+g (stage 2)   C4 C3 + P_a   C5 C4 + P_a+cpu

For each: model-state bytes per rank (the engine's census) beside the paper's formula for this
rank's tp part (Ψ_tp = its shards plus the replicated parameters; fp32 Adam, N = dp = 2);
checkpointed-activation bytes on the device and on the host (the engine's counters) beside the
model (blocks x batch x seq x width x 4 bytes, / tp with P_a); every tensor autograd saves in one
forward, measured independently by a saved-tensors hook (the drop from C1 to C2 is the P_a saving);
the all-gathers before recomputes; median step time; and the largest depth whose device bytes
(model states + checkpoints left on the device) fit a per-rank budget: measured at two depths,
solved for the budget (the bytes are linear in depth), then trained at that depth and one more to
confirm the first fits and the second does not. On CPU "device" is zeroshard's accounting: what is
not in the host buffers of P_a+cpu.

    python benchmarks/zero_r.py
    python benchmarks/zero_r.py --quick    # smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import zeroshard
from zeroshard.app.gpt import GPT, GPTConfig, lm_loss
from zeroshard.paper.zero_r import CONFIGURATIONS, checkpoint_bytes
from ranks import free_port, write_json

MiB = 2**20
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def _saved_bytes(engine, x: torch.Tensor) -> int:
    """Bytes of every distinct tensor autograd saves in one forward (a DTensor by its local shard)."""
    seen: dict[tuple, int] = {}

    def pack(saved: torch.Tensor) -> torch.Tensor:
        t = getattr(saved, "_local_tensor", saved)
        seen[(t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())] = t.numel() * t.element_size()
        return saved
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(x).float().sum()
    engine.backward(loss * 0)
    engine.step()
    return sum(seen.values())


def _trial(rank: int, port: int, layers: int, width: int, batch: int, seq: int, steps: int,
           names: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = {}
    for c in (c for c in CONFIGURATIONS if c.name in names):
        torch.manual_seed(0)
        model = zeroshard.tensor_parallel(GPT(GPTConfig(seq_len=seq, layers=layers, width=width, heads=4)),
                                          mesh["tp"])
        config = {"zero_optimization": {"stage": c.stage},
                  "activation_checkpointing": {"partition_activations": c.partition,
                                               "cpu_checkpointing": c.cpu,
                                               "contiguous_memory_optimization": True,
                                               "number_checkpoints": layers}}
        engine = zeroshard.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-3), config, mesh=mesh)
        g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
        times = []
        for _ in range(steps):
            data = torch.randint(0, 256, (batch, seq + 1), generator=g)
            start = time.perf_counter()
            loss = lm_loss(engine(data[:, :-1]), data[:, 1:])
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
        stats = engine.memory_stats()
        saved = _saved_bytes(engine, torch.randint(0, 256, (batch, seq), generator=g))
        results[c.name] = {"psi_tp": engine.num_parameters(), "model_states": stats["model_states_in_step"],
                           "ckpt_device": stats["checkpointed_activations"],
                           "ckpt_host": stats["checkpointed_activations_host"], "saved": saved,
                           "gathers": engine.comm_stats()["activation_all_gather"]["calls"],
                           "step_s": statistics.median(times[1:] or times)}
        del engine, model
    peaks = zeroshard.gather_objects(results)  # every rank's figures: report the largest
    worst = {n: {k: max(p[n][k] for p in peaks) for k in peaks[0][n]} for n in peaks[0]}
    write_json(out, worst, rank)


def run(layers: int, width: int, batch: int, seq: int, steps: int, names: list[str]) -> dict:
    out = os.path.join(OUT, f"zero_r_trial_{os.getpid()}.json")
    mp.start_processes(_trial, args=(free_port(), layers, width, batch, seq, steps, names, out), nprocs=4,
                       join=True, start_method="spawn")
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


def device_bytes(r: dict) -> int:
    return r["model_states"] + r["ckpt_device"]


def largest(name: str, low: dict, high: dict, lo: int, hi: int, budget: int, args) -> tuple[int, dict, dict]:
    """Solve device bytes = budget for the depth (linear between the two measured depths), then
    confirm by training that depth and one more."""
    per_layer = (device_bytes(high[name]) - device_bytes(low[name])) / (hi - lo)
    depth = max(1, int(lo + (budget - device_bytes(low[name])) // per_layer))
    fits = run(depth, args.width, args.batch, args.seq, 2, [name])[name]
    over = run(depth + 1, args.width, args.batch, args.seq, 2, [name])[name]
    return depth, fits, over


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="sequences per dp rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4, help="depth of the side-by-side run")
    p.add_argument("--budget-mib", type=float, default=24.0, help="per-rank device bytes for the search")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no-search", action="store_true", help="the side-by-side table only")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.width, args.batch, args.seq, args.layers, args.steps, args.budget_mib = 64, 4, 32, 2, 3, 2.0
    os.makedirs(OUT, exist_ok=True)
    names = [c.name for c in CONFIGURATIONS]
    side = run(args.layers, args.width, args.batch, args.seq, args.steps, names)
    print(f"dp 2 x tp 2 (4 gloo ranks), GPT width {args.width}, {args.layers} blocks, "
          f"{args.batch} x {args.seq} tokens per dp rank, fp32 AdamW; MiB per rank (largest over ranks)")
    print(f"{'':3} {'states':>8} {'paper':>8} {'ckpt dev':>9} {'ckpt host':>9} {'model':>8} {'saved':>8} "
          f"{'gathers':>7} {'step s':>7}")
    for c in CONFIGURATIONS:
        r = side[c.name]
        paper = zeroshard.paper_model_state_bytes(r["psi_tp"], 2, c.stage, 4, 4, 8)
        model = sum(checkpoint_bytes(args.layers, args.width, args.batch, args.seq, "fp32", 2, c.partition,
                                     c.cpu))
        print(f"{c.name:3} {r['model_states'] / MiB:>8.2f} {paper / MiB:>8.2f} "
              f"{r['ckpt_device'] / MiB:>9.2f} {r['ckpt_host'] / MiB:>9.2f} {model / MiB:>8.2f} "
              f"{r['saved'] / MiB:>8.2f} {r['gathers']:>7} "
              f"{r['step_s']:>7.3f}")
    if args.no_search:
        return
    lo, hi = (1, 2) if args.quick else (2, 4)
    low = run(lo, args.width, args.batch, args.seq, 2, names)
    high = run(hi, args.width, args.batch, args.seq, 2, names)
    budget = int(args.budget_mib * MiB)
    print(f"\nlargest depth within {args.budget_mib:.0f} MiB of device bytes per rank (model states + "
          f"checkpoints on the device), width {args.width}:")
    found = {}
    for c in CONFIGURATIONS:
        depth, fits, over = largest(c.name, low, high, lo, hi, budget, args)
        found[c.name] = {"layers": depth, "psi_tp": fits["psi_tp"], "fits": device_bytes(fits),
                         "over": device_bytes(over)}
        ok = device_bytes(fits) <= budget < device_bytes(over)
        print(f"{c.name:3} {depth:>4} blocks: {device_bytes(fits) / MiB:>7.2f} MiB "
              f"(one more: {device_bytes(over) / MiB:.2f}){'' if ok else '  (not bracketed!)'}  "
              f"Ψ per tp rank {fits['psi_tp']:,}")
    base = found["C1"]["layers"]
    print("depth relative to C1: " + ", ".join(f"{n} {found[n]['layers'] / base:.2f}x" for n in found))
    with open(os.path.join(OUT, "zero_r.json"), "w") as f:
        json.dump({"args": vars(args), "side_by_side": side, "largest": found}, f, indent=1)


if __name__ == "__main__":
    main()
