"""Launched by tests under torchrun (or as a plain process): initialize() must start the group itself."""
import sys

import torch
import torch.distributed as dist

import zeroshard
from helpers.models import TinyGPT, batches, loss_fn

torch.set_num_threads(1)
torch.manual_seed(0)
engine = zeroshard.initialize(TinyGPT(), lambda p: torch.optim.AdamW(p, lr=1e-2),
                              {"zero_optimization": {"stage": int(sys.argv[1])}})
rank, world = dist.get_rank(), dist.get_world_size()
losses = []
for x, y in batches(8, 4 * world):
    loss = loss_fn(engine(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4])
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
print(f"rank {rank}/{world} backend {dist.get_backend()} first {losses[0]:.4f} last {losses[-1]:.4f}")
assert losses[-1] < losses[0]
