"""The optimizer step over states that rest on disk: sub-group by sub-group through a few host buffers.

While sub-group k is stepped, k+1 is read into the next free buffer and k-1 is written back from its
own (ZeRO-Infinity's pipeline), on an I/O thread pool. During its step, a sub-group's fp32 master and
elementwise optimizer states (exp_avg, exp_avg_sq, momentum_buffer, ...) are views of its buffer:
`flat.master`, `opt_param.data` and `optimizer.state[opt_param][key]` point there, so the optimizer
sees ordinary tensors and any elementwise torch optimizer works. After it, they point at their files
again (store.py), while the buffer's write is still in flight.

Invariants:
- A buffer is reused only after its write has completed; every write has completed when the step
  ends (or fails), so the files are current whenever code outside the step reads them.
- A failed sub-group's buffer is not written back: its files keep the values from before the step.
- Optimizer state that is not in a file yet (created by the first step) is written to its own
  file when its sub-group is next stepped, and then rests there. (A checkpoint load creates the
  state in its files directly: checkpoint/load.py.)
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator

import torch

_ALIGN = 64  # bytes: each tensor's view starts at a multiple of this in its buffer

Entry = tuple[Any, str, torch.Tensor]  # (flat, "master" or a state key, the file tensor)


def _end(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class SubGroupStream:
    """The buffers and I/O threads of one rank's optimizer step; see the module notes."""

    def __init__(self, store: Any, buffer_count: int, host_empty: Any, threads: int = 1) -> None:
        self.store, self.count, self.host_empty = store, max(1, buffer_count), host_empty
        self.pool = ThreadPoolExecutor(max_workers=2 * max(1, threads), thread_name_prefix="zeroshard-io")
        self.buffers: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)

    # ---- what a sub-group moves ----------------------------------------------------------------
    def _entries(self, group: list, optimizer: torch.optim.Optimizer) -> list[Entry]:
        """The file tensors of a sub-group; state not in a file yet is put in one first."""
        entries: list[Entry] = []
        for f in group:
            if not self.store.owns(f.master):
                continue  # (not offloaded to disk: stepped in memory as usual)
            entries.append((f, "master", f.master))
            state = optimizer.state.get(f.opt_param, {})
            for key, value in list(state.items()):
                if _elementwise(value, f.master):
                    state[key] = self._in_file(f.master, key, value)
                    entries.append((f, key, state[key]))
        return entries

    def _in_file(self, master: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        """`value` (state `key` of the shard whose master file is `master`), resting in its file."""
        if self.store.owns(value):
            return value
        home = self.store.state_tensor(master, key, value.dtype)
        self.store.write(home, value)
        return home

    def _ensure_buffers(self, size: int) -> None:
        if self.buffers and self.buffers[0].numel() >= size:
            return
        self.buffers = []  # the old ones go before the new ones come
        self.buffers = [self.host_empty(size, torch.uint8) for _ in range(self.count)]

    @staticmethod
    def _views(entries: list[Entry], buffer: torch.Tensor) -> list[torch.Tensor]:
        views, at = [], 0
        for _, _, t in entries:
            nbytes = t.numel() * t.element_size()
            views.append(buffer[at:at + nbytes].view(t.dtype))
            at += _end(nbytes)
        return views

    def _read(self, entries: list[Entry], buffer: torch.Tensor) -> list[torch.Tensor]:
        views = self._views(entries, buffer)
        for (_, _, t), view in zip(entries, views):
            self.store.read(t, view)
        return views

    def _write(self, entries: list[Entry], views: list[torch.Tensor]) -> None:
        for (_, _, t), view in zip(entries, views):
            self.store.write(t, view)

    @staticmethod
    def _point(entries: list[Entry], tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        for (f, key, _), t in zip(entries, tensors):
            if key == "master":
                f.master = t
                f.opt_param.data = t
            else:
                optimizer.state[f.opt_param][key] = t

    # ---- the step ------------------------------------------------------------------------------
    def run(self, groups: list[list], optimizer: torch.optim.Optimizer) -> Iterator[list]:
        """Yield each sub-group with its states in host buffers; see the module notes."""
        self.store.drop_pages()  # whatever a reader outside the step paged in since the last one
        plans = [self._entries(g, optimizer) for g in groups]
        self._ensure_buffers(max((sum(_end(t.numel() * t.element_size()) for *_, t in p) for p in plans),
                                 default=0))
        free = deque(self.buffers)
        writes: deque[tuple[Future, torch.Tensor]] = deque()
        reads: dict[int, tuple[Future, torch.Tensor]] = {}

        def start(k: int) -> None:
            if not free:
                future, buffer = writes.popleft()
                future.result()
                free.append(buffer)
            buffer = free.popleft()
            reads[k] = (self.pool.submit(self._read, plans[k], buffer), buffer)
        try:
            for k, group in enumerate(groups):
                if k not in reads:
                    start(k)
                if k + 1 < len(groups) and self.count > 1:
                    start(k + 1)  # read ahead while this one steps
                future, buffer = reads.pop(k)
                views = future.result()
                self._point(plans[k], views, optimizer)
                stepped = False
                try:
                    yield group
                    stepped = True
                finally:
                    if stepped:
                        views = self._adopt_new_state(plans[k], views, group, optimizer)
                        writes.append((self.pool.submit(self._write, plans[k], views), buffer))
                    else:
                        free.append(buffer)
                    self._point(plans[k], [t for *_, t in plans[k]], optimizer)
        finally:
            for future, _ in [*writes, *reads.values()]:
                future.result()
            self.store.end_step()

    def _adopt_new_state(self, entries: list[Entry], views: list[torch.Tensor], group: list,
                         optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """State the step just created (its first) goes to files now; the rest is written with
        the buffer."""
        known = {(id(f), key) for f, key, _ in entries}
        on_disk = {id(f): t for f, key, t in entries if key == "master"}
        for f in group:
            if id(f) not in on_disk:
                continue
            state = optimizer.state.get(f.opt_param, {})
            for key, value in list(state.items()):
                if (id(f), key) not in known and _elementwise(value, f.master):
                    state[key] = self._in_file(on_disk[id(f)], key, value)  # written now, once
        return views


def _elementwise(value: Any, master: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == master.shape


def stream_groups(groups: list[list], optimizer: torch.optim.Optimizer) -> Iterator[list]:
    """The optimizer step's sub-groups, through the disk stream where their states rest on disk."""
    store = next((getattr(f.copier, "disk", None) for g in groups for f in g
                  if getattr(f.copier, "disk", None) is not None), None)
    if store is None or store.stream is None:
        if store is not None:
            store.end_step()
        yield from groups
        return
    yield from store.stream.run(groups, optimizer)
