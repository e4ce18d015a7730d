"""Several small flat buffers' all-gathers sent as one collective.

Why: a gloo collective costs a fixed amount of CPU beside its bytes (the worker thread's hand-off,
its syscalls), and on a machine with as many busy cores as ranks that cost is paid in wall time.
A model of small units (the CPU benchmarks' GPT: 0.2M elements a block) then spends more on the
fixed costs than on the bytes. Buffers that are due at the same moment (the first units of a
forward; every buffer's post-step gather at stages 1-2) therefore travel together, end to end in
one bucket (comm/buckets.gather_together), when they are small.

Invariant: a run sent together holds at most TOGETHER_NUMEL elements (and at most the
allgather_bucket_size), so the bucket and the copies in and out of it stay constant-size: a larger
buffer, whose fixed cost is small beside its bytes, goes alone and lands in place with no copy. The
post-step gathers keep at most MOST_IN_FLIGHT buckets at once over the whole step (all its
sub-groups), however many small buffers the model has.
Runs are formed from the buffers in the order given, which is the same on every rank, so the
collectives pair up.
"""
from __future__ import annotations

import torch

from ..comm import buckets
from ..comm.buckets import Pending, complete
from .flat_param import FlatParam, ParamState

TOGETHER_NUMEL = 1 << 20  # elements: 4 MiB of fp32, where the copies cost about one fixed cost
MOST_IN_FLIGHT = 2  # shared buckets alive at once during a step's post-step gathers


def runs(flats: list[FlatParam]) -> list[list[FlatParam]]:
    """Consecutive buffers grouped for one collective each: same dtype and group, within the limit."""
    runs: list[list[FlatParam]] = []
    total = 0
    for f in flats:
        last = runs[-1][-1] if runs else None
        limit = min(TOGETHER_NUMEL, f.buckets.gather)
        alone = f.comm.zeropp is not None and f.comm.zeropp.changes_gathers  # ZeRO++: its own gathers
        if last is None or alone or total + f.layout.padded_numel > limit or f.full.dtype != last.full.dtype \
                or f.comm is not last.comm:
            runs.append([])
            total = 0
        runs[-1].append(f)
        total += f.layout.padded_numel
    return runs


def unshard_flats(flats: list[FlatParam], in_flight: list[Pending] | None = None) -> None:
    """Issue the all-gathers of `flats` without waiting: those sharded (a prefetch) and those whose
    shard was just written back (the post-step gather of a buffer kept gathered). Each is left
    UNSHARDING; unshard() completes it (a run shares one Pending: whichever buffer is completed first
    copies every buffer of the run out of the bucket). With `in_flight` (the runs still in flight from
    earlier calls), the oldest run lands (copied out, its bucket freed) before a new one goes out
    whenever MOST_IN_FLIGHT are in flight, so that at most that many buckets exist at once."""
    for run in runs(flats):
        if len(run) == 1:
            run[0].issue_unshard()  # in place: no bucket
            continue
        while in_flight is not None and len(in_flight) >= MOST_IN_FLIGHT:
            with torch.no_grad():
                complete(in_flight.pop(0))  # its buffers stay UNSHARDING; their unshard() finds it landed
        shards = [f.outgoing_shard() for f in run]
        with torch.no_grad(), run[0].comm.about(" + ".join(f.label for f in run)):
            pending = buckets.gather_together(run[0].comm, [f.full for f in run], shards, async_op=True)
        for f in run:
            f.mark_unsharding(pending)
        if in_flight is not None:
            in_flight.append(pending)


def prefetch_flats(flats: list[FlatParam]) -> None:
    """Issue the all-gathers of the sharded buffers among `flats` (stage 3's prefetch)."""
    unshard_flats([f for f in flats if f.state is ParamState.SHARDED])


def write_back_together(flats: list[FlatParam], in_flight: list[Pending],
                        written: frozenset[FlatParam] = frozenset()) -> None:
    """FlatParam.write_back() for every buffer, their all-gathers issued together where small.
    wait_write_back() (or, with gather_behind_forward, the next forward) completes them.
    `in_flight`: the step's runs in flight, shared by its sub-groups' calls (a model of many small
    buffers: MOST_IN_FLIGHT buckets at once, not a second copy of its parameters). `written`: the
    buffers whose compute-dtype copy the step wrote as it updated (write_back_shard's `written`)."""
    due = [f for f in flats if f.write_back_shard(written=f in written)]
    unshard_flats(due, in_flight)
