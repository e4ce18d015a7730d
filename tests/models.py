"""Test models with the shapes that break ZeRO implementations, and a reference trainer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 37, 8


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class TinyGPT(nn.Module):
    """Tied embedding/output, a frozen layer, a layer used only on even steps, an unused layer,
    a block called twice per forward, a frozen parameter inside a block, and buffers."""

    def __init__(self, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.twice = Block(d)                     # called twice in one forward
        self.frozen = nn.Linear(d, d)             # never trained
        self.frozen.requires_grad_(False)
        self.blocks[0].ln.bias.requires_grad_(False)  # a frozen parameter inside a unit
        self.sometimes = nn.Linear(d, d)          # used on even steps only
        self.unused = nn.Linear(d, 3)             # never used: zero gradient
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.tok.weight        # tied
        self.register_buffer("scale", torch.full((d,), 0.9))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, idx: torch.Tensor, use_sometimes: bool = True) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.twice(self.twice(x))
        x = x + 0.1 * self.frozen(x) * self.scale
        if use_sometimes:
            x = x + self.sometimes(x)
        return self.head(self.ln_f(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(steps: int, global_batch: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        data = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=g)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def rank_batch(rank: int, world_size: int, per_rank: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of one global batch of world_size x per_rank sequences."""
    x, y = batches(1, per_rank * world_size)[0]
    mine = slice(per_rank * rank, per_rank * (rank + 1))
    return x[mine], y[mine]


def reference_run(make_model, make_optimizer, steps: int, global_batch: int, groups=None,
                  scheduler=None, clip: float = 0.0):
    """Single-process training on the whole global batch. Gradients start as zeros and are zeroed,
    not set to None: ZeRO's flat buffers give unused parameters a zero gradient (as DeepSpeed and
    FSDP do), so stateful optimizers still move them. Optional: parameter groups (model -> groups),
    an lr scheduler (optimizer -> scheduler) stepped after each step, and global-norm clipping."""
    model = make_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(groups(model) if groups else trainable)
    sched = scheduler(opt) if scheduler else None
    for p in trainable:
        p.grad = torch.zeros_like(p)
    losses = []
    for step, (x, y) in enumerate(batches(steps, global_batch)):
        loss = loss_fn(model(x, use_sometimes=step % 2 == 0), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(trainable, clip)
        opt.step()
        opt.zero_grad(set_to_none=False)
        if sched:
            sched.step()
        losses.append(loss.item())
    return model, losses
