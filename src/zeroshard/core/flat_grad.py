"""The gradient side of a flat buffer: how gradients arrive, are reduced and reach the optimizer.

A trainable buffer's gradient lives in `grads.full` (full size, in the compute dtype) while it
accumulates, and in `grads.shard` (this rank's slice, in the accumulation dtype) once reduced:
- every parameter's gradient is added into `grads.full` as its post-accumulate-grad hook fires (at
  stages 2-3 a first gradient is copied into an unfilled buffer instead, and what none reached is
  zeroed before the buffer is read), and `param.grad` is dropped, so no second copy ever lives;
- stage 0 all-reduces `grads.full` (`grads.shard` is its slice); stages 1-3 reduce-scatter it into
  `grads.shard`; stages 2-3 then free `grads.full`, so between backwards only the shard remains;
- a buffer is reduced exactly once per backward (stages 2-3) or per step (stages 0-1); a later
  backward's gradients are reduced on their own and added (`ACCUMULATING_MORE`), never summed
  with a reduced gradient before reducing, which would count it N times;
- `grads.version` changes whenever the reduced gradient does: offload_optimizer's copy to the
  host is redone if it went down before the gradient was final.

`FlatGrad` is mixed into flat_param.FlatParam, whose constructor sets what these methods read (the
layout, policy, precision, comm, buckets, `full`, `master`, `host`) and calls `_init_grads()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import torch
from torch import nn

from ..comm import buckets
from ..comm.buckets import Pending, complete
from ..offload import host_step
from ..common.states import move
from ..parallel.dtensor import laid_out


# How gradient memory that is written before it is read is made: unfilled (a test poisons it with
# NaN, so that an element read before it was written, or zeroed, cannot pass unseen).
UNFILLED: Callable[..., torch.Tensor] = torch.empty


class GradState(Enum):
    """What a trainable buffer's gradient holds since the last step."""

    EMPTY = "empty"                # nothing since the last step
    ACCUMULATING = "accumulating"  # gradients collect in `grads.full`; nothing reduced since the last step
    REDUCED = "reduced"            # reduced and up to date: in this backward (stages 2-3) or this step (0-1)
    HELD = "held"                  # stages 2-3: the reduced sum of earlier backwards, not yet this one's
    ACCUMULATING_MORE = "accumulating more"  # a reduced gradient exists and this backward's gradients
    # collect to be reduced and added: in `grads.full` at stages 2-3, in `grads.late` at stages 0-1


_GRAD_MOVES = {
    GradState.EMPTY: {GradState.ACCUMULATING, GradState.REDUCED},
    GradState.ACCUMULATING: {GradState.REDUCED, GradState.EMPTY},
    GradState.REDUCED: {GradState.HELD, GradState.ACCUMULATING_MORE, GradState.EMPTY},
    GradState.HELD: {GradState.ACCUMULATING_MORE, GradState.REDUCED, GradState.EMPTY},
    GradState.ACCUMULATING_MORE: {GradState.REDUCED, GradState.EMPTY},
}
# Where a gradient arriving in backward takes a buffer: a first one starts accumulating; after a
# reduction (REDUCED, or HELD from an earlier backward) it collects to be reduced and added.
_AFTER_A_GRADIENT = {
    GradState.EMPTY: GradState.ACCUMULATING,
    GradState.ACCUMULATING: GradState.ACCUMULATING,
    GradState.REDUCED: GradState.ACCUMULATING_MORE,
    GradState.HELD: GradState.ACCUMULATING_MORE,
    GradState.ACCUMULATING_MORE: GradState.ACCUMULATING_MORE,
}


@dataclass
class GradData:
    """What a buffer's gradient holds, beside its GradState (which says what of it is current)."""

    # The full-size accumulator (stages 2-3: a temporary, freed once reduced), and this rank's reduced
    # slice (stages 2-3: from the first reduction after a step until the step; 0-1: a view of `full`).
    full: torch.Tensor | None = None
    shard: torch.Tensor | None = None
    late: torch.Tensor | None = None   # stages 0-1, ACCUMULATING_MORE: gradients after this step's reduction
    pending: set[int] = field(default_factory=set)    # parameters that have not reported in this backward
    unwritten: set[int] = field(default_factory=set)  # stages 2-3: parameters with no value in `full` yet
    inflight: Pending = field(default_factory=list)   # reductions issued and not yet complete (overlap_comm)
    version: int = 0  # bumped by every change to the reduced gradient (offload copies it to the host)


