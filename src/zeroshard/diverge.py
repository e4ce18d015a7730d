"""Divergence diagnosis: when ranks stop issuing the same collectives, say where, instead of hanging.

Every collective the engine issues leaves a fingerprint (kind, unit, bucket, size, dtype, step,
micro-step, phase) in a short per-rank history, with a running count and digest. Two ways in:

* `check()`, at the start of every backward and step (every K steps with check_collectives: K):
  each rank compares (count, digest, clock) with rank 0's **through the c10d store**, never through
  a collective. A collective could pair with a peer's different collective, and gloo aborts a
  process whose peer sends more bytes than it expects; the store cannot mismatch.
* a wait that stalls. Waits are bounded, in 1 s slices. After each slice a stalled rank publishes
  how far it got (count, digest) and compares with the peers' published marks: a peer whose digest
  differs after the same number of calls has issued a different call, so the ranks diverged (found
  within seconds, not after the timeout: a stage-3 rank that skips a unit stalls in forward, before
  any check). A stall that finds no such proof ends at `collective_timeout`, and a peer's alarm
  ends it within a slice. A mark is always a prefix of its rank's history, so a stale one is safe.

Either way the rank publishes its recent history to the store, waits a grace period for its peers'
and raises `DivergenceError` naming the first call where the histories differ and the likely cause.
The store is used because a timed-out group is unusable. On CUDA a bounded wait would block the host
on every collective, so there NCCL's own group timeout is the watchdog (zeroshard's checks still run).
"""
from __future__ import annotations

import logging
import os
import pickle
import time
import zlib
from collections import deque
from dataclasses import astuple, dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from .devices import abandon_group

logger = logging.getLogger("zeroshard")

_SLICE_S = 1.0        # a bounded wait looks for a peer's alarm this often
_GRACE_S = 30.0       # how long a diagnosing rank waits for its peers' histories (at most)
_KEEP = 512           # fingerprints kept per rank: enough to reach back past one step of a big model
_instances = 0        # engines created in this process, in the same order on every rank


class DivergenceError(RuntimeError):
    """Ranks issued different collectives (or one stalled): the message names the first difference."""


@dataclass(frozen=True)
class Fingerprint:
    """One collective as this rank issued it; `seq` numbers the engine's collectives from 0."""

    seq: int
    kind: str
    label: str
    bucket: int
    numel: int
    dtype: str
    step: int
    micro: int
    phase: str
    backwards: int

    def same_call(self, other: "Fingerprint | None") -> bool:
        return other is not None and astuple(self)[1:] == astuple(other)[1:]

    def describe(self) -> str:
        what = f"{self.label}, bucket {self.bucket}" if self.label else "engine"
        return (f"{self.kind}({what}, {self.numel} x {self.dtype}) in {self.phase} of step {self.step}, "
                f"micro-step {self.micro}")


@dataclass
class Clock:
    """Where the engine is, as its API calls say (the same on every rank unless they diverge)."""

    step: int = 0
    micro: int = 0
    phase: str = "set-up"
    backwards: int = 0


class Watch:
    """One engine's collective history, its checks and its diagnosis."""

    def __init__(self, rank: int, world_size: int, timeout: float, every: int, on_cuda: bool,
                 space: str = "") -> None:
        """space: keeps apart the store keys of groups that share one store (each tp rank's dp group)."""
        global _instances
        _instances += 1
        self.rank, self.world_size, self.timeout, self.every = rank, world_size, timeout, every
        self.bounded = not on_cuda
        self.clock = Clock()
        self.recent: deque[Fingerprint] = deque(maxlen=_KEEP)
        self.count, self.digest, self.checks = 0, 0, 0
        self.store_traffic = {"calls": 0, "bytes": 0}  # the checks' and stall marks' store writes and reads
        self.digests: deque[int] = deque([0], maxlen=_KEEP)  # after count - len + 1, ..., count calls
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"zeroshard/{restart}/{_instances}/{space}"
        self.store = _default_store()

    def record(self, kind: str, label: str, bucket: int, numel: int, dtype: Any) -> None:
        c = self.clock
        call = (kind, label, bucket, numel, str(dtype).replace("torch.", ""), c.step, c.micro, c.phase,
                c.backwards)
        self.recent.append(Fingerprint(self.count, *call))
        self.count += 1
        self.digest = zlib.crc32(repr(call).encode(), self.digest)  # (astuple(): 10x slower, same text)
        self.digests.append(self.digest)

    # ---- bounded waits --------------------------------------------------------------------------
    def wait(self, work: dist.Work) -> None:
        """work.wait(), but a stall past the timeout (or a peer's alarm) becomes a DivergenceError."""
        if not self.bounded or work.is_completed():
            work.wait()  # (already done: this only surfaces an error)
            return
        # (gloo's own reduce-scatter ignores the timeout; comm.py does reduce-scatters on gloo as an
        # all-to-all, which honours it.)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                work.wait(timeout=timedelta(seconds=min(_SLICE_S, self.timeout)))
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

    def _differing_peer(self) -> int | None:
        """Publish this stalled rank's mark (count, digest); the first peer whose published mark
        differs from this rank's digest after as many calls, if any. (A peer that has made more calls
        is compared from its side, once it stalls too.)"""
        if self.store is None or self.world_size == 1:
            return None
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
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
            theirs = self.store.get(key)
        except RuntimeError:
            raise self.diagnose(f"rank 0 did not reach {phase} within {self.timeout:g} s") from None
        self._count_store(theirs)
        if theirs != token:
            raise self.diagnose(f"this rank's collectives differ from rank 0's at the start of {phase}")

    def _count_store(self, payload: bytes) -> None:
        self.store_traffic["calls"] += 1
        self.store_traffic["bytes"] += len(payload)

    # ---- the diagnosis --------------------------------------------------------------------------
    def _alarm_raised(self) -> bool:
        return self.store is not None and self.store.check([f"{self.prefix}alarm"])

    def diagnose(self, reason: str) -> DivergenceError:
        """Publish this rank's history, collect the peers' (as many as answer), name the difference."""
        abandon_group()  # a collective may be left in flight: the exit hook must not wait on it
        if self.store is None:
            return DivergenceError(f"rank {self.rank}: {reason}; no c10d store to compare ranks with")
        self.store.set(f"{self.prefix}alarm", str(self.rank))
        self.store.set(f"{self.prefix}history/{self.rank}", pickle.dumps((list(self.recent), self.clock)))
        histories = {self.rank: (list(self.recent), self.clock)}
        deadline = time.monotonic() + min(_GRACE_S, self.timeout) + 5 * _SLICE_S
        while len(histories) < self.world_size and time.monotonic() < deadline:
            for r in range(self.world_size):
                key = f"{self.prefix}history/{r}"
                if r not in histories and self.store.check([key]):
                    histories[r] = pickle.loads(self.store.get(key))
            time.sleep(0.05)
        message = explain(histories, self.world_size)
        logger.error("rank %d: %s", self.rank, message)
        return DivergenceError(f"rank {self.rank}: {reason}.\n{message}")


