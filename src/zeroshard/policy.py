"""The stage as data, and the states a flat parameter buffer moves through."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class StagePolicy:
    """A ZeRO stage as data: which model states are sharded across the data-parallel ranks."""

    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool

    @staticmethod
    def for_stage(stage: int) -> "StagePolicy":
        return StagePolicy(stage >= 1, stage >= 2, stage >= 3)


class ParamState(Enum):
    SHARDED = "sharded"      # only the shard exists; module parameters are empty placeholders
    GATHERING = "gathering"  # an all-gather into `full` is in flight (prefetch, or stages 1-2
                             # after the step with overlap_comm); parameters are placeholders
    GATHERED = "gathered"    # `full` is allocated and current; module parameters view it


@dataclass(frozen=True)
class Buckets:
    """Largest number of elements a single collective may move (DeepSpeed's bucket sizes)."""

    reduce: int
    gather: int
