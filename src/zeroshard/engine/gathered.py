"""Full parameters in the module outside forward: to read weights (a norm, an EMA, a look at one
layer) or to change them in place, at any stage, as DeepSpeed's GatheredParameters and FSDP's
summon_full_params allow.

Invariants:
- Inside, every parameter of the module views its full values in the compute dtype, on every rank
  (stage 3 gathers every unit: the whole model at once; stages 0-2 hold it anyway).
- Changes count only from `modifier_rank`: on exit its buffers are broadcast, and each rank writes
  into what it keeps (the fp32 master, or the shard of a frozen buffer) exactly the elements that
  differ from what it saw on entry. An element left alone keeps its master's full precision: writing
  the whole 16-bit buffer back would round every master to 16 bits.
- Without modifier_rank, or when the block raises, every rank's buffers are restored to what they
  were on entry: a change on one rank must never leave the ranks training different models. (So
  at stages 0-2 the block holds one more copy of the compute-dtype parameters.)
- On exit stage 3 frees what it gathered; the next forward gathers the new values. A forward inside
  gathers and frees nothing and is not recorded for prefetching, so one rank may run it alone
  (DeepSpeed's "gather, then generate on rank 0").
"""
from __future__ import annotations

import operator
from contextlib import contextmanager
from typing import Iterator

import torch

from ..comm.agree import first_error
from ..comm.collectives import Comm
from ..core.flat_param import FlatParam, ParamState
from ..core.guards import Edits
from ..core.units import Unit
from ..offload.host import disk_store


_GATHERS_ALL = ("it gathers every parameter of the model (DeepSpeed's GatheredParameters(params, "
                "modifier_rank) names the parameters first); e.g. gathered_parameters(modifier_rank=0), or "
                "gathered_parameters() to read")


def check_can_gather(comm: Comm, params: tuple, modifier_rank: int | None,
                     delayed_update: bool) -> int | None:
    """What gathered_parameters refuses, alike on every rank (before any collective); returns the
    modifier rank as a Python int."""
    if params:
        raise TypeError(f"gathered_parameters() takes no positional argument, got "
                        f"{type(params[0]).__name__}: {_GATHERS_ALL}")
    if delayed_update:
        raise RuntimeError("gathered_parameters() with zeroshard.delayed_param_update: the parameters are a "
                           "step behind the master by design; read engine.full_state_dict() instead")
    try:
        modifier_rank = None if modifier_rank is None else operator.index(modifier_rank)  # numpy's too
    except TypeError:
        raise TypeError(f"gathered_parameters(modifier_rank=) takes a rank or None, got "
                        f"{type(modifier_rank).__name__}: {_GATHERS_ALL}") from None
    if modifier_rank is not None and not 0 <= modifier_rank < comm.world_size:
        raise ValueError(f"modifier_rank {modifier_rank} is not a rank of the {comm.world_size}-rank group")
    if modifier_rank is not None and comm.tp_size > 1:
        raise NotImplementedError("gathered_parameters(modifier_rank=...) under tensor parallelism: change "
                                  "the weights before initialize(), or load them with load_checkpoint()")
    return modifier_rank


@contextmanager
def full_parameters(units: list[Unit], flats: list[FlatParam], comm: Comm,
                    modifier_rank: int | None) -> Iterator[None]:
    """Collective on entry and exit (see the module docstring)."""
    for unit in units:
        unit.unshard()  # a no-op where the buffer is kept gathered
    # What each rank saw on entry: the whole buffer where it stays gathered after the block (edits
    # not taken must be undone there, or this rank would train on them alone), else the owned range
    # (stage 3 frees the buffer, and its edits with it; only the changes taken need it).
    seen = [f.full.clone() if f.persistent else
            f.full[slice(*f.owned_range())].clone() if modifier_rank is not None else None for f in flats]
    taken = False
    for unit in units:  # a module's load_state_dict() inside is taken too (core/guards.py)
        unit.set_edits(Edits.TAKEN if modifier_rank is not None else Edits.READ_ONLY)
    try:
        try:
            yield
        except Exception as e:  # the others still meet on exit: they raise too, rather than pair the
            # exit's collective with this rank's next one (which gloo answers by aborting)
            raised = f"rank {comm.rank} raised inside gathered_parameters(): {type(e).__name__}: {e}"
            try:
                _refuse_replaced(flats, comm, modifier_rank, raised)
            except RuntimeError:
                pass  # (this rank's own error is the one to raise)
            raise
        _refuse_replaced(flats, comm, modifier_rank)
        if modifier_rank is not None:
            _take_changes(flats, seen, comm, modifier_rank)
            taken = True
    finally:
        for unit in units:
            unit.set_edits(Edits.NONE)
        if not taken:  # read-only, or the block raised: every rank as it was
            with torch.no_grad():
                for flat, before in zip(flats, seen):
                    if flat.persistent and flat.state is ParamState.UNSHARDED:
                        flat.full.copy_(before)
        for flat in flats:  # edits inside were taken or undone: none is left to refuse
            flat.note_writes()
        for unit in units:
            unit.reshard()  # stage 3 only: buffers kept gathered stay


def _refuse_replaced(flats: list[FlatParam], comm: Comm, modifier_rank: int | None,
                     raised: str | None = None) -> None:
    """Collective: `p.data = t` inside (on the modifying rank alone, typically) would be dropped here
    without a word. Each replacement is pointed back and every rank raises alike, before any rank
    reaches the broadcasts, where the others would wait for the one that raised. So does an
    exception `raised` inside the block on some ranks: the others raise naming it."""
    error = raised
    for flat in flats:
        try:
            flat.refuse_replaced()
        except RuntimeError as e:
            error = error or str(e)
    collective = any(f.policy.shard_params for f in flats) or modifier_rank is not None
    if collective and comm.world_size > 1:  # (a read below stage 3 may run on one rank alone)
        comm.watch.clock.phase = "gathered_parameters()"  # (a forward inside, on one rank alone, set it)
        error = first_error(comm, error)
    if error:
        raise RuntimeError(error)


def _take_changes(flats: list[FlatParam], seen: list, comm: Comm, modifier_rank: int) -> None:
    with torch.no_grad(), comm.outside_step():
        for flat, before in zip(flats, seen):
            comm.broadcast(flat.full, modifier_rank)
            owned = slice(*flat.owned_range())
            now, before = flat.full[owned], before[owned] if flat.persistent else before
            changed = now != before
            kept = flat.owned_values()
            if kept.data_ptr() != flat.full.data_ptr() or kept.dtype != now.dtype:  # else changed in place
                kept[changed.to(kept.device)] = now[changed].to(kept.device, kept.dtype)
            if flat.trainable:
                flat.write_back()  # the compute-dtype parameters from the master, as after a step
        for flat in flats:
            flat.wait_write_back()
        for store in {id(s): s for s in map(disk_store, flats) if s is not None}.values():
            store.cache.clear()  # frozen shards were written through their file maps: cached copies are stale
