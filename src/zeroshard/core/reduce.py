"""When gradients are reduced: each buffer as soon as all its gradients are in, in one fixed order.

(Stages 0-1 do the same with overlap_comm, on the backward that ends an accumulation cycle; a
further backward before the step is reduced at its end and added. Without it they reduce at step().)

Each trainable parameter's post-accumulate-grad hook moves its gradient into its flat buffer. At
stages 2-3 a complete buffer is reduce-scattered at once (asynchronously with overlap_comm, at most
two in flight so memory stays bounded) — but only in one fixed order: reverse registration, roughly
the order backward produces gradients. Which gradients arrive can differ between ranks (an expert
that got no tokens on one rank), so a buffer that is complete but not next waits; the order of the
collectives never depends on the data, and the ranks' collectives always pair up. The last two
buffers in that order go out together, as one reduce-scatter, where they can (`groups`, fixed at
set-up). At the end of backward the rest are reduced in the same order, with zeros where no gradient
came.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Callable, Iterator

from torch import nn

from ..common.states import move
from .flat_grad import GradState, reduce_together, reducible_together
from .flat_param import FlatParam
from .policy import StagePolicy
from .units import Unit, UnitProgress


class CyclePhase(Enum):
    """Where an accumulation cycle (the backwards between two optimizer steps) stands. Stages 2-3
    reduce every backward as its buffers complete and stay ACCUMULATING; stages 0-1 reduce once."""

    ACCUMULATING = "accumulating"  # stages 0-1: gradients accumulate locally until step() reduces them
    REDUCING = "reducing"          # stages 0-1, overlap_comm: the backward ending the cycle reduces
    REDUCED = "reduced"            # stages 0-1: the cycle is reduced; a later backward is added at its end


_PHASE_MOVES = {
    CyclePhase.ACCUMULATING: {CyclePhase.REDUCING},
    CyclePhase.REDUCING: {CyclePhase.REDUCED, CyclePhase.ACCUMULATING},  # back: inside no_sync()
    CyclePhase.REDUCED: {CyclePhase.ACCUMULATING},
}


class Sync(Enum):
    """Whether a backward's gradients are reduced (the default) or kept where they are (no_sync)."""

    REDUCE = "reduce"
    LOCAL = "local"    # inside no_sync(): accumulate locally; the first backward after it reduces


_SYNC_MOVES = {Sync.REDUCE: {Sync.LOCAL}, Sync.LOCAL: {Sync.REDUCE}}


@dataclass
class CycleCounts:
    """What one accumulation cycle (the backwards between two optimizer steps) has seen."""

    arrived: int = 0      # gradients that arrived (a plain loss.backward()'s too)
    backwards: int = 0    # engine.backward() calls (alike on every rank)
    plain: bool = False   # gradients came from a plain loss.backward() (not engine.backward())


@dataclass
class BackwardCursor:
    """Where the reductions of the backward in progress stand."""

    next_group: int = 0                   # position in `groups` of the next group to reduce
    reducing: FlatParam | None = None     # the last buffer whose reduction is in flight
    ends_cycle: bool = False              # this backward ends an accumulation cycle
    in_engine: bool = False               # inside engine.backward() (else a plain loss.backward())


