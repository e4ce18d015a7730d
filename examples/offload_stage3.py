"""A model larger than your device: stage 3 with the optimizer and the parameters offloaded to
host memory (ZeRO-Offload), built without ever holding it whole, saved and exported.

    torchrun --nproc-per-node 2 examples/offload_stage3.py --layers 24 --width 1024

Under `zeroshard.init()` the model's tensors are deferred (shapes, no memory); `initialize`
materializes one block at a time and keeps only this rank's shards: on the device only the block
being computed, on the host the fp32 master shards and Adam's state. After training, the sharded
checkpoint is consolidated into one safetensors file that loads without zeroshard.
"""
import argparse
import os

import torch
from safetensors.torch import save_file
from torch import nn

import zeroshard

CONFIG = {
    "zero_optimization": {"stage": 3,
                          "offload_optimizer": {"device": "cpu"},   # fp32 master + Adam on the host
                          "offload_param": {"device": "cpu"}},      # parameter shards at rest on the host
    "gradient_clipping": 1.0,
}


class MLPStack(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width)) for _ in range(layers))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.out(x).squeeze(-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="offload_out")
    args = p.parse_args()

    torch.manual_seed(0)
    with zeroshard.init():  # nothing allocated yet
        model = MLPStack(args.width, args.layers)
    # fused=True: torch's fused CPU kernel, several times faster over host shards
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True)  # noqa: E731
    engine = zeroshard.initialize(model, adamw, CONFIG)
    rank, _ = zeroshard.rank_and_world_size()
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(16, args.width, generator=g).to(engine.device)
        loss = (engine(x) - x.mean(-1)).pow(2).mean()  # learn to output the mean of the input
        engine.backward(loss)
        engine.step()
        mean = zeroshard.mean_over_ranks(loss)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {mean:.5f}")
    stats = engine.memory_stats()
    if rank == 0:
        print(f"Ψ = {engine.num_parameters():,}; model states per rank: "
              f"{stats['device'] / 2**20:.2f} MiB on the device, {stats['host'] / 2**20:.2f} MiB on the host")
    checkpoint = engine.save_checkpoint(os.path.join(args.out, "checkpoints"))  # sharded, collective
    if rank == 0:  # one full fp32 file from the shards, no process group needed
        save_file(zeroshard.consolidate(checkpoint), os.path.join(args.out, "model.safetensors"))
        print(f"checkpoint {checkpoint}; weights {os.path.join(args.out, 'model.safetensors')}")


if __name__ == "__main__":
    main()
