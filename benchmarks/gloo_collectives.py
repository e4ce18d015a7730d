"""gloo's collectives side by side: why zeroshard reduce-scatters on CPU with an all-to-all.

For a buffer of B bytes on N ranks (1 thread each), the median time of: all_reduce; all_gather_into_tensor;
reduce_scatter_tensor; and all_to_all_single followed by the local sum of the N received slices (what
comm/gloo.py issues as a reduce-scatter on a CPU group). The two reduce-scatters must agree with each other
exactly at N = 2 (one addition per element) and closely beyond; the script checks it.

    python benchmarks/gloo_collectives.py                 # 2 and 3 ranks, 3.3 MB and 0.66 MB
    python benchmarks/gloo_collectives.py --nproc 4 --numel 4000000
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ranks import free_port, write_json


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _median_ms(call, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _rank(rank: int, nproc: int, port: int, sizes: list[int], rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    rows = []
    for numel in sizes:
        full = torch.randn(numel - numel % nproc, generator=torch.Generator().manual_seed(rank))
        shard, summed = torch.empty(full.numel() // nproc), torch.empty(full.numel() // nproc)
        received = torch.empty_like(full)

        def all_to_all_and_sum() -> None:
            dist.all_to_all_single(received, full)
            torch.sum(received.view(nproc, -1), dim=0, out=summed)
        _reduce_scatter(shard, full)  # first: the two reduce-scatters' results, compared
        all_to_all_and_sum()
        diff = (shard - summed).abs().max().item()
        scratch = full.clone()  # all-reduced in place, round after round (doubling at most 2^rounds)
        row = {"MB": full.numel() * 4 / 1e6, "max abs diff": diff,
               "all_reduce": _median_ms(lambda: dist.all_reduce(scratch), rounds),
               "all_gather": _median_ms(lambda: _all_gather(full, shard), rounds),
               "reduce_scatter": _median_ms(lambda: _reduce_scatter(shard, full), rounds),
               "all_to_all+sum": _median_ms(all_to_all_and_sum, rounds)}
        rows.append(row)
    write_json(os.path.join(out, "result.json"), {"rows": rows}, rank)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 3])
    p.add_argument("--numel", type=int, nargs="+", default=[830_000, 166_000], help="fp32 elements")
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    print("| ranks | MB | all_reduce ms | all_gather ms | reduce_scatter ms | all_to_all+sum ms | "
          "max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for nproc in args.nproc:
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(_rank, args=(nproc, free_port(), args.numel, args.rounds, out), nprocs=nproc,
                               start_method="spawn")
            with open(os.path.join(out, "result.json")) as f:
                for r in json.load(f)["rows"]:
                    times = " | ".join(f"{r[k]:.2f}" for k in ("all_reduce", "all_gather", "reduce_scatter",
                                                                "all_to_all+sum"))
                    print(f"| {nproc} | {r['MB']:.2f} | {times} | {r['max abs diff']:.1e} |")


if __name__ == "__main__":
    main()
