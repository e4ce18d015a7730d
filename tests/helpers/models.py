"""Test models with the shapes that break ZeRO implementations, and a reference trainer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .margins import close

VOCAB, SEQ = 37, 8


class Block(nn.Module):
    def __init__(self, d: int, mult: int = 4) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, mult * d)
        self.down = nn.Linear(mult * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class TinyGPT(nn.Module):
    """Tied embedding/output, a frozen layer, a layer used only on even steps, an unused layer,
    a block called twice per forward, a frozen parameter inside a block, and buffers (a random one,
    so ranks built from different seeds differ). `mults` gives blocks of different widths;
    `checkpointing` recomputes each block in backward (torch.utils.checkpoint), `twice` at each call."""

    def __init__(self, d: int = 16, layers: int = 2, mults: tuple[int, ...] | None = None,
                 checkpointing: str | None = None) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, m) for m in (mults or (4,) * layers))
        self.checkpointing = checkpointing  # None, "reentrant" or "non-reentrant"
        self.twice = Block(d)                     # called twice in one forward
        self.frozen = nn.Linear(d, d)             # never trained
        self.frozen.requires_grad_(False)
        self.blocks[0].ln.bias.requires_grad_(False)  # a frozen parameter inside a unit
        self.sometimes = nn.Linear(d, d)          # used on even steps only
        self.unused = nn.Linear(d, 3)             # never used: zero gradient
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.tok.weight        # tied
        self.register_buffer("scale", 0.8 + 0.2 * torch.rand(d))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, idx: torch.Tensor, use_sometimes: bool = True) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks + [self.twice, self.twice]:  # reentrant: `twice` reports its gradients twice
            if self.checkpointing:
                x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
            else:
                x = block(x)
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


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def sgd(params):
    """SGD with momentum: unlike Adam, a gradient off by a constant factor shows in the weights."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def tiny_gpt(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def train_on_slices(engine, rank: int, world_size: int, steps: int = 4, global_batch: int = 12,
                    before_forward=None, after_forward=None) -> list[float]:
    """`steps` steps of TinyGPT on `batches`, each rank on its slice of every global batch (the
    `sometimes` branch on even steps); the global loss per step: the mean of the ranks' local means
    (equal local batch sizes). `before_forward()` and `after_forward()`, if given, run around each
    forward."""
    local, losses = global_batch // world_size, []
    for step, (x, y) in enumerate(batches(steps, global_batch)):
        mine = slice(rank * local, (rank + 1) * local)
        if before_forward is not None:
            before_forward()
        out = engine(x[mine], use_sometimes=step % 2 == 0)
        if after_forward is not None:
            after_forward()
        loss = loss_fn(out, y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    stacked = torch.stack(losses)
    torch.distributed.all_reduce(stacked)
    return (stacked / world_size).tolist()


def rank_batch(rank: int, world_size: int, per_rank: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of one global batch of world_size x per_rank sequences."""
    x, y = batches(1, per_rank * world_size)[0]
    mine = slice(per_rank * rank, per_rank * (rank + 1))
    return x[mine], y[mine]


def reference_run(make_model, make_optimizer, steps: int, global_batch: int, groups=None,
                  scheduler=None, clip: float = 0.0, dtype: torch.dtype = torch.float32, micro: int = 1,
                  norms: list[float] | None = None):
    """Single-process training on the whole global batch. Gradients start as zeros and are zeroed,
    not set to None: ZeRO's flat buffers give unused parameters a zero gradient (as DeepSpeed and
    FSDP do), so stateful optimizers still move them. Optional: parameter groups (model -> groups),
    an lr scheduler (optimizer -> scheduler) stepped after each step, global-norm clipping, `micro`
    micro-batches per step (each loss divided by `micro`), and a 16-bit `dtype`: parameters,
    activations and gradients in it, the optimizer on fp32 master copies (mixed precision).
    `norms`, if given, receives each step's global gradient norm before clipping."""
    model = make_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    master = trainable if dtype == torch.float32 else [nn.Parameter(p.detach().float()) for p in trainable]
    by_id = {id(p): m for p, m in zip(trainable, master)}
    opt = make_optimizer([{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in groups(model)]
                         if groups else master)
    sched = scheduler(opt) if scheduler else None
    model.to(dtype)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    losses = []
    for step, (x, y) in enumerate(batches(steps, global_batch)):
        loss_sum = 0.0
        for part in torch.arange(global_batch).chunk(micro):
            loss = loss_fn(model(x[part], use_sometimes=step % 2 == 0).float(), y[part])
            (loss / micro).backward()
            loss_sum += loss.item() / micro
        for p, m in zip(trainable, master):
            if m is not p:
                m.grad = p.grad.float()
        if norms is not None:
            norms.append(torch.nn.utils.get_total_norm([m.grad for m in master]).item())
        if clip:
            torch.nn.utils.clip_grad_norm_(master, clip)
        opt.step()
        opt.zero_grad(set_to_none=False)
        with torch.no_grad():
            for p, m in zip(trainable, master):
                if m is not p:
                    p.copy_(m)
                    p.grad.zero_()
        if sched:
            sched.step()
        losses.append(loss_sum)
    if dtype != torch.float32:  # export the fp32 masters, as zeroshard's full_state_dict does
        model.float()
        with torch.no_grad():
            for p, m in zip(trainable, master):
                p.copy_(m)
    return model, losses


def assert_matches_reference(engine, losses, ref_model, ref_losses, what: str, rtol: float = 1e-5,
                             atol: float = 2e-6) -> None:
    """fp32 defaults: the same arithmetic summed in another order (1e-7 measured, 1e-5 allowed)."""
    close(losses, ref_losses, rtol=rtol, atol=atol, what=f"{what} losses")
    assert_weights_match(engine, ref_model.state_dict(), rtol, atol, what)


def assert_weights_match(engine, reference: dict[str, torch.Tensor], rtol: float, atol: float,
                         what: str) -> None:
    """The engine's full_state_dict() has the reference's names, in its order, and values within
    atol + rtol * |reference| (collective: every rank calls it)."""
    full = engine.full_state_dict()
    assert list(full) == list(reference), what
    for name, value in reference.items():
        close(full[name], value, rtol=rtol, atol=atol, what=f"{what} {name}")
