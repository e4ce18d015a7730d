"""The stage as data (which model states are sharded), and the collectives' bucket sizes."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    """A ZeRO stage as data: which model states are sharded across the data-parallel ranks."""

    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool

    @staticmethod
    def for_stage(stage: int) -> "StagePolicy":
        return StagePolicy(stage >= 1, stage >= 2, stage >= 3)


@dataclass(frozen=True)
class Buckets:
    """Largest number of elements a single collective may move (DeepSpeed's bucket sizes)."""

    reduce: int
    gather: int
