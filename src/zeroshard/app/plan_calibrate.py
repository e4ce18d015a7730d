"""`zeroshard plan`'s calibration: this machine's rates, measured in a few seconds.

- **A transformer block** (the built-in GPT's), forward and backward in the run's precision with
  the threads one rank gets, at six (width, tokens) shapes, fitted by least squares (the relative
  error of the block's time) to t = fixed + flops / matmul + activation elements / elementwise +
  parameters / weights: the dispatch cost of a layer, the matrix rate (one large product, measured
  alone: at a CPU's small shapes the elementwise work dominates and a fitted matrix rate is
  noise), the rate of the elementwise work (norms, activation functions, softmax, casts) and of
  the per-parameter work (reading weights, accumulating their gradients). One rate from one large
  matmul misjudges small shapes several-fold; in two bf16 calibrations on a 2-core CPU the fit's
  worst shape was 5% and 17% off. The same block checkpointed (reentrant, as the engine's ZeRO-R
  checkpoint is) gives the share its recompute adds: the median over the shapes.
  It is not the forward's third of the flops everywhere: on a CPU in bf16 the backward's kernels
  are the slower ones, and a recompute adds less (docs/plan.md).
- **The optimizer's step** as the engine runs it on the device (torch's AdamW: its default on a
  CPU, fused on a GPU) and on the host for offload (fused), in elements per second.
- **Collectives** on a CPU group: `ranks` gloo processes time an all-reduce, a reduce-scatter and
  an all-gather of 8 MiB (full-size bytes per second) and of 2 KiB (the latency per collective).
  On a CPU group the block's and the optimizer's rates are timed in those processes too, all at
  once: a rank shares the machine's memory bandwidth and caches with its peers, and one process
  timed alone measured faster than a rank runs.
- A host memory copy, host <-> device copies on a GPU, and a disk write and read under the offload
  path.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

GPU_SHAPES = [(1024, 2048), (1024, 8192), (2048, 2048), (2048, 8192), (4096, 1024), (4096, 4096)]
CPU_SHAPES = [(64, 64), (64, 1024), (256, 256), (512, 64), (512, 1024), (1024, 256)]
SEQ = {"cuda": 512, "cpu": 64}


def timed(fn, repeat: int) -> float:
    """The median of `repeat` calls after a warm-up: the planner predicts a typical step, and
    --verify measures the median one; on a shared machine the fastest call is rarer than either."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def block_terms(width: int, tokens: int, seq: int) -> list[float]:
    """The fit's regressors for one block's forward and backward: 1, flops, activation elements
    (9d + 2f per token, f = 4d), parameters (12 d^2)."""
    flops = 6 * tokens * 12 * width * width + 6 * 2 * tokens * seq * width / 2
    return [1.0, flops, tokens * (9 * width + 8 * width), 12.0 * width * width]


def fit(rows: list[list[float]], seconds: list[float], known: list[float] | None = None) -> list[float]:
    """Coefficients c, every one >= 0 (a negative one is dropped and the rest fitted again), for
    seconds ~ known + c . row, least squares in the relative error of the whole time. `known`: the
    part already accounted for (the block's matmuls at the measured rate). The error is relative
    to the whole, not to what `known` leaves: where the matmuls take nine tenths of a block, what
    is left is the difference of two timings and swings with a few percent of noise in either
    (even below 0), and fitted in its own relative error it would outweigh every other shape."""
    known = known or [0.0] * len(rows)
    return least_squares([[x / s for x in r] for r, s in zip(rows, seconds)],
                         [1 - k / s for k, s in zip(known, seconds)])


def least_squares(rows: list[list[float]], ys) -> list[float]:
    """Least-squares coefficients of `rows` for `ys`, none below 0: a negative one is noise here,
    dropped (0) and the rest fitted again; where every one comes out negative (the references ran
    faster than predicted: a busier machine at calibration), none is kept."""
    import torch

    keep = list(range(len(rows[0])))
    while keep:
        a = torch.tensor([[r[k] for k in keep] for r in rows], dtype=torch.float64)
        b = torch.tensor(ys, dtype=torch.float64).reshape(-1, 1)
        solved = torch.linalg.lstsq(a, b, driver="gelsd").solution.flatten().tolist()
        if min(solved) >= 0 or len(keep) == 1:
            out = [0.0] * len(rows[0])
            for k, c in zip(keep, solved):
                out[k] = max(c, 0.0)
            return out
        keep = [k for k, c in zip(keep, solved) if c >= 0]
    return [0.0] * len(rows[0])


