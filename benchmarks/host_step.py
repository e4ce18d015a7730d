"""The host's part of an offloaded step, timed beside torch's fused AdamW alone.

    python benchmarks/host_step.py                        # 2^25 elements, 7 rounds, every core
    python benchmarks/host_step.py --numel 1e8 --rounds 9 --threads 16

What is timed is everything the host does for one offloaded buffer between its reduced gradient
arriving in host memory and its updated compute-dtype values being ready to go up, with clipping
on (a factor other than 1), for an fp32 model (fp32 gradient; the fp32 master itself goes up, as
offload/host.py sends it) and a bf16 one (bf16 gradient, bf16 values written for the way up):
- `zeroshard`: the step as the engine runs it (offload/host_step.update: one loop reads the 16-bit
  or fp32 gradient, scales it, updates the master and moments as torch's fused kernel does and
  writes the new values into the staging buffer; offload/host_adam.c);
- `separate passes`: how it was done before, for reference: the gradient upcast to an fp32 copy,
  multiplied by the factor, optimizer.step(), the master cast into the staging buffer;
- `fused AdamW`: torch.optim.AdamW(fused=True).step() over the same number of fp32 elements with an
  fp32 gradient, and nothing else: the floor.
The three take turns in each round (rotated); each time is the median over rounds. The last line:
`host step / fused AdamW: X.XX (fp32) Y.YY (bf16)`, zeroshard's median over the floor's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from zeroshard.offload import host_step  # noqa: E402

FACTOR = 0.37  # a clip factor: the gradient is scaled on its way into the update


def _setup(numel: int, grad_dtype: torch.dtype, generator: torch.Generator):
    """An fp32 parameter with AdamW's state made (one step), its gradient in `grad_dtype`, and the
    staging buffer its values go up in (the gradient's dtype: the model's compute dtype)."""
    param = torch.nn.Parameter(torch.randn(numel, generator=generator))
    optimizer = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.1, fused=True)
    param.grad = torch.zeros(numel)
    optimizer.step()
    param.grad = None
    grad = torch.randn(numel, generator=generator).to(grad_dtype)
    return param, optimizer, grad, torch.empty(numel, dtype=grad_dtype)


def zeroshard_step(param, optimizer, grad, staging, scratch) -> None:
    out = staging if staging.dtype != torch.float32 else None  # fp32: the master is what goes up
    host_step.update(optimizer, param, grad, FACTOR, out, scratch)


def separate_passes(param, optimizer, grad, staging, scratch) -> None:
    fp32 = grad.to(torch.float32, copy=True)
    param.grad = fp32.mul_(FACTOR)
    optimizer.step()
    param.grad = None
    if staging.dtype != torch.float32:
        staging.copy_(param.detach())


def fused_alone(param, optimizer, grad, staging, scratch) -> None:
    param.grad = grad  # fp32
    optimizer.step()
    param.grad = None


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def measure(numel: int, rounds: int, grad_dtype: torch.dtype) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    runs = {"zeroshard": (zeroshard_step, _setup(numel, grad_dtype, generator)),
            "separate passes": (separate_passes, _setup(numel, grad_dtype, generator)),
            "fused AdamW": (fused_alone, _setup(numel, torch.float32, generator))}
    scratch = host_step.scratch_for()
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds + 1):  # the first round warms up, and is not counted
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, state = runs[name]
            t = _timed(fn, *state, scratch)
            if r:
                times[name].append(t)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=2 ** 25, help="elements of the buffer (default 2^25)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's, every core)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    numel = int(args.numel)
    print(f"{numel:,} elements, {args.rounds} rounds, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    ratios = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        medians = measure(numel, args.rounds, dtype)
        floor = medians["fused AdamW"]
        for name, t in medians.items():
            print(f"  {label}  {name:16s} {1000 * t:9.1f} ms  {t / floor:5.2f}x  "
                  f"{numel / t / 1e9:6.2f} G elements/s")
        ratios[label] = medians["zeroshard"] / floor
    print(f"host step / fused AdamW: {ratios['fp32']:.2f} (fp32) {ratios['bf16']:.2f} (bf16)")


if __name__ == "__main__":
    main()
