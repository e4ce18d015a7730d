"""Partition arithmetic: where each parameter lives in a flat buffer and which slice a rank owns.

Pure functions of shapes and the world size (no torch.distributed), so every rule here can be tested
in isolation. A flat buffer of `numel` elements is padded to a multiple of the world size N; rank r
owns the contiguous shard [r*S, (r+1)*S) with S = padded / N. Padding elements are zero and stay zero.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of `world_size` that is >= `numel` (0 stays 0)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return -(-numel // world_size) * world_size


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a flat buffer: elements [offset, offset + numel), viewed as `shape`.

    `names` holds every name the parameter has in the model (several for tied weights).
    """

    names: tuple[str, ...]
    offset: int
    numel: int
    shape: tuple[int, ...]

    @property
    def span(self) -> slice:
        """Where the parameter's elements are in the flat buffer: `flat[slot.span]`."""
        return slice(self.offset, self.offset + self.numel)


@dataclass(frozen=True)
class FlatLayout:
    """Parameters laid end to end, then padded so that N ranks own equal contiguous shards."""

    slots: tuple[Slot, ...]
    numel: int
    world_size: int

    @property
    def padded_numel(self) -> int:
        return padded_numel(self.numel, self.world_size)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of the elements owned by `rank` in the padded flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_chunks(self, max_elements: int) -> list[tuple[int, int]]:
        """Split a shard into [start, end) pieces so that one collective moves <= max_elements.

        A collective over a chunk moves N * chunk elements in total, so a chunk holds at most
        max_elements // N of them (at least one, so progress is always made).
        """
        step = max(1, max_elements // self.world_size)
        return [(s, min(s + step, self.shard_numel)) for s in range(0, self.shard_numel, step)]


def build_layout(params: Sequence[tuple[tuple[str, ...], tuple[int, ...]]], world_size: int) -> FlatLayout:
    """Lay out `(names, shape)` pairs end to end in the given order."""
    slots, offset = [], 0
    for names, shape in params:
        numel = math.prod(shape)
        slots.append(Slot(tuple(names), offset, numel, tuple(shape)))
        offset += numel
    return FlatLayout(tuple(slots), offset, world_size)