class FlatGrad:
    """The gradient half of FlatParam (see the module docstring)."""

    def _init_grads(self) -> None:
        self.grad_state = GradState.EMPTY
        self.grads = GradData()
        self.pending: Any = None  # a pipelined update of this buffer in flight (pipeline.Pending)

    def wait_update(self, raise_error: bool = True) -> None:
        """Wait for this buffer's pipelined update (pipeline.py), if one is in flight; its error is
        raised unless `raise_error` is False (backward hooks: kept for the next call that may)."""
        if self.pending is not None:
            self.pending.wait(self, raise_error)

    def _allocate_grads(self) -> None:
        """A trainable buffer's gradient storage at stages 0-1: the full buffer, lasting, with the
        shard its slice. (Stages 2-3 keep no gradient between steps: see _reduced_shard().)"""
        if not self.policy.shard_grads:
            self.grads.full = torch.zeros_like(self.full)
            self.grads.shard = self.grads.full[self.range[0]:self.range[1]]  # reduce-scattered in place
        self.grads.pending = set(self.slot_of)

    @property
    def grad_dtype(self) -> torch.dtype:
        """The reduced gradient's dtype (stages 2-3: zero_optimization's accumulation dtype)."""
        return self.precision.accumulate_dtype if self.policy.shard_grads else self.full.dtype

    def _reduced_shard(self, overwritten: bool = False) -> torch.Tensor:
        """`grads.shard`; at stages 2-3 allocated by the first reduction after a step and freed by
        zero_grad() (FSDP2's set_to_none): the forward, where activations peak, holds no gradient.
        `overwritten`: the caller writes every element (a reduction that does not add), so a new
        shard is left unfilled rather than zeroed first."""
        if self.grads.shard is None:
            new = UNFILLED if overwritten else torch.zeros
            self.grads.shard = new((self.layout.shard_numel,), dtype=self.grad_dtype, device=self.full.device)
        return self.grads.shard

    def _set_grad_state(self, new: GradState) -> None:
        self.grad_state = move(self.grad_state, new, _GRAD_MOVES, "a flat parameter's gradient")

    @property
    def reduced(self) -> bool:
        """Reduced and up to date: in this backward (stages 2-3), in this step (stages 0-1)."""
        return self.grad_state is GradState.REDUCED

    def accumulate(self, param: nn.Parameter) -> bool:
        """Move `param.grad` into the flat gradient buffer; True once every parameter has reported."""
        slot = self.slot_of[id(param)]
        grad = param.grad
        if grad.is_sparse:
            raise ValueError(f"'{slot.names[0]}' got a sparse gradient (an embedding with sparse=True); "
                             f"zeroshard reduces dense flat buffers: use sparse=False")
        if self.grads.full is None:  # stages 2-3: a temporary, freed by reduce()
            self.grads.full = self._new_full()
        self._set_grad_state(_AFTER_A_GRADIENT[self.grad_state])
        target = self.grads.full
        if self.grad_state is GradState.ACCUMULATING_MORE and not self.policy.shard_grads:
            if self.grads.late is None:  # stages 0-1: a backward after this step's reduction
                self.grads.late = torch.zeros_like(self.full)
            target = self.grads.late
        spec = self._spec_by_id[id(param)]
        if spec is not None:  # a DTensor's gradient: its local shard, in the placement of the parameter
            if tuple(grad.placements) != spec.placements:
                grad = grad.redistribute(placements=spec.placements)
            grad = laid_out(grad.to_local(), spec)
        if id(param) in self.grads.unwritten and target is self.grads.full:
            target[slot.span].copy_(grad.reshape(-1))
            self.grads.unwritten.discard(id(param))
        else:
            target[slot.span].add_(grad.reshape(-1))
        param.grad = None
        self.grads.pending.discard(id(param))
        return not self.grads.pending

    def _new_full(self) -> torch.Tensor:
        """Stages 2-3: a new accumulator, left unfilled. Each parameter's first gradient is copied
        into its slot rather than added to zeros (a copy instead of a fill and an add, which reads the
        zeros again); what no gradient reached is zeroed before the buffer is read (_filled_full)."""
        self.grads.unwritten = set(self.slot_of)
        return UNFILLED(self.full.shape, dtype=self.full.dtype, device=self.full.device)

    def _filled_full(self) -> torch.Tensor:
        """`grads.full` with every element defined: zeros in the padding and where no gradient came
        (all zeros, newly made, where none came at all)."""
        full = self.grads.full
        if full is None:
            return torch.zeros_like(self.full)
        if len(self.grads.unwritten) == len(self.slot_of):
            full.zero_()
        else:
            full[self.layout.numel:].zero_()
            for i in self.grads.unwritten:
                full[self.slot_of[i].span].zero_()
        self.grads.unwritten = set()
        return full

    def frozen_since_initialize(self) -> list[str]:
        """Names of this buffer's parameters that reported no gradient because they were frozen
        after initialize (requires_grad=False): the optimizer would still move them."""
        if not self.grads.pending:
            return []
        frozen = {id(p) for p in self.params if not p.requires_grad}
        return sorted(self.slot_of[i].names[0] for i in self.grads.pending if i in frozen)

    def unfrozen_since_initialize(self) -> list[str]:
        """Names of this frozen buffer's parameters that require a gradient now: unfrozen after
        initialize, they get none here (the buffer has no gradient, no master, no optimizer state)."""
        if self.trainable:
            return []
        return sorted(self.slot_of[id(p)].names[0] for p in self.params if p.requires_grad)

    @property
    def complete(self) -> bool:
        """Has every parameter reported its gradient in this backward?"""
        return self.trainable and not self.grads.pending

    def reduce(self, async_op: bool = False) -> None:
        """Average the gradient over ranks: all-reduce (stage 0) or reduce-scatter into the shard.
        With async_op the collectives are only issued; wait_reduce() completes them."""
        full = self._filled_full()
        dtype = self.precision.reduce_dtype
        self._grad_will_change()
        with self.comm.about(self.label):
            if not self.policy.shard_optimizer:
                self.grads.inflight += buckets.all_reduce_mean(self.comm, full, self.buckets.reduce, dtype,
                                                               async_op)
            else:
                accumulate = self._accumulating()
                chunks = self.layout.shard_chunks(self.buckets.reduce)
                out = self._reduced_shard(overwritten=not accumulate)
                self.grads.inflight += buckets.reduce_scatter_mean(self.comm, out, full, chunks, dtype,
                                                                   accumulate, async_op)
        self._reduce_issued()

    def _reduce_issued(self) -> None:
        if self.policy.shard_grads:
            self.grads.full = None  # in-flight work keeps its own reference until it completes
        self._set_grad_state(GradState.REDUCED)
        self.grads.pending = set(self.slot_of)

    def _accumulating(self) -> bool:
        """Stages 2-3: is a reduced sum of earlier backwards to be added to?"""
        return self.policy.shard_grads and self.grad_state in (GradState.HELD, GradState.ACCUMULATING_MORE)

    def wait_reduce(self) -> None:
        """Wait for issued reductions, in order, and apply what follows each (copy back, add)."""
        complete(self.grads.inflight)

    def _grad_will_change(self, in_place: bool = True) -> None:
        """The reduced gradient is about to change: written in place (a reduction, zeroing), or
        (stages 2-3 after the step) dropped, which a pipelined update that took it does not mind."""
        if self.host is not None:
            self.host.before_device_grad_changes()  # an offload may still be reading it
            if in_place and self.copier.one_memory:  # so may a pipelined update (never raises here:
                self.wait_update(raise_error=False)  # this may run in a backward hook)
        self.grads.version += 1

    def offload_grad(self) -> None:
        """offload_optimizer: start copying the reduced gradient to the host (its reductions done;
        a pipelined update still reading the host copy first ends)."""
        if self.host is not None:
            self.wait_update(raise_error=False)
            self.host.offload(self.local_grad(), self.grads.version)

    def local_grad(self) -> torch.Tensor:
        """The reduced gradient of what this rank updates (all of it at stage 0)."""
        return self._reduced_shard() if self.policy.shard_optimizer else self.grads.full

    def set_step_grad(self, factor: float | torch.Tensor) -> None:
        """Give the optimizer `factor` x the fp32 gradient of `master` (unscaling and clipping in
        one multiply; a tensor `factor` is a device scalar): an alias of the reduced gradient where
        possible, else a temporary copy."""
        grad = self.local_grad() if self.host is None else self.host.grad  # wait_offload() filled it
        if grad.dtype != torch.float32 or grad.device != self.master.device:
            grad = grad.to(self.master.device, torch.float32)
        scales = isinstance(factor, torch.Tensor) or factor != 1.0
        self.opt_param.grad = grad.mul_(factor) if scales else grad

    def clear_step_grad(self) -> None:
        self.opt_param.grad = None  # a copy, if one was made, is freed here

    def step_on_host(self, optimizer: torch.optim.Optimizer, factor: float, scratch: torch.Tensor,
                     write: bool, grad: torch.Tensor | None = None, group: dict | None = None) -> bool:
        """The step of an offloaded buffer in one pass over host memory (offload/host_step.py): the
        optimizer's update of the master by `factor` x the host gradient (or `grad`, taken earlier),
        and, with `write`, the compute-dtype copy written into write_back_target() as it goes.
        `group`: hyperparameters (host_step.update). Returns whether the copy was written."""
        out = self.write_back_target() if write else None
        grad = grad if grad is not None else self.host.grad
        host_step.update(optimizer, self.opt_param, grad, factor, out, scratch, group)
        return out is not None

    def wait_offload(self) -> None:
        """offload_optimizer: wait until the host holds this step's reduced gradient."""
        if self.host is not None:
            self.host.wait_offload(self.local_grad(), self.grads.version)

    def average_over_replicas(self) -> None:
        """MiCS: the reduced shard averaged over the replicas, which hold the same shard of the
        other copies of the model (their shard groups averaged their own ranks'): the world's mean.
        A copy offloaded early (during backward) is superseded: the version moves on."""
        if not self.trainable or self.comm.replicas == 1:
            return
        self.wait_reduce()
        self._grad_will_change()
        with self.comm.about(self.label):
            self.comm.all_reduce_replicas(self.local_grad())

    def reduce_late(self) -> None:
        """Stages 0-1: average the gradients of a backward that came after this step's reduction
        (zeros if none arrived here) and add them to the reduced gradient."""
        late = self.grads.late if self.grads.late is not None else torch.zeros_like(self.full)
        dtype = self.precision.reduce_dtype
        self._grad_will_change()
        with self.comm.about(self.label):
            if self.policy.shard_optimizer:
                chunks = self.layout.shard_chunks(self.buckets.reduce)
                buckets.reduce_scatter_mean(self.comm, self.grads.shard, late, chunks, dtype, accumulate=True)
            else:
                buckets.all_reduce_mean(self.comm, late, self.buckets.reduce, dtype)
                self.grads.full.add_(late)
        self.grads.late = None
        self._set_grad_state(GradState.REDUCED)

    def end_backward(self) -> None:
        """Forget which parameters reported during the backward that just ended. (At stages 0-1
        `reduced` lasts until the step: later backwards add to it through reduce_late.)"""
        self.grads.pending = set(self.slot_of) if self.trainable else set()
        if self.policy.shard_grads and self.grad_state is GradState.REDUCED:
            self._set_grad_state(GradState.HELD)

    def drop_gradients(self) -> None:
        """An abandoned accumulation cycle (a backward that raised, a refused backward or step):
        every gradient it left goes, reduced or not, so the next backward starts from nothing."""
        self.zero_grad()
        if self.policy.shard_grads:
            self.grads.full = None  # (a partial backward's sum; the next one starts a new accumulator)
        self.grads.late = None
        self.grads.pending = set(self.slot_of) if self.trainable else set()

    def zero_grad(self) -> None:
        if self.trainable:
            self._grad_will_change(in_place=not self.policy.shard_grads)
        if self.policy.shard_grads:
            self.grads.shard = None  # freed (an offload of it was waited for just above)
            if self.host is not None:
                self.host.drop_device_grad()
        elif self.grads.full is not None:
            self.grads.full.zero_()
        self._set_grad_state(GradState.EMPTY)


