"""Divergence diagnosis: when ranks stop issuing the same collectives, say where, instead of hanging.

Every collective the engine issues leaves a fingerprint (kind, unit, bucket, size, dtype, step,
micro-step, phase) in a short per-rank history (diagnosis.py), with a running count and
digest. Three ways in:

* `check()`, at the start of every backward and step (every K steps with check_collectives: K):
  each rank compares (count, digest, clock) with rank 0's **through the c10d store**, never through
  a collective (a collective could pair with a peer's different collective, and gloo aborts a
  process whose peer sends more bytes than it expects; the store cannot mismatch). While it waits
  for rank 0's, it publishes its mark as a stalled rank does (below): rank 0 may be stalled in a
  collective this rank skipped.
* a wait that stalls. Waits are bounded, in 1 s slices. After each slice a stalled rank publishes
  how far it got (count, digest) and compares with the peers' published marks: a peer whose digest
  differs after the same number of calls has issued a different call, so the ranks diverged (found
  within seconds, not after the timeout: a stage-3 rank that skips a unit stalls in forward, before
  any check). A stall that finds no such proof ends at `collective_timeout`, and a peer's alarm
  ends it within a slice. A mark is always a prefix of its rank's history, so a stale one is safe.
* `gate()`, on entering an API call that is collective outside the training rhythm
  (full_state_dict(), gathered_parameters() at stage 3): the ranks meet in the store first, so one
  that entered alone is found stalled there, never paired with a peer's other collective.

A rank whose process exits says so in the store (atexit): a peer waiting for it at a gate is told at
once (`if rank == 0: engine.full_state_dict()` at a script's end), not at the timeout, and a diagnosis
does not wait for its history. (In a collective, gloo fails at once on the closed connection.)

Any way, the rank publishes its recent history to the store, waits a grace period for its peers'
and raises `DivergenceError` naming the first call where the histories differ and the likely cause.
The store is used because a timed-out group is unusable. On CUDA a bounded wait would block the host
on every collective, so there NCCL's own group timeout is the watchdog (zeroshard's checks still run).
"""
from __future__ import annotations

import logging
import os
import pickle
import time
import weakref
import zlib
from collections import deque
from dataclasses import astuple
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from .devices import abandon_group
from .diagnosis import Clock, Fingerprint, explain
from .peer_store import SLICE_S, default_store, exchange_histories, exited_peers, tell_peers_at_exit

logger = logging.getLogger("zeroshard")

_KEEP = 512           # fingerprints kept per rank: enough to reach back past one step of a big model
_WARN_S = 10.0        # a gate (once) or a collective (once a wait) waited this long: say what is likely
_instances = 0        # engines created in this process, in the same order on every rank


# What a gate's message adds for its call: how the call is shared out (a save's files on rank 0 alone)
_AFTER = {"full_state_dict()": ", then write files on rank 0 alone",
          "save_checkpoint()": " (each rank writes its own shards)",
          "generate()": " (or generate on rank 0 alone inside `with engine.gathered_parameters():`)"}


class DivergenceError(RuntimeError):
    """Ranks issued different collectives (or one stalled): the message names the first difference."""


