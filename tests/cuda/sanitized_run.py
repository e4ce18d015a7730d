"""Run by test_cuda.py under TORCH_CUDA_SANITIZER=1: stages 2 and 3 on one GPU, defaults on; then
with optimizer and parameter offload, whose copies run on a side stream."""
import torch

import zeroshard
from helpers.models import TinyGPT, batches, loss_fn

zeroshard.ensure_process_group(backend="nccl")
OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu", "pin_memory": True}}
for stage, offload in ((2, {}), (3, {}), (2, {"offload_optimizer": OFFLOAD["offload_optimizer"]}),
                       (3, OFFLOAD)):
    torch.manual_seed(0)
    engine = zeroshard.initialize(TinyGPT(d=64), lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
                                  {"zero_optimization": {"stage": stage, **offload},
                                   "bf16": {"enabled": True}})
    for x, y in batches(4, 8):
        engine.backward(loss_fn(engine(x.cuda()).float(), y.cuda()))
        engine.step()
    torch.cuda.synchronize()
    print(f"trained stage {stage}" + (" with offload" if offload else ""))
