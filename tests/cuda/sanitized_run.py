"""Run by test_cuda.py under TORCH_CUDA_SANITIZER=1: stages 2 and 3 on one GPU, defaults on; then
with optimizer and parameter offload, whose copies run on a side stream (at stage 3 issued by the
pipelined update's worker thread, and sequentially)."""
import torch

import zeroshard
from helpers.models import TinyGPT, batches, loss_fn

zeroshard.ensure_process_group(backend="nccl")
OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu", "pin_memory": True}}
OPTIMIZER = {"offload_optimizer": OFFLOAD["offload_optimizer"]}
for stage, offload, casts, pipelined in ((2, {}, "host", False), (3, {}, "host", False),
                                         (2, OPTIMIZER, "host", False),
                                         (3, OFFLOAD, "host", True), (3, OFFLOAD, "device", True),
                                         (3, OFFLOAD, "host", False)):
    torch.manual_seed(0)
    keys = {"offload_casts": casts, **({"pipelined_update": pipelined} if offload else {})}
    engine = zeroshard.initialize(TinyGPT(d=64), lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
                                  {"zero_optimization": {"stage": stage, **offload},
                                   "bf16": {"enabled": True}, "gradient_clipping": 1.0, "zeroshard": keys})
    for x, y in batches(4, 8):
        engine.backward(loss_fn(engine(x.cuda()).float(), y.cuda()))
        engine.step()
    engine.wait_for_parameters()
    torch.cuda.synchronize()
    ran = engine.pipeline is not None and engine.pipeline.started > 0
    assert ran == pipelined, (stage, offload, pipelined)
    how = ", pipelined" if pipelined else ", sequential"
    print(f"trained stage {stage}" + (f" with offload, casts on the {casts}{how}" if offload else ""))
