"""Independent measurements for tests: a census of live tensor storages, and the paper's formula
for a model with frozen parameters (parameters count all of Ψ, gradients and Adam only trainable)."""
from __future__ import annotations

import gc

import torch


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python, found through the GC."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            s = obj.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def fp32_adam_formula(psi_all: int, psi_trainable: int, world_size: int, stage: int) -> float:
    """The paper's per-rank model states for fp32 Adam: params 4Ψ, grads 4Ψ, Adam 8Ψ."""
    n = world_size
    params = 4 * psi_all / (n if stage >= 3 else 1)
    grads = 4 * psi_trainable / (n if stage >= 2 else 1)
    adam = 8 * psi_trainable / (n if stage >= 1 else 1)
    return params + grads + adam
