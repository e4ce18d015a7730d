"""A plain training loop on zeroshard, from a DeepSpeed-style JSON config.

    torchrun --nproc-per-node 2 examples/train_loop.py --config examples/ds_config.json

Each rank trains on its own slice of every batch; `initialize` starts the process group from
torchrun's variables (NCCL on GPUs, gloo on CPU) and moves the model to the rank's device.
The model is a small byte-level transformer with a tied embedding and head; the text is the
source of Python's own `json` package, so nothing is downloaded.
"""
import argparse
import json
import os

import torch
from torch import nn

import zeroshard


class TinyLM(nn.Module):
    """Blocks in an nn.ModuleList: zeroshard's units (stage 3 gathers one block at a time)."""

    def __init__(self, width: int, layers: int, seq: int, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0,
                                                               batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, sharded once
        nn.init.normal_(self.embed.weight, std=0.02)  # tied to the head: small logits at the start

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        causal = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        for block in self.blocks:
            x = block(x, src_mask=causal, is_causal=True)
        return self.head(x)


def text() -> torch.Tensor:
    folder = os.path.dirname(json.__file__)
    data = b"".join(open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))
                    if n.endswith(".py"))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="DeepSpeed-style JSON (default: stage 3, bf16 off, clipping 1.0)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--save", help="save a checkpoint here at the end (loadable at any world size)")
    p.add_argument("--resume", help="load this checkpoint first (saved at any world size or stage)")
    args = p.parse_args()
    config = args.config or {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}

    torch.manual_seed(0)  # the same initial model on every rank (initialize checks it)
    engine = zeroshard.initialize(TinyLM(args.width, args.layers, args.seq),
                                  optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
                                  config=config)
    rank, world = zeroshard.rank_and_world_size()
    if args.resume:
        engine.load_checkpoint(args.resume)
    data = text()
    batches = torch.Generator().manual_seed(1234 + rank)  # each rank its own samples
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=batches)
        x = torch.stack([data[s:s + args.seq] for s in starts]).to(engine.device)
        y = torch.stack([data[s + 1:s + args.seq + 1] for s in starts]).to(engine.device)
        loss = nn.functional.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        mean = zeroshard.mean_over_ranks(loss)  # a collective: every rank calls it
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {mean:.4f}")
    if args.save:
        engine.save_checkpoint(args.save)
    if rank == 0:
        stats = engine.memory_stats()
        print(f"model states per rank: {stats['model_states_in_step'] / 2**20:.2f} MiB at stage "
              f"{engine.config.stage} on {world} ranks")
        sent = engine.comm_stats()["total"].values()
        print(f"sent by this rank: {sum(v['intra_node_bytes'] for v in sent) / 2**20:.2f} MiB inside "
              f"its node, "
              f"{sum(v['inter_node_bytes'] for v in sent) / 2**20:.2f} MiB across nodes")


if __name__ == "__main__":
    main()