def matmul_rate(dtype, device: str, sync) -> float:
    """Flops/s of one large matrix product (an MLP's first layer: tokens x d by d x 4d)."""
    import torch

    tokens, d = (8192, 4096) if device == "cuda" else (1024, 1024)
    a = torch.randn(tokens, d, device=device, dtype=dtype)
    b = torch.randn(d, 4 * d, device=device, dtype=dtype)
    return 2 * tokens * d * 4 * d / timed(lambda: (a @ b, sync()), 5)


def block_rates(dtype, device: str, sync) -> dict:
    """matmul (flop/s, one large product), then fitted over a block's forward and backward at six
    shapes: layer_fixed (s), elementwise (elements/s), weights (parameters/s); and recompute, the
    share a checkpointed block's recompute adds to its forward and backward. `blocks` keeps each
    shape's (width, tokens, measured s, fitted s) and `fit_worst` the largest relative miss, so a
    prediction gone wrong on another machine can be refitted from the cache alone."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from .gpt import Block, GPTConfig

    matmul = matmul_rate(dtype, device, sync)
    measured, shares, seq = [], [], SEQ[device]
    for width, tokens in GPU_SHAPES if device == "cuda" else CPU_SHAPES:
        block = Block(GPTConfig(layers=1, width=width, heads=max(1, width // 64), seq_len=seq))
        block = block.to(device=device, dtype=dtype)
        x = torch.randn(max(1, tokens // seq), seq, width, device=device, dtype=dtype, requires_grad=True)
        plain = timed(lambda: (block(x).float().sum().backward(), sync()), 5)
        rerun = timed(lambda: (checkpoint(block, x, use_reentrant=True).float().sum().backward(), sync()), 5)
        measured.append((width, tokens, plain))
        shares.append(rerun / plain - 1)
    rows, seconds, matmuls = block_rows(measured, matmul, seq)
    c = fit(rows, seconds, matmuls)
    fitted = [m + sum(k * x for k, x in zip(c, r)) for m, r in zip(matmuls, rows)]
    return {"matmul": matmul, **rates_of_fit(c), "recompute": max(statistics.median(shares), 0.0),
            "blocks": [[w, t, s, f] for (w, t, s), f in zip(measured, fitted)],
            "fit_worst": max(abs(f / s - 1) for s, f in zip(seconds, fitted))}


def block_rows(measured: list, matmul: float, seq: int) -> tuple[list, list, list]:
    """The fit's inputs from (width, tokens, seconds) timings: each shape's regressors beside the
    matmuls (1, activation elements, parameters), its time, and its matmuls' time at `matmul`."""
    rows, seconds, matmuls = [], [], []
    for width, tokens, plain in measured:
        once, flops, elements, params = block_terms(width, tokens, seq)
        rows.append([once, elements, params])
        seconds.append(plain)
        matmuls.append(flops / matmul)
    return rows, seconds, matmuls


def rates_of_fit(c: list[float]) -> dict:
    """The fitted coefficients as rates: a term dropped (0) is a rate of 0, not counted."""
    inverse = [1 / v if v > 0 else 0.0 for v in c[1:]]
    return {"layer_fixed": c[0], "elementwise": inverse[0], "weights": inverse[1]}


def adam_rate(device: str, fused: bool | None) -> float:
    """Elements per second of torch's AdamW over one 4 Mi-element fp32 tensor."""
    import torch

    p = torch.nn.Parameter(torch.zeros(4 << 20, device=device))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=fused)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return p.numel() / timed(lambda: (opt.step(), sync()), 3)


