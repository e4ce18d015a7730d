"""Memory: what this rank holds (exact sums over the engine's own buffers) and the paper's model.

The paper's per-rank model-state memory for Ψ parameters on N data-parallel ranks, with p, g and k
bytes per parameter of parameters, gradients and optimizer state: stage 0 (p + g + k)Ψ; stage 1
(p + g)Ψ + kΨ/N; stage 2 pΨ + (g + k)Ψ/N; stage 3 (p + g + k)Ψ/N. fp32 Adam: p = g = 4, k = 8;
mixed-precision Adam: p = g = 2, k = 12.
"""
from __future__ import annotations

from typing import Iterable

import torch


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
