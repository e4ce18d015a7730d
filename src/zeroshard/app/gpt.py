"""A small GPT (nanoGPT-shaped) for the main job and benchmarks: byte-level, tied embeddings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


from .sizes import SIZES, heads_for


@dataclass
class GPTConfig:
    """A byte-level GPT (256-symbol vocabulary, learned positions); by default the "small" size."""

    vocab_size: int = 256
    seq_len: int = 128
    layers: int = SIZES["small"][0]
    width: int = SIZES["small"][1]
    heads: int = SIZES["small"][2]


def config_for(size: str, layers: int | None, width: int | None, seq_len: int) -> GPTConfig:
    """The GPT a run's flags describe: a named size, with layers and width overridden where given
    (heads: sizes.heads_for)."""
    size_layers, size_width, _ = SIZES[size]
    width = width or size_width
    return GPTConfig(seq_len=seq_len, layers=layers or size_layers, width=width, heads=heads_for(size, width))


class SelfAttention(nn.Module):
    """Causal self-attention with separate q, k, v projections, so that a column split over tp
    gives each rank whole heads (the head count is read from the local width)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"width {cfg.width} must be divisible by heads {cfg.heads}")
        self.head_dim = cfg.width // cfg.heads
        self.q, self.k, self.v = (nn.Linear(cfg.width, cfg.width) for _ in range(3))
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.attn = SelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(),
                                 nn.Linear(4 * cfg.width, cfg.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    # Megatron's split for zeroshard.tensor_parallel: column-parallel q, k, v and MLP up projection,
    # row-parallel output projections; embeddings, norms and the tied head stay replicated.
    tp_plan = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
               "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@torch.no_grad()
def sample(logits_of: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor, new_tokens: int,
           context: int, generator: torch.Generator, temperature: float = 0.8,
           top_k: int = 40) -> torch.Tensor:
    """Top-k sampling from any causal LM given as idx -> logits. Under ZeRO stage 3 every rank must
    call this together (each forward gathers parameters), with the same generator seed."""
    for _ in range(new_tokens):
        logits = logits_of(idx[:, -context:])[:, -1].float() / temperature
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        probs = F.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        # Drawn on the CPU with the CPU generator (a torch.Generator lives on one device).
        idx = torch.cat([idx, torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)], dim=1)
    return idx


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def gpt_params(layers: int, width: int) -> int:
    """Ψ of this GPT at its default vocabulary and context (byte-level, tied), by the paper model's
    GPT-2 count (tests hold the two equal)."""
    from zeroshard.paper.estimate import gpt2_params
    cfg = GPTConfig(layers=layers, width=width)
    return gpt2_params(layers, width, cfg.vocab_size, cfg.seq_len)
