"""A host cache of the parameter shards that rest on disk (`offload_param.max_in_cpu`).

Stage 3 reads a unit's shard at every all-gather: once for forward and again for backward. A shard
kept in host memory since its last read saves the second read, and the next step's, for as many
elements as the user lets memory hold.

Invariants:
- At most `capacity` elements are cached; the least recently used shard goes first, and a shard
  larger than the whole capacity is never cached. Capacity 0 caches nothing.
- The file stays the truth: every write goes to the file, and to the cached copy if there is one
  (write-through), so a cached copy is never stale for the step's own writes. Whoever writes a file
  another way (a checkpoint load writes through the map) calls clear() after.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

Key = tuple[str, int]  # (file path, element offset in it)


class ShardCache:
    """Copies of whole shards, by the file location they were read from."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._copies: OrderedDict[Key, torch.Tensor] = OrderedDict()
        self._numel = 0
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._copies.values())

    def read_into(self, key: Key, out: torch.Tensor) -> bool:
        """out <- the cached copy, if there is one (and mark it most recently used)."""
        copy = self._copies.get(key)
        if copy is None:
            self.misses += 1
            return False
        self._copies.move_to_end(key)
        out.copy_(copy.view_as(out))
        self.hits += 1
        return True

    def keep(self, key: Key, values: torch.Tensor) -> None:
        """Cache a copy of `values`, just read from the file at `key` (not cached: read_into missed)."""
        if values.numel() > self.capacity:
            return
        while self._numel + values.numel() > self.capacity:
            _, old = self._copies.popitem(last=False)
            self._numel -= old.numel()
        self._copies[key] = values.detach().reshape(-1).to("cpu", copy=True)
        self._numel += values.numel()

    def refresh(self, key: Key, values: torch.Tensor) -> None:
        """A write to the file at `key`: the cached copy, if any, takes the same values."""
        if key in self._copies:
            self._copies[key].copy_(values.reshape(-1))

    def clear(self) -> None:
        self._copies.clear()
        self._numel = 0
