"""Memory: what this rank holds (exact sums over the engine's own buffers) and the paper's model.

The paper's per-rank model-state memory for Ψ parameters on N data-parallel ranks, with p, g and k
bytes per parameter of parameters, gradients and optimizer state: stage 0 (p + g + k)Ψ; stage 1
(p + g)Ψ + kΨ/N; stage 2 pΨ + (g + k)Ψ/N; stage 3 (p + g + k)Ψ/N. fp32 Adam: p = g = 4, k = 8;
mixed-precision Adam: p = g = 2, k = 12.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch
from torch import nn


def paper_model_state_bytes(psi: float, world_size: int, stage: int, param_bytes: float = 2,
                            grad_bytes: float = 2, optimizer_bytes: float = 12) -> float:
    """Per-rank model-state bytes from the ZeRO paper's formulas (Figure 1, Table 1)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    n = world_size
    p = param_bytes / n if stage >= 3 else param_bytes
    g = grad_bytes / n if stage >= 2 else grad_bytes
    k = optimizer_bytes / n if stage >= 1 else optimizer_bytes
    return (p + g + k) * psi


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))


def engine_stats(flats: list, optimizer: torch.optim.Optimizer, module: nn.Module, offload: bool,
                 peak_temporary: int, largest_bucket: int) -> dict[str, int]:
    """Engine.memory_stats(): the sum over the flat buffers' own accounts, by category."""
    held: Counter = Counter()
    for flat in flats:
        held.update(flat.bytes_held())
    # The paper's K counts the fp32 master copy with the optimizer state (K = 12 for Adam).
    optim = optimizer_state_bytes(optimizer) + held["master"]
    stats = {"params": held["params"], "grads": held["grads"], "optimizer": optim,
             "buffers": tensor_bytes(module.buffers()), "temporary": held["temporary"]}
    stats["model_states"] = stats["params"] + stats["grads"] + stats["optimizer"]
    stats["offloaded"] = optim if offload else 0  # held in host memory
    stats["peak_temporary"] = max(peak_temporary, stats["temporary"])
    stats["largest_bucket"] = largest_bucket
    return stats