class GradientReducer:
    """Owns the reduction schedule of one engine's flat buffers."""

    def __init__(self, units: list[Unit], policy: StagePolicy, overlap: bool,
                 on_complete: Callable[[], None]) -> None:
        self.units, self.policy, self.overlap = units, policy, overlap
        self.flats = [f for u in units for f in u.flats]
        self.order = [f for f in reversed(self.flats) if f.trainable]
        self.on_complete = on_complete  # accounting: a full gradient is at its largest now
        self.phase = CyclePhase.ACCUMULATING
        self.sync = Sync.REDUCE
        # Reduced together, always (never by what arrived: the collectives must not depend on the
        # data): the last two buffers where they allow it, the block whose backward ends the pass
        # and the root, whose embedding's gradient comes last. Each collective has a fixed cost on gloo.
        tail = self.order[-2:]
        self.groups = [[f] for f in self.order[:-2]] + ([tail] if reducible_together(tail) else
                                                        [[f] for f in tail])
        self.cycle = CycleCounts()
        self.cursor = BackwardCursor()
        self._unit_of = {id(f): u for u in units for f in u.flats}
        self._install_hooks()

    def _install_hooks(self) -> None:
        # The hooks live on the C++ side of each parameter, where Python's GC cannot see them: they
        # hold only a weak reference and indices, so a dropped engine is freed.
        me = weakref.ref(self)
        for u, unit in enumerate(self.units):
            for f, flat in enumerate(unit.flats):
                if flat.trainable:
                    for p in flat.params:
                        p.register_post_accumulate_grad_hook(partial(_grad_ready, me, u, f))

    def _set_phase(self, new: CyclePhase) -> None:
        self.phase = move(self.phase, new, _PHASE_MOVES, "the gradient reduction cycle")

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate locally; the first backward after it reduces everything."""
        before = self.sync
        self.sync = move(self.sync, Sync.LOCAL, _SYNC_MOVES, "the gradient reduction")
        try:
            yield
        finally:
            self.sync = move(self.sync, before, _SYNC_MOVES, "the gradient reduction")

    def begin_backward(self, ends_cycle: bool) -> None:
        """Stages 0-1 with overlap_comm: the backward that ends the accumulation cycle reduces its
        buffers as they complete, like DDP (otherwise step() reduces them). With offload_optimizer,
        that backward's reduced gradients start their way to the host as each reduction ends."""
        self.cursor.ends_cycle = ends_cycle
        self.cycle.backwards += 1
        self.cursor.in_engine = True
        if ends_cycle and self.overlap and not self.policy.shard_grads and \
                self.phase is CyclePhase.ACCUMULATING:
            self._set_phase(CyclePhase.REDUCING)

    def backward_failed(self, wait: bool = True) -> None:
        """engine.backward raised part-way: the reductions it issued are waited for (nothing writes
        into a buffer after the engine drops the cycle's gradients), and the next backward reduces
        from the first group again. Gradients arriving from now on come from a plain backward."""
        for flat in self.flats if wait else []:
            flat.wait_reduce()
        self.cursor = BackwardCursor(ends_cycle=self.cursor.ends_cycle)

    def end_step(self) -> None:
        """The optimizer step consumed the reduced gradients: a new accumulation cycle begins."""
        self._set_phase(CyclePhase.ACCUMULATING)
        self.cycle = CycleCounts()

    @property
    def saw_backward(self) -> bool:
        """A backward ran this cycle: engine.backward() (counted alike on every rank, whatever
        gradients this rank's data produced), or a plain loss.backward() that produced gradients."""
        return self.cycle.backwards > 0 or self.cycle.arrived > 0

    @property
    def left_local(self) -> bool:
        """Stages 2-3: gradients of this cycle are still unreduced (the backwards since the last
        reduction ran inside no_sync), and only a backward reduces them there."""
        unreduced = (GradState.ACCUMULATING, GradState.ACCUMULATING_MORE)
        return self.policy.shard_grads and any(f.grad_state in unreduced for f in self.flats if f.trainable)

    @property
    def _reducing_as_complete(self) -> bool:
        return self.sync is Sync.REDUCE and (self.policy.shard_grads or self.phase is CyclePhase.REDUCING)

    def on_grad(self, unit_index: int, flat_index: int, param: nn.Parameter) -> None:
        flat = self.units[unit_index].flats[flat_index]
        self.cycle.arrived += 1
        self.cycle.plain |= not self.cursor.in_engine
        if flat.accumulate(param):
            self.on_complete()
            self.reduce_ready()

    def reduce_ready(self) -> None:
        """Reduce, in the fixed order, each group whose buffers are complete, or (stage 3) whose
        units backward has passed (`UnitOrder._advance_to`: missing gradients count as zeros);
        stop at the first group that is neither."""
        if not self._reducing_as_complete:
            return
        cursor = self.cursor
        while cursor.next_group < len(self.groups) and all(
                f.complete or self._unit_of[id(f)].progress is UnitProgress.PASSED
                for f in self.groups[cursor.next_group]):
            self._reduce(self.groups[cursor.next_group], async_op=self.overlap)
            cursor.next_group += 1

    def _reduce(self, flats: list[FlatParam], async_op: bool) -> None:
        """Reduce one group of buffers: alone, or in one collective (see `groups`)."""
        if len(flats) > 1:
            reduce_together(flats, async_op)
            self._after_reduce(flats[-1], async_op)  # the last holds the work
            if self.policy.shard_params:
                for flat in flats[:-1]:
                    self._unit_of[id(flat)].maybe_reshard()
            return
        flats[0].reduce(async_op=async_op)
        self._after_reduce(flats[0], async_op)

    def _after_reduce(self, flat: FlatParam, async_op: bool) -> None:
        if not async_op:
            self._reduced(flat)
        else:  # at most two buffers in flight: communication overlaps the next unit's compute
            reducing = self.cursor.reducing
            if reducing is not None and reducing is not flat:
                reducing.wait_reduce()
                self._reduced(reducing)
            self.cursor.reducing = flat
        if self.policy.shard_params:
            self._unit_of[id(flat)].maybe_reshard()

    def _reduced(self, flat: FlatParam) -> None:
        """A reduction has ended: on the last backward before the step, the gradient is final."""
        if self.cursor.ends_cycle and self.sync is Sync.REDUCE and flat.reduced:
            flat.offload_grad()

    def finish_backward(self) -> None:
        """Every trainable buffer is reduced exactly once per backward (stages 2-3), in order. A
        parameter frozen since initialize, or unfrozen, is refused once the backward's collectives are
        done."""
        frozen = [name for flat in self.flats if flat.trainable for name in flat.frozen_since_initialize()]
        unfrozen = [name for flat in self.flats for name in flat.unfrozen_since_initialize()]
        late = self.phase is CyclePhase.REDUCED
        reduced_now = self._reducing_as_complete
        if reduced_now:
            for group in self.groups[self.cursor.next_group:]:
                self._reduce(group, async_op=False)  # nothing left to overlap with; memory stays flat
        for flat in self.flats:
            flat.wait_reduce()
            self._reduced(flat)
        if self.phase is CyclePhase.REDUCING:
            self._set_phase(CyclePhase.ACCUMULATING if self.sync is Sync.LOCAL else CyclePhase.REDUCED)
        if late and self.sync is Sync.REDUCE:  # stages 0-1: a backward after this cycle's reduction
            for flat in self.order:
                flat.reduce_late()
        elif reduced_now:
            self._reduce_again()
        for flat in self.flats:
            flat.end_backward()
        self.cursor = BackwardCursor(ends_cycle=self.cursor.ends_cycle)  # (read by a plain backward next)
        if frozen:
            raise RuntimeError(f"{frozen[:3]} frozen (requires_grad=False) after zeroshard.initialize(): the "
                               f"trainable parameters are fixed there, and the optimizer would still move a "
                               f"frozen one (weight decay, momentum) with a zero gradient. Freeze before "
                               f"initialize(), or put it in a parameter group with lr 0 and weight_decay 0")
        if unfrozen:
            raise RuntimeError(f"{unfrozen[:3]} unfrozen (requires_grad=True) after zeroshard.initialize(): "
                               f"they were frozen there, so they have no gradient buffer, master or "
                               f"optimizer state, and would silently not train. To unfreeze later, leave "
                               f"them trainable at initialize() in a parameter group with lr 0 (and "
                               f"weight_decay 0), and raise that group's lr when they should train")

    def _reduce_again(self) -> None:
        """Gradients that arrived after their buffer was reduced in this same backward are reduced
        and added now, buffer by buffer in the fixed order. That happens under reentrant activation
        checkpointing (torch's use_reentrant=True, and zeroshard's own): each recompute runs a
        backward of its own, so a block called several times (ALBERT's shared layer), or a parameter
        used inside and outside a checkpoint, reports its gradient once per recompute. Which buffers
        those are follows from the graph, which is the same on every rank (as `UnitOrder` assumes)."""
        for flat in self.order:
            if flat.grad_state is GradState.ACCUMULATING_MORE:
                if self.policy.shard_grads:
                    flat.reduce()  # added to the shard this backward already reduced into
                    flat.wait_reduce()
                else:
                    flat.reduce_late()
                self._reduced(flat)


def _grad_ready(reducer: "weakref.ref[GradientReducer]", unit_index: int, flat_index: int,
                param: nn.Parameter) -> None:
    live = reducer()
    if live is not None:
        live.on_grad(unit_index, flat_index, param)