def reducible_together(flats: list[FlatGrad]) -> bool:
    """Can these buffers be reduce-scattered as one collective (stages 2-3, no host copies, one
    dtype end to end, within reduce_bucket_size)?"""
    if len(flats) < 2:
        return False
    first = flats[0]
    return first.policy.shard_grads and \
        sum(f.layout.padded_numel for f in flats) <= first.buckets.reduce and \
        all(f.host is None and f.comm is first.comm and
            f.full.dtype == first.full.dtype == f.precision.reduce_dtype == f.grad_dtype for f in flats)


def reduce_together(flats: list[FlatGrad], async_op: bool = False) -> None:
    """reduce() of several buffers in one reduce-scatter (reducible_together). The last
    holds the work: completing it writes every buffer's shard (finish_backward completes all)."""
    fulls = [f._filled_full() for f in flats]
    accumulate = [f._accumulating() for f in flats]
    for f in flats:
        f._grad_will_change()
    comm = flats[-1].comm
    with comm.about(" + ".join(f.label for f in flats)):
        shards = [f._reduced_shard(not add) for f, add in zip(flats, accumulate)]
        flats[-1].grads.inflight += buckets.reduce_scatter_together(comm, shards, fulls, accumulate, async_op)
    for f in flats:
        f._reduce_issued()
