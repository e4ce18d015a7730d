"""What stage 3's per-unit machinery costs as a model gets deeper, with the network taken away.

One process (world size 1, gloo, one thread): the built-in GPT at a fixed width and several depths,
stage 0 beside stage 3 at zeroshard's defaults, SGD, a batch of one 16-token sequence so compute is
small. Prints the median forward and backward time of each and stage 3's excess per unit (one unit
per block). A flat figure across depths means the bookkeeping costs O(1) a unit; a growing one, that
something walks every unit at every unit (it did: 575 and 563 us a unit at 96 blocks, in two
runs, before the forward record was read once a forward). About 30 seconds.

    python benchmarks/unit_overhead.py                    # width 32: 8, 32, 96 blocks
    python benchmarks/unit_overhead.py --width 128 --layers 12 48
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.app.gpt import GPT, GPTConfig, lm_loss


def phase_times(layers: int, width: int, stage: int, steps: int) -> tuple[float, float]:
    """Median forward and backward ms over the steps after 5 warm-up ones."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=layers, width=width, heads=2))
    engine = zeroshard.initialize(model, lambda p: torch.optim.SGD(p, lr=0.01),
                                  {"zero_optimization": {"stage": stage}})
    x = torch.randint(0, 256, (1, 16))
    times = []
    for i in range(5 + steps):
        start = time.perf_counter()
        loss = lm_loss(engine(x), x)
        forward = time.perf_counter()
        engine.backward(loss)
        backward = time.perf_counter()
        engine.step()
        if i >= 5:
            times.append((1000 * (forward - start), 1000 * (backward - forward)))
    return tuple(statistics.median(column) for column in zip(*times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--layers", type=int, nargs="+", default=[8, 32, 96])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    print(f"width {args.width}, world size 1; ms (median of {args.steps} steps)")
    heads = ("blocks", "fwd s0", "fwd s3", "us/unit", "bwd s0", "bwd s3", "us/unit")
    print(" ".join(f"{h:>8}" for h in heads))
    for layers in args.layers:
        (f0, b0), (f3, b3) = (phase_times(layers, args.width, stage, args.steps) for stage in (0, 3))
        print(f"{layers:>8} {f0:>8.2f} {f3:>8.2f} {1000 * (f3 - f0) / layers:>8.0f} "
              f"{b0:>8.2f} {b3:>8.2f} {1000 * (b3 - b0) / layers:>8.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