def _default_store() -> "dist.Store | None":
    try:  # torch keeps the default group's store privately; without it only timeouts are diagnosed
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def explain(histories: dict[int, tuple[list[Fingerprint], Clock]], world_size: int) -> str:
    """The first collective call at which the ranks' histories differ, and the likely cause."""
    silent = sorted(set(range(world_size)) - set(histories))
    note = f" Ranks {silent} did not answer (exited, killed, or stuck outside zeroshard)." if silent else ""
    by_seq = {r: {fp.seq: fp for fp in recent} for r, (recent, _) in histories.items()}
    start = max((min(s) for s in by_seq.values() if s), default=0)
    end = max((max(s) + 1 for s in by_seq.values() if s), default=0)
    for seq in range(start, end):
        calls = {r: s.get(seq) for r, s in by_seq.items()}
        first = next(iter(calls.values()))
        if all(fp is not None and fp.same_call(first) for fp in calls.values()):
            continue
        lines = [f"  rank {r}: " + (fp.describe() if fp else f"nothing (its last call was #{seq - 1}; "
                                    f"now in {histories[r][1].phase} of step {histories[r][1].step})")
                 for r, fp in sorted(calls.items())]
        return (f"collectives diverged at call #{seq}:\n" + "\n".join(lines) + "\n" +
                likely_cause(calls, {r: c for r, (_, c) in histories.items()}) + note)
    clocks = {r: (c.phase, c.step, c.micro, c.backwards) for r, (_, c) in histories.items()}
    return f"the answering ranks issued the same collectives; their clocks: {clocks}.{note}"


def likely_cause(calls: dict[int, "Fingerprint | None"], clocks: dict[int, Clock]) -> str:
    """A guess from where each rank stood at the first difference (phase, API calls made so far)."""
    seen = {r: fp or clocks[r] for r, fp in calls.items()}
    tally = "; ".join(f"rank {r} in {c.phase}, after {c.backwards} backward() and {c.micro} step() calls"
                      for r, c in sorted(clocks.items()))
    phases = {r: s.phase for r, s in seen.items()}
    if len(set(phases.values())) > 1:
        where = ", ".join(f"rank {r} in {p}" for r, p in sorted(phases.items()))
        return (f"Likely cause: the ranks are in different calls ({where}): a step() on some ranks only, "
                f"a different number of backward() calls per step ({tally}), or a forward (an "
                f"evaluation, a generate()) run on some ranks only.")
    if len({s.backwards for s in seen.values()}) > 1 or len({s.micro for s in seen.values()}) > 1:
        return f"Likely cause: a different number of backward() or step() calls ({tally})."
    if len({fp.label for fp in calls.values() if fp is not None}) > 1:
        return ("Likely cause: a unit run on some ranks only (a data-dependent branch in forward that skips "
                "or repeats a block). At stage 3 every rank must run the same units; keep the branch "
                "identical on all ranks or move it outside the sharded units.")
    kinds = {fp.kind for fp in calls.values() if fp is not None}
    if "all_gather" in kinds and len(kinds) > 1 and all(s.phase == "backward" for s in seen.values()):
        return ("Likely cause: a unit whose output reaches the loss on some ranks only (an auxiliary head, "
                "a loss term added when the batch has its labels): at stage 3 a unit is gathered for "
                "backward where its output gets a gradient. Let it reach the loss on every rank, e.g. "
                "loss = loss + 0.0 * aux.sum() where the term is absent.")
    return "Likely cause: ranks built different models or configs (same call, different size or dtype)."
