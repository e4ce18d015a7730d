"""The paper's per-rank model-state memory, and the bytes per parameter each precision implies.

For Ψ parameters on N data-parallel ranks, with p, g and k bytes per parameter of parameters,
gradients and optimizer state: stage 0 (p + g + k)Ψ; stage 1 (p + g)Ψ + kΨ/N; stage 2
pΨ + (g + k)Ψ/N; stage 3 (p + g + k)Ψ/N. fp32 Adam: p = g = 4, k = 8; mixed-precision Adam:
p = g = 2, k = 12 (fp32 master weights, momentum, variance).
"""
from __future__ import annotations

BYTES_PER_PARAM = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}  # (p, g, k) with Adam


def paper_model_state_bytes(psi: float, world_size: int, stage: int, param_bytes: float = 2,
                            grad_bytes: float = 2, optimizer_bytes: float = 12) -> float:
    """Per-rank model-state bytes from the ZeRO paper's formulas (Figure 1, Table 1). The defaults are
    the paper's mixed-precision Adam (2 + 2 + K=12 bytes per parameter); fp32 Adam is 4, 4, 8."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    n = world_size
    p = param_bytes / n if stage >= 3 else param_bytes
    g = grad_bytes / n if stage >= 2 else grad_bytes
    k = optimizer_bytes / n if stage >= 1 else optimizer_bytes
    return (p + g + k) * psi