class Watch:
    """One engine's collective history, its checks and its diagnosis."""

    # The watch of the latest engine over the whole world, lent to the script helpers
    # (over_ranks.py: zeroshard.mean_over_ranks, gather_objects): a helper some ranks call while the
    # others wait in the engine's collectives (a save on rank 0 only, then a logged mean) is then
    # named within seconds, as the engine's own calls are, not after the timeout. Held weakly.
    _lent: "weakref.ref[Watch] | None" = None

    def __init__(self, rank: int, world_size: int, timeout: float, every: int, on_cuda: bool,
                 space: str = "") -> None:
        """space: keeps apart the store keys of groups that share one store (each tp rank's dp group)."""
        global _instances
        _instances += 1
        self.rank, self.world_size, self.timeout, self.every = rank, world_size, timeout, every
        self.bounded = not on_cuda
        self.clock = Clock()
        self.recent: deque[Fingerprint] = deque(maxlen=_KEEP)
        self.count, self.digest, self.checks, self.gates = 0, 0, 0, 0
        self.gate_warned = False
        self.store_traffic = {"calls": 0, "bytes": 0}  # the checks' and stall marks' store writes and reads
        self.digests: deque[int] = deque([0], maxlen=_KEEP)  # after count - len + 1, ..., count calls
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"zeroshard/{restart}/{_instances}/{space}"
        self.store = default_store()
        tell_peers_at_exit(self)

    def lend(self) -> None:
        """Lend this watch to the script helpers (see `_lent`): an engine over the whole world does."""
        Watch._lent = weakref.ref(self)

    @staticmethod
    def lent(world_size: int) -> "Watch | None":
        """The lent watch, if its engine is alive and spans `world_size` ranks."""
        watch = Watch._lent() if Watch._lent is not None else None
        return watch if watch is not None and watch.world_size == world_size else None

    def record(self, kind: str, label: str, bucket: int, numel: int, dtype: Any) -> None:
        c = self.clock
        call = (kind, label, bucket, numel, str(dtype).replace("torch.", ""), c.step, c.micro, c.phase,
                c.backwards)
        self.recent.append(Fingerprint(self.count, *call))
        self.count += 1
        self.digest = zlib.crc32(repr(call).encode(), self.digest)  # (repr: astuple() is slower)
        self.digests.append(self.digest)

    # ---- bounded waits --------------------------------------------------------------------------
    def wait(self, work: dist.Work) -> None:
        """work.wait(), but a stall past the timeout (or a peer's alarm) becomes a DivergenceError."""
        if not self.bounded or work.is_completed():
            work.wait()  # (already done: this only surfaces an error)
            return
        # (gloo's own reduce-scatter ignores the timeout; collectives.py does reduce-scatters on gloo as an
        # all-to-all, which honours it.)
        deadline, warned = time.monotonic() + self.timeout, False
        while True:
            try:
                work.wait(timeout=timedelta(seconds=min(SLICE_S, self.timeout)))
                return
            except RuntimeError as e:
                if "timed out" not in str(e).lower():
                    raise self.diagnose(f"a collective failed ({e})") from None
            if self._alarm_raised():
                raise self.diagnose("a peer found a divergence while this rank waited in a collective") \
                    from None
            if time.monotonic() >= deadline:
                raise self.diagnose(f"a collective waited {self.timeout:g} s (zeroshard.collective_"
                                    f"timeout)") from None
            if (peer := self._differing_peer()) is not None:
                raise self.diagnose(f"stalled in a collective, and rank {peer}'s calls differ from this "
                                    f"rank's") from None
            if deadline - time.monotonic() <= self.timeout - _WARN_S and not warned:
                warned = True  # (once a wait) no peer's zeroshard call differs: a peer is slow, or elsewhere
                last = self.recent[-1] if self.recent else None
                logger.warning("rank %d has waited %.0f s in %s: a peer is slow (loading, evaluating or "
                               "compiling alone), or in a call the others are not in (a torch.distributed "
                               "one such as dist.barrier() while this rank runs a forward alone); the "
                               "latter ends at zeroshard.collective_timeout (%g s)", self.rank, _WARN_S,
                               f"{last.kind}({last.label}) in {last.phase}" if last else "a collective",
                               self.timeout)

    def _differing_peer(self) -> int | None:
        """Publish this stalled rank's mark (count, digest); the first peer whose published mark
        differs from this rank's digest after as many calls, if any. (A peer that has made more calls
        is compared from its side, once it stalls too.)"""
        if self.store is None or self.world_size == 1:
            return None
        try:
            return self._first_differing_mark()
        except dist.DistError:  # the store is gone: the next slice's _alarm_raised() says so
            return None

    def _went_past(self, peer: int, key: str) -> bool:
        """Has `peer` published a stalled mark of more calls than this rank has made, while its key
        for the point this rank waits at is still unset? It sets that key before its next call, so
        it went past that point without it: a rank that skipped a step waits at a check while its
        peer stalls in the step (same prefix, no differing digest to prove it). The mark is read
        before the key, so a key set meanwhile is seen."""
        try:
            mark = f"{self.prefix}stall/{peer}"
            if not self.store.check([mark]):
                return False
            theirs = self.store.get(mark)
            self._count_store(theirs)
            count, _ = pickle.loads(theirs)
            return count > self.count and not self.store.check([key])
        except dist.DistError:
            return False

    def _first_differing_mark(self) -> int | None:
        mark = pickle.dumps((self.count, self.digest))
        self.store.set(f"{self.prefix}stall/{self.rank}", mark)
        self._count_store(mark)
        for peer in range(self.world_size):
            key = f"{self.prefix}stall/{peer}"
            if peer == self.rank or not self.store.check([key]):
                continue
            theirs = self.store.get(key)
            self._count_store(theirs)
            count, digest = pickle.loads(theirs)
            index = count - self.count + len(self.digests) - 1
            if 0 <= index < len(self.digests) and self.digests[index] != digest:
                return peer
        return None

    def guard(self, call: Callable[[], Any]) -> Any:
        """Issue a collective; an error from the backend becomes a diagnosis."""
        try:
            return call()
        except RuntimeError as e:
            raise self.diagnose(f"a collective failed ({e})") from None

    # ---- the check ------------------------------------------------------------------------------
    def check(self, phase: str) -> None:
        """At the start of backward and step: does this rank's history match rank 0's?"""
        self.clock.phase = phase
        if not self.every or self.store is None or self.world_size == 1 or self.clock.step % self.every:
            return
        self.checks += 1
        token = pickle.dumps((self.count, self.digest, astuple(self.clock)))
        key = f"{self.prefix}check/{self.checks}"
        if self.rank == 0:
            self.store.set(key, token)
            self._count_store(token)
            if self.checks > 16:  # every rank has read it: they have passed 16 checks since
                self.store.delete_key(f"{self.prefix}check/{self.checks - 16}")
            return
        # Polled in slices, as a stalled collective is: rank 0 may be stalled in a collective this
        # rank skipped (a unit run on rank 0 only), and its published mark proves the divergence.
        start = time.monotonic()
        while not self._all_set([key]):
            if self._alarm_raised():
                raise self.diagnose(f"a peer found a divergence while this rank waited for rank 0 at {phase}")
            if (peer := self._differing_peer()) is not None:
                raise self.diagnose(f"rank {peer} is stalled in a collective, and its calls differ from "
                                    f"this rank's") from None
            if self._went_past(0, key):
                raise self.diagnose(f"rank 0 is stalled in a collective this rank has not issued: it went "
                                    f"past {phase} without it") from None
            if time.monotonic() - start >= self.timeout:
                raise self.diagnose(f"rank 0 did not reach {phase} within {self.timeout:g} s")
        theirs = self.store.get(key)
        self._count_store(theirs)
        if theirs != token:
            raise self.diagnose(f"this rank's collectives differ from rank 0's at the start of {phase}")

    # ---- the gate ------------------------------------------------------------------------------
    def gate(self, call: str) -> None:
        """Before an API call that issues collectives outside the training rhythm (full_state_dict(),
        gathered_parameters() at stage 3): every rank must enter it. A rank that entered alone would
        pair its gathers with a peer's next collective, which gloo answers with an abort; so the ranks
        first meet here, through the store. A peer that stalls in another collective meanwhile has
        diverged (the gate is a call in the histories, so the diagnosis names it)."""
        self.clock.phase = call
        self.record("gate", call, 0, 0, "")
        if self.store is None or self.world_size == 1:
            return
        self.gates += 1
        token = pickle.dumps((self.count, self.digest))
        keys = [f"{self.prefix}gate/{self.gates}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], token)
        self._count_store(token)
        start = time.monotonic()
        while not self._all_set(keys):
            if self._alarm_raised():
                raise self.diagnose(f"a peer found a divergence while this rank waited to enter {call}")
            if (peer := self._differing_peer()) is not None:
                raise self.diagnose(f"{call} is collective, and rank {peer} is in another collective")
            absent = self._unset(keys)
            if (gone := exited_peers(self, absent)) and self._unset(keys):
                raise self.diagnose(f"{call} is collective, and rank(s) {gone} exited without calling it: "
                                    f"call it on every rank{_AFTER.get(call, '')}")
            waited = time.monotonic() - start
            if waited >= self.timeout:
                raise self.diagnose(f"{call} is collective, and not every rank entered it within "
                                    f"{self.timeout:g} s (zeroshard.collective_timeout)")
            if waited >= _WARN_S and not self.gate_warned:
                self.gate_warned = True
                logger.warning("rank %d has waited %.0f s in %s for rank(s) %s: it is collective, so "
                               "every rank must call it, not only rank 0%s; if they do not, this ends at "
                               "zeroshard.collective_timeout (%g s)", self.rank, waited, call, absent,
                               _AFTER.get(call, ""), self.timeout)
        if self.gates > 1:  # every rank has passed the previous gate: each has set this one's key
            self.store.delete_key(f"{self.prefix}gate/{self.gates - 1}/{self.rank}")
        if self.store.get(keys[0]) != token:
            raise self.diagnose(f"this rank's collectives differ from rank 0's at the start of {call}")

    def _all_set(self, keys: list[str]) -> bool:
        """Are all `keys` set within one slice? Polled (a timed-out store.wait() logs two c10d
        warnings); a store gone is "no" (the next _alarm_raised() says so)."""
        end, pause = time.monotonic() + min(SLICE_S, self.timeout), 0.001
        try:
            while not self.store.check(keys):
                if time.monotonic() >= end:
                    return False
                time.sleep(pause)  # (short at first: a check's key is usually a moment away)
                pause = min(2 * pause, 0.1)
        except dist.DistError:
            return False
        return True

    def _unset(self, keys: list[str]) -> list[int]:
        """The ranks whose key (one per rank) is not set; none if the store is gone."""
        try:
            return [r for r, key in enumerate(keys) if not self.store.check([key])]
        except dist.DistError:
            return []

    def _count_store(self, payload: bytes) -> None:
        self.store_traffic["calls"] += 1
        self.store_traffic["bytes"] += len(payload)

    # ---- the diagnosis --------------------------------------------------------------------------
    def _alarm_raised(self) -> bool:
        """A peer's alarm is up (or the store is gone: its host, global rank 0, has exited)."""
        try:
            return self.store is not None and self.store.check([f"{self.prefix}alarm"])
        except dist.DistError:
            return True

    def diagnose(self, reason: str) -> DivergenceError:
        """Publish this rank's history, collect the peers' (as many as answer), name the difference."""
        abandon_group()  # a collective may be left in flight: the exit hook must not wait on it
        if self.store is None:
            return DivergenceError(f"rank {self.rank}: {reason}; no c10d store to compare ranks with")
        histories = {self.rank: (list(self.recent), self.clock)}
        try:
            exchange_histories(self, histories)
        except dist.DistError as e:  # the store's host (global rank 0) exited: report what we have
            reason += f" (the c10d store went away: {type(e).__name__})"
        message = explain(histories, self.world_size)
        logger.error("rank %d: %s", self.rank, message)
        return DivergenceError(f"rank {self.rank}: {reason}.\n{message}")
