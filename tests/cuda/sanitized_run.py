"""Run by test_cuda.py under TORCH_CUDA_SANITIZER=1: stages 2 and 3 on one GPU, defaults on."""
import torch

import zeroshard
from helpers.models import TinyGPT, batches, loss_fn

zeroshard.ensure_process_group(backend="nccl")
for stage in (2, 3):
    torch.manual_seed(0)
    engine = zeroshard.initialize(TinyGPT(d=64), lambda p: torch.optim.AdamW(p, lr=1e-2),
                                  {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}})
    for x, y in batches(4, 8):
        engine.backward(loss_fn(engine(x.cuda()).float(), y.cuda()))
        engine.step()
    torch.cuda.synchronize()
    print(f"trained stage {stage}")
