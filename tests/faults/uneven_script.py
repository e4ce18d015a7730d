"""Launched under torchrun by test_divergence: rank 1 takes one step fewer, then every rank exports
the full state. The ranks' collectives differ; the job must end with the DivergenceError named."""
import sys

import torch
import torch.distributed as dist

import zeroshard
from helpers.models import TinyGPT, batches, loss_fn

torch.set_num_threads(1)
torch.manual_seed(0)
engine = zeroshard.initialize(TinyGPT(), lambda p: torch.optim.AdamW(p, lr=1e-2),
                              {"zero_optimization": {"stage": int(sys.argv[1])}})
rank = dist.get_rank()
for x, y in batches(3 - rank, 4):
    engine.backward(loss_fn(engine(x), y))
    engine.step()
engine.full_state_dict()
print(f"rank {rank} exported")
