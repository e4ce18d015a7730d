"""Several small flat buffers' all-gathers sent as one collective.

Why: a gloo collective costs a fixed ~0.3 ms of CPU beside its bytes (the worker thread's hand-off,
its syscalls), and on a machine with as many busy cores as ranks that cost is paid in wall time.
A model of small units (the CPU benchmarks' GPT: 0.2M elements a block) then spends more on the
fixed costs than on the bytes. Buffers that are due at the same moment (the first units of a
forward; every buffer's post-step gather at stages 1-2) therefore travel together, end to end in
one bucket (comm.gather_together), when they are small.

Invariant: a run sent together holds at most TOGETHER_NUMEL elements (and at most the
allgather_bucket_size), so the bucket and the copies in and out of it stay constant-size: a larger
buffer, whose fixed cost is small beside its bytes, goes alone and lands in place with no copy. The
post-step gathers keep at most two buckets at once (each sub-group's), however many small buffers.
Runs are formed from the buffers in the order given, which is the same on every rank, so the
collectives pair up.
"""
from __future__ import annotations

import torch

from .bucketing import Pending, complete
from .flat_param import FlatParam, ParamState

TOGETHER_NUMEL = 1 << 20  # elements: 4 MiB of fp32, where the copies cost about one fixed cost


def runs(flats: list[FlatParam]) -> list[list[FlatParam]]:
    """Consecutive buffers grouped for one collective each: same dtype and group, within the limit."""
    runs: list[list[FlatParam]] = []
    total = 0
    for f in flats:
        last = runs[-1][-1] if runs else None
        limit = min(TOGETHER_NUMEL, f.buckets.gather)
        if last is None or total + f.layout.padded_numel > limit or f.full.dtype != last.full.dtype \
                or f.comm is not last.comm:
            runs.append([])
            total = 0
        runs[-1].append(f)
        total += f.layout.padded_numel
    return runs


def gather_flats(flats: list[FlatParam], most_in_flight: int | None = None) -> None:
    """Issue the all-gathers of `flats` without waiting: those sharded (a prefetch) and those whose
    shard was just written back (the post-step gather of a buffer kept gathered). Each is left
    GATHERING; gather() completes it (a run shares one Pending: whichever buffer is completed first
    copies every buffer of the run out of the bucket). With `most_in_flight`, older runs are landed
    (copied out, buckets freed) as new ones go out, so that at most that many buckets exist at once."""
    shared: list[Pending] = []
    for run in runs(flats):
        if len(run) == 1:
            run[0].issue_gather()  # in place: no bucket
            continue
        shards = [f.outgoing_shard() for f in run]
        with torch.no_grad(), run[0].comm.about(" + ".join(f.label for f in run)):
            pending = run[0].comm.gather_together([f.full for f in run], shards, async_op=True)
        for f in run:
            f.mark_gathering(pending)
        shared.append(pending)
        if most_in_flight is not None and len(shared) > most_in_flight:
            with torch.no_grad():
                complete(shared.pop(0))  # its buffers stay GATHERING; their gather() finds it landed


def prefetch_flats(flats: list[FlatParam]) -> None:
    """Issue the all-gathers of the sharded buffers among `flats` (stage 3's prefetch)."""
    gather_flats([f for f in flats if f.state is ParamState.SHARDED])


def write_back_together(flats: list[FlatParam]) -> None:
    """FlatParam.write_back() for every buffer, their all-gathers issued together where small.
    finish_write_back() (or, with gather_behind_forward, the next forward) completes them."""
    due = [f for f in flats if f.refresh_from_master()]
    gather_flats(due, most_in_flight=2)  # (a model of many small buffers: two buckets, not a copy of it)