def _rank_rates(args, dtype) -> dict:
    """One rank of a CPU group's timing, every rank at once: a block's and Adam's rates while the
    peers run the same (they share the machine's memory bandwidth and caches in a run, too: one
    process timed alone is faster than a rank is), then the collectives, through zeroshard's Comm
    (the path the engine takes: on gloo a reduce-scatter is an all-to-all and a local sum)."""
    import zeroshard

    from .train import start_rank

    start_rank(args)  # the threads a rank gets, and its gloo group
    comm = zeroshard.Comm()
    comm.barrier()
    figures = block_rates(dtype, "cpu", lambda: None)
    comm.barrier()
    figures["device_adam"], figures["host_adam"] = adam_rate("cpu", None), adam_rate("cpu", True)
    comm.barrier()
    return {**figures, **_collectives(comm, args.nproc, dtype)}


def _collectives(comm, ranks: int, dtype) -> dict:
    """all_reduce, reduce_scatter, all_gather of 8 MiB (full-size bytes/s) and the latency of 2 KiB."""
    import torch

    figures: dict = {}
    for label, nbytes in (("", 8 << 20), ("latency", 2 << 10)):
        numel = nbytes // torch.tensor([], dtype=dtype).element_size() // ranks * ranks
        full, part = torch.ones(numel, dtype=dtype), torch.ones(numel // ranks, dtype=dtype)
        ops = {
            "all_reduce": lambda: comm.all_reduce(full),
            "reduce_scatter": lambda: comm.reduce_scatter(part, full),
            "all_gather": lambda: comm.all_gather(full, part),
        }
        for name, op in ops.items():
            comm.barrier()
            seconds = timed(op, 5)
            if label:
                figures[label] = min(figures.get(label, seconds), seconds)
            else:
                figures[name] = numel * full.element_size() / seconds
    return figures


def rank_rates(ranks: int, dtype) -> dict:
    """A block's and Adam's rates, all_reduce, reduce_scatter, all_gather (full-size bytes/s) and
    latency (s) among `ranks` gloo processes on this machine (launched as `zeroshard train`
    launches its ranks; rank 0's figures)."""
    from .train import TrainArgs, launch

    return launch(TrainArgs(device="cpu", nproc=ranks), _rank_rates, dtype)


def disk_rate(folder: str) -> tuple[float, float]:
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
        with open(path, "rb") as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while f.read(8 << 20):
                pass
        read = size / (time.perf_counter() - start)
    finally:
        os.unlink(path)
    return write, read


def measure(precision: str, ranks: int, disk_dir: str, cuda: bool) -> dict:
    """Every figure above, for one rank of `ranks` on this machine (progress on a tqdm bar)."""
    import torch
    from tqdm import tqdm

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))  # what one rank gets (train.start_rank)
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict = {}
    group = not cuda and ranks > 1  # a CPU group's ranks share the machine: timed together, below
    try:
        with tqdm(total=5, desc="calibrate", leave=False) as bar:
            if not group:
                out.update(block_rates(dtype, device, sync))
                out["device_adam"] = adam_rate(device, True if cuda else None)
                out["host_adam"] = adam_rate("cpu", True)
            bar.update()
            big = torch.empty(16 << 20, dtype=torch.float32)
            target = torch.empty_like(big)
            out["memory"] = 2 * big.numel() * 4 / timed(lambda: target.copy_(big), 3)  # read + write
            out["host_link"] = 0.0
            if cuda:
                dev = torch.empty(32 << 20, dtype=torch.float32, device="cuda")
                pinned = torch.empty(32 << 20, dtype=torch.float32, pin_memory=True)
                out["memory"] = 2 * dev.numel() * 4 / timed(lambda: (dev.clone(), sync()), 3)
                out["host_link"] = dev.numel() * 4 / timed(lambda: (pinned.copy_(dev), sync()), 3)
            bar.update()
            if group:
                out.update(rank_rates(ranks, dtype))
            bar.update()
            out["disk_write"], out["disk_read"] = disk_rate(disk_dir)
            bar.update(2)
    finally:
        torch.set_num_threads(threads)
    return out
