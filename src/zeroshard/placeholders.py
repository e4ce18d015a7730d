"""What a parameter is while its buffer is not gathered (stage 3 at rest, stages 1-2 while a
deferred post-step all-gather is in flight): an empty tensor of its dtype, on its device.

A read of it fails loudly or reads nothing. A write into it (`p.zero_()`, `nn.init.normal_(p)`,
`model.apply(init_fn)` after initialize) would be lost without a word: the values live in the shard
and the master, which the write never reaches. So each placeholder's autograd version is noted when
the parameter is pointed at it, and the next gather refuses a parameter whose version moved, by
name, with the way to change weights that does reach them. (`p.data.zero_()` bypasses the version
counter, as it bypasses autograd: that one cannot be seen.)
"""
from __future__ import annotations

import torch
from torch import nn

from .parallel.dtensor import TpSpec, point
from .partition import Slot


class Placeholders:
    """The empty tensor a buffer's parameters view while it is not gathered, and their versions."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.empty = torch.empty(0, dtype=dtype, device=device)
        self.versions: list[int] | None = None  # noted when pointed here; None while gathered

    def point(self, params: list[nn.Parameter], specs: list[TpSpec | None]) -> None:
        for p, spec in zip(params, specs):
            point(p, self.empty, spec)
        self.note(params)

    def note(self, params: list[nn.Parameter]) -> None:
        """Take the versions as they are now (after zeroshard's own version bump at a step)."""
        self.versions = [p._version for p in params]

    def check_untouched(self, params: list[nn.Parameter], slots: list[Slot]) -> None:
        """Before the parameters view gathered values again: none was written meanwhile."""
        versions, self.versions = self.versions, None
        if versions is None:
            return
        written = [slot.names[0] for p, slot, v in zip(params, slots, versions) if p._version != v]
        if written:
            raise RuntimeError(
                f"{', '.join(written)} changed in place while this rank held only its shard (outside "
                f"forward at stage 3, or before the deferred all-gather landed): the parameter was an "
                f"empty placeholder, so the change was lost. Change weights inside `with "
                f"engine.gathered_parameters(modifier_rank=0):` (rank 0's values go to every rank and "
                f"into the fp32 masters), or before initialize()")
