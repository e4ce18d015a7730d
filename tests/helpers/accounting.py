"""Independent measurements for tests: a census of live tensor storages, and the paper's formula
for a model with frozen parameters (parameters count all of Ψ, gradients and Adam only trainable),
in fp32 or 16 bits."""
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


def adam_formula(psi_all: int, psi_trainable: int, world_size: int, stage: int,
                 param_bytes: int = 4) -> float:
    """The paper's per-rank model states for Adam: fp32 params 4Ψ, grads 4Ψ, Adam 8Ψ; in 16 bits
    params 2Ψ, grads 2Ψ, fp32 master and Adam 12Ψ (K = 12)."""
    n = world_size
    params = param_bytes * psi_all / (n if stage >= 3 else 1)
    grads = param_bytes * psi_trainable / (n if stage >= 2 else 1)
    k = 8 if param_bytes == 4 else 12
    adam = k * psi_trainable / (n if stage >= 1 else 1)
    return params + grads + adam
