"""Full weights written as one file: a safetensors file where the name ends in .safetensors, else
torch.save. Atomic (a file at the final name is always complete: written beside it, then
renamed) and created as any other file the user makes, with their umask (safetensors itself
creates its files 0600)."""
from __future__ import annotations

import os

import torch


def write_weights(weights: dict[str, torch.Tensor], path: str) -> None:
    """`weights` to `path`. Tied names (one tensor under several names) are saved once by
    torch.save; safetensors stores no shared tensors, so each name gets its own copy there."""
    partial = f"{path}.partial"
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import save_file
            seen: set[int] = set()
            own = {}
            for name, value in weights.items():
                own[name] = value.contiguous() if id(value) not in seen else value.clone()
                seen.add(id(value))
            save_file(own, partial)
        else:
            torch.save(weights, partial)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(partial, 0o666 & ~mask)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
