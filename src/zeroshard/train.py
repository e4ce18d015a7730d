"""`zeroshard train`: a small GPT trained with ZeRO on local ranks, with the paper's figures on screen.

The launcher starts one process per rank through torch's elastic launcher (what torchrun uses); each
rank runs `worker`, which reads top to bottom like any training loop.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import zeroshard

from .data import Batches, load_corpus
from .gpt import GPT, SIZES, GPTConfig, lm_loss
from .memory import paper_model_state_bytes


@dataclass
class TrainArgs:
    stage: int = 3
    nproc: int = 2
    steps: int = 50
    batch_size: int = 8          # per rank
    seq_len: int = 64
    size: str = "small"
    layers: int | None = None
    width: int | None = None
    lr: float = 3e-3
    data: list[str] = field(default_factory=list)
    config: str | None = None    # a DeepSpeed-style JSON; --stage overrides its stage
    out: str = "out"
    seed: int = 0

    def model_config(self) -> GPTConfig:
        layers, width, heads = SIZES[self.size]
        width = self.width or width
        return GPTConfig(seq_len=self.seq_len, layers=self.layers or layers, width=width,
                         heads=heads if width % heads == 0 else 1)

    def engine_config(self) -> zeroshard.Config:
        raw = dict(zeroshard.Config.load(self.config).raw) if self.config else {}
        raw["zero_optimization"] = {**raw.get("zero_optimization", {}), "stage": self.stage}
        return zeroshard.Config.load(raw)


def launch(args: TrainArgs) -> None:
    """Run `worker` on args.nproc local ranks (one per GPU where there are GPUs)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id=f"zeroshard-{port}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0,
                          monitor_interval=0.2)
    elastic_launch(config, worker)(args)


def worker(args: TrainArgs) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    torch.manual_seed(args.seed)
    config = args.engine_config()
    model = GPT(args.model_config())
    engine = zeroshard.initialize(model, lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.1), config)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = Batches(load_corpus(args.data or None), args.seq_len)
    batch_rng = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches

    progress = _progress(args.steps, rank)
    losses, tokens, start = [], 0, time.perf_counter()
    for step in range(args.steps):
        x, y = data.get("train", args.batch_size, batch_rng)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(_mean_over_ranks(loss))
        tokens += x.numel() * world
        mem = engine.memory_stats()["model_states"] / 2**20
        progress.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - start):.0f}",
                             states_MiB=f"{mem:.1f}")
        progress.update()
    progress.close()

    val = _evaluate(engine, data, args)
    report = _report(engine, args, losses[-1], val)
    if rank == 0:
        print(report)


def _progress(steps: int, rank: int):
    from tqdm import tqdm
    return tqdm(total=steps, disable=rank != 0, desc="train", dynamic_ncols=True)


def _mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


@torch.no_grad()
def _evaluate(engine, data: Batches, args: TrainArgs, batches: int = 4) -> float:
    rng = torch.Generator().manual_seed(12345 + dist.get_rank())
    losses = [lm_loss(engine(x), y) for x, y in (data.get("val", args.batch_size, rng) for _ in range(batches))]
    return _mean_over_ranks(torch.stack(losses).mean())


def _report(engine, args: TrainArgs, train_loss: float, val_loss: float) -> str:
    """Model-state bytes per rank beside the paper's formula, traffic beside 2Ψ / 3Ψ, losses."""
    stage, world = args.stage, dist.get_world_size()
    per_rank = engine.comm.all_gather_objects(engine.memory_stats())
    psi = engine.num_parameters()
    traffic = sum(v["bytes"] for v in engine.comm_stats()["last_step"].values())
    formula = paper_model_state_bytes(psi, world, stage, 4, 4, 8)
    mib = 2**20
    lines = [f"\nGPT {args.model_config()}: Ψ = {psi:,} parameters, ZeRO stage {stage}, {world} ranks, fp32 AdamW",
             f"{'rank':>6} {'params':>10} {'grads':>10} {'optimizer':>10} {'states':>10}   paper (MiB)"]
    for r, s in enumerate(per_rank):
        lines.append(f"{r:>6} {s['params'] / mib:>10.2f} {s['grads'] / mib:>10.2f} {s['optimizer'] / mib:>10.2f} "
                     f"{s['model_states'] / mib:>10.2f}   {formula / mib:.2f}")
    factor = 3 if stage == 3 else 2
    lines.append(f"traffic per step: {traffic / mib:.2f} MiB (paper: {factor}Ψ = {factor * 4 * psi / mib:.2f} MiB)")
    lines.append(f"loss: train {train_loss:.4f}, validation {val_loss:.4f}")
    return "\n".join(lines)
