"""Non-finite gradients without a loss scaler (bf16, fp32): found on every rank at once, then named.

fp16 has its loss scaler, which skips overflowing steps. bf16 and fp32 have nothing, so one NaN would
silently spread into every weight. At each optimizer step the guard decides, identically on every
rank: the global gradient norm, measured at every step (one 4-byte all-reduce, counted in the step's
traffic), carries the answer, since a non-finite element makes the norm non-finite everywhere. Stage 0
needs no collective: its reduced gradients are the same on every rank. A non-finite loss is folded
into the same norm (it is local to the rank that computed it).

Then `zeroshard.on_nonfinite` decides: "raise" (the default) names the step, the first unit and
parameter (in the model's order) with a non-finite gradient element and the ranks whose loss was
non-finite; "skip" leaves the weights, the optimizer state and the lr schedule untouched and counts
the step.
"""
from __future__ import annotations

import logging
import math

import torch

from ..comm.collectives import Comm
from .flat_param import FlatParam

logger = logging.getLogger("zeroshard")


class NonFiniteError(FloatingPointError):
    """A NaN or inf gradient or loss in bf16/fp32 training (zeroshard.on_nonfinite: "raise")."""


class NonFiniteGuard:
    """Decides, the same on every rank, whether a step's gradients (or losses) are non-finite."""

    def __init__(self, action: str, comm: Comm) -> None:
        self.action, self.comm = action, comm
        self.skipped = 0                           # steps skipped with action "skip"
        self._bad_loss: torch.Tensor | None = None  # 1.0 once a loss of this cycle was not finite

    def note_loss(self, loss: torch.Tensor) -> None:
        """Remember (without a host sync) whether a loss of this accumulation cycle was non-finite."""
        bad = (~torch.isfinite(loss.detach().float())).float().reshape(())
        self._bad_loss = bad if self._bad_loss is None else torch.maximum(self._bad_loss, bad)

    def fold_into_norm(self, squares: torch.Tensor, sharded: bool) -> torch.Tensor:
        """The squared norm, made infinite where a loss was non-finite (before its all-reduce)."""
        if sharded and self._bad_loss is not None:
            squares = squares + torch.where(self._bad_loss.to(squares.device) > 0, math.inf, 0.0)
        return squares

    def handle(self, trainable: list[FlatParam], step: int) -> None:
        """Collective. The step's gradients are non-finite: raise, or count a skip (then return)."""
        first = _first_nonfinite(trainable)
        bad_loss = bool(self._bad_loss is not None and self._bad_loss.item() > 0)
        found = self.comm.all_gather_objects((first, bad_loss))
        self.end_cycle()
        hits = [(hit, r) for r, (hit, _) in enumerate(found) if hit is not None]
        what = "gradient norm: every element is finite, but their squared norm overflowed"
        if hits:
            (_, _, element, name, label, value), rank = min(hits)
            what = (f"gradient, first in {label}, parameter '{name}' (element {element}: {value}, rank "
                    f"{rank}'s shard)")
        losses = [r for r, (_, bad) in enumerate(found) if bad]
        loss_note = f"; the loss was not finite on ranks {losses}" if losses else ""
        if self.action == "skip":
            self.skipped += 1
            if self.comm.rank == 0:  # every rank skips it: one line says so
                logger.warning("step %d skipped: non-finite %s%s", step, what, loss_note)
            return
        raise NonFiniteError(f"step {step}: non-finite {what}{loss_note}. Nothing was updated and "
                             f"this step's gradients were dropped: catching this, training goes on with "
                             f"the next batch. Lower the learning rate, enable gradient_clipping, or set "
                             f"\"zeroshard\": {{\"on_nonfinite\": \"skip\"}} to skip such steps")

    def end_cycle(self) -> None:
        self._bad_loss = None


def _first_nonfinite(trainable: list[FlatParam]) -> tuple[int, int, int, str, str, float] | None:
    """(buffer index, offset in the buffer, element in its parameter, parameter name, unit label,
    value) of this rank's first non-finite gradient element, in the model's order; None if none."""
    for index, f in enumerate(trainable):
        grad = f.local_grad()
        bad = (~torch.isfinite(grad)).nonzero()
        if bad.numel() == 0:
            continue
        i = int(bad[0, 0])
        offset = (f.range[0] if grad.numel() != f.layout.padded_numel else 0) + i
        for slot in f.layout.slots:
            if slot.offset <= offset < slot.offset + slot.numel:
                return index, offset, offset - slot.offset, slot.names[0], f.label, float(grad[i])
    return None
