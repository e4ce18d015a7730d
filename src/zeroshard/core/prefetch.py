"""The order units run in, prefetching along it (stage 3 with overlap_comm), and which units stay
gathered from forward into backward.

The forward records which units ran in which order; the next forward prefetches along that record,
and backward (which visits units in reverse) prefetches the unit that ran before the one it reached.
A unit backward will reach soon (stage3_max_reuse_distance) is not freed after its forward.
"""
from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable, Iterator, NamedTuple

from . import gather_together
from .gather_together import prefetch_flats
from .units import Unit, UnitProgress


Window = int | None  # elements prefetched ahead; None: exactly the next unit


class GatherLimits(NamedTuple):
    forward: Window    # forward's prefetch window
    backward: Window   # backward's
    reuse: int         # stage3_max_reuse_distance (DeepSpeed's count)
    keep_tail: bool    # the last two units stay gathered into backward (see keeps_for_backward)


def gathering_limits(prefetch_numel: Window, reuse_numel: int | None, prefetch: bool,
                     device_type: str) -> GatherLimits:
    """From stage3_prefetch_bucket_size and stage3_max_reuse_distance, or where unset, the backend's.

    On CUDA: the next unit prefetched and none kept for backward, as FSDP2 does: a gather there costs
    little beside its bytes, and memory is what binds. On gloo a collective costs a fixed amount of CPU
    beside its bytes (benchmarks/gloo_collectives.py), which overlap does not hide on busy cores, and a
    model of small units paid it once a unit, in forward and again in backward. There, with prefetch on,
    a constant-size window of TOGETHER_NUMEL elements (4 MiB of fp32): forward prefetches the units that
    run next while they fit it (gather_together sends them as one collective), and a unit whose later
    units fit it stays gathered into backward (a reuse distance of twice that: their forward and
    backward), so such a model is gathered once a step. Backward still prefetches one unit at a time:
    which unit backward reaches first can depend on the data (an output in the loss of some ranks only),
    and gathers of one unit keep such ranks' collectives alike in size, so the divergence check names
    the cause where wider ones made gloo abort on a size mismatch first. Memory still does not grow with
    the model; a model of larger units (a GPT-2 block has 7M elements) is gathered as on CUDA, but for
    the tail. Without prefetch (overlap_comm false, or a window of 0) nothing is kept: the paper's
    profile, the least memory."""
    gloo = device_type != "cuda"
    window = gather_together.TOGETHER_NUMEL  # read now: one knob for the run limit and the window
    if gloo and prefetch_numel is None:
        forward, backward = window, None
    else:
        forward = backward = prefetch_numel
    prefetching = prefetch and forward != 0
    if reuse_numel is None:
        reuse_numel = 2 * window if gloo and prefetching else 0
    return GatherLimits(forward, backward, reuse_numel, keep_tail=gloo and prefetching)


class UnitOrder:
    """The order units run in, and (with overlap_comm) prefetching along it.

    Forward prefetches the unit(s) that followed this one in the previous forward; backward
    prefetches those that preceded it in the current forward: the next one by default, or as many
    as fit in stage3_prefetch_bucket_size elements, as long as the gathered total stays within
    stage3_max_live_parameters (DeepSpeed's meanings). Every rank runs the same graph, so every
    rank issues the same all-gathers in the same order. A wrong guess (the graph changed) only costs
    memory: the unit stays gathered until it is used or the backward ends.
    """

    def __init__(self, prefetch: bool, on_gather: Callable[[], None] = lambda: None,
                 prefetch_numel: Window = None, max_live_numel: int = 10**9,
                 max_reuse_numel: int = 0, on_passed: Callable[[], None] = lambda: None,
                 keep_tail: bool = False, backward_numel: Window = None) -> None:
        self.enabled = prefetch
        self.keep_tail = keep_tail  # (gathering_limits: with prefetch, on gloo) see keeps_for_backward
        self.on_passed = on_passed  # the reducer: reduce what the units backward has passed hold
        self.prefetch_numel = prefetch_numel  # forward's window (gathering_limits)
        self.backward_numel = backward_numel  # backward's
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        self.on_gather = on_gather  # accounting: temporaries peak right after a gather
        self.previous: list[Unit] = []  # the last complete forward
        self.current: list[Unit] = []   # this forward, so far
        self._backward_at = 0           # where backward has reached in `current`
        # Read off `previous` once a forward, so each unit's decisions cost O(1), not O(units)
        # (benchmarks/unit_overhead.py: flat across depths). _last_at: a unit's last position;
        # _after[i], _units_after[i]: elements and number of the distinct units in previous[i:];
        # _next_at[i]: the next position of the unit at i (None after its last); _ran_before[i]:
        # elements run in previous[:i], each time a unit runs; _known_numel: of every unit seen.
        self._last_at: dict[Unit, int] = {}
        self._after: list[int] = [0]
        self._units_after: list[int] = [0]
        self._next_at: list[int | None] = []
        self._ran_before: list[int] = [0]
        self._known: set[Unit] = set()
        self._known_numel = 0

    def before_forward(self, unit: Unit) -> None:
        if unit.is_root:  # a new forward starts at the root
            self.previous, self.current = (self.current or self.previous), []
            self._read_previous()
        if unit not in self._known:
            self._known.add(unit)
            self._known_numel += unit.numel
        self.current.append(unit)
        unit.set_progress(UnitProgress.RAN_FORWARD)
        self._backward_at = len(self.current)
        if self.enabled:  # issue this unit's all-gather and the next ones', then wait for this one:
            # the next gathers overlap this wait. Those not yet in flight (the first unit's and the
            # next, after a step) go out as one collective: on gloo each has a fixed cost beside its bytes.
            upcoming = islice(self.previous, len(self.current), None)
            prefetch_together([unit] + self._to_prefetch(upcoming, self.prefetch_numel, unit))
        unit.unshard()
        self.on_gather()

    def keeps_for_backward(self, unit: Unit) -> bool:
        """Should `unit`, whose forward just ended, stay gathered until its next use: later in this
        forward where it runs again (a shared block), else when backward reaches it?

        Its reuse distance, as DeepSpeed's parameter cache counts it, is the elements gathered
        between this use and the next along the previous forward's record: the units run in between
        where it runs again in this forward, else the later units' forward, then their backward. It
        stays when that is at most stage3_max_reuse_distance (above 0) and everything then gathered
        at once fits stage3_max_live_parameters. With prefetch (overlap_comm), the last
        two units stay whatever the distance (`keep_tail`): backward needs the last first and prefetches
        the one before it at once, so freeing them would gather them straight back. That saves two
        gathers where a collective has a fixed cost (gloo), but the two are held through the loss
        and the head's backward, where activations peak: on CUDA, where a gather is cheap and memory
        is what binds, they are freed, as FSDP2 frees every block after its forward. A wrong guess
        (the graph changed) only costs memory: the unit stays gathered until its gradients are
        reduced or the backward ends."""
        i = len(self.current) - 1
        if i >= len(self.previous) or self.previous[i] is not unit:
            return False
        later_use = self._next_at[i]
        if later_use is not None:  # it runs again in this forward: kept until then if that use is
            between = self._ran_before[later_use] - self._ran_before[i + 1]  # near (the later use
            return self.max_reuse_numel > 0 and between <= self.max_reuse_numel and \
                self._fits(unit, i, between)  # decides about backward)
        ahead = self._after[i + 1]  # the later units' elements, each unit once
        if ahead == 0 and (self.keep_tail or self.max_reuse_numel == 0):
            return self.keep_tail  # (else the last unit is 0 from its backward: within the distance)
        prefetched_first = self._units_after[i + 1] == 1 and self.keep_tail
        if not prefetched_first and 2 * ahead > self.max_reuse_numel:
            return False
        return self._fits(unit, i, ahead)

    def _fits(self, unit: Unit, i: int, ahead: int) -> bool:
        """Would keeping `unit` (at position i) while `ahead` more elements are gathered stay within
        stage3_max_live_parameters?"""
        if self._known_numel <= self.max_live_numel:
            return True  # everything gathered at once would fit
        held = sum(u.numel for u in dict.fromkeys(self.current[:i]) if u.unsharded)
        return held + unit.numel + ahead <= self.max_live_numel

    def _read_previous(self) -> None:
        """_last_at, _after, _next_at and _ran_before for the forward just recorded (see __init__)."""
        n = len(self.previous)
        self._last_at = {u: i for i, u in enumerate(self.previous)}
        self._after, self._units_after, self._next_at = [0] * (n + 1), [0] * (n + 1), [None] * n
        seen_at: dict[Unit, int] = {}
        for i in range(n - 1, -1, -1):
            unit = self.previous[i]
            last = self._last_at[unit] == i  # a unit counts once: at its last position
            self._after[i] = self._after[i + 1] + (unit.numel if last else 0)
            self._units_after[i] = self._units_after[i + 1] + last
            self._next_at[i], seen_at[unit] = seen_at.get(unit), i
        self._ran_before = [0] * (n + 1)
        for i, unit in enumerate(self.previous):
            self._ran_before[i + 1] = self._ran_before[i] + unit.numel

    def before_backward(self, unit: Unit) -> None:
        """Backward reached `unit` (a hook on its outputs: alike on every rank). First the units
        that ran after it are passed, reduced and freed, then this unit's gather is issued, then its
        predecessor's (prefetch), then this one is waited for. The reductions come first, so every
        rank issues them at the same point among the gathers whatever gradients its data produced."""
        at = None if unit.is_root else self._advance_to(unit)  # the root's hook fires first
        if self.enabled:
            unit.start_unshard()
        if at is not None:
            prefetch_together(self._to_prefetch(self.current[at - 1::-1] if at > 0 else [],
                                                self.backward_numel))
        unit.unshard()
        self.on_gather()

    def _to_prefetch(self, upcoming: Iterable[Unit], window: Window,
                     running: Unit | None = None) -> list[Unit]:
        """The units to start gathering, of those that run next: the next one (a window of None),
        or as many as fit in the window's elements; never past stage3_max_live_parameters gathered
        (`running` counted as gathered). Reads `upcoming` only as far as the window reaches."""
        if not self.enabled:
            return []
        if window is None:
            upcoming = islice(upcoming, 1)
        live = 0  # counted only where the limit can bind: it walks every unit
        if self._known_numel > self.max_live_numel:
            live = sum(u.numel for u in dict.fromkeys(self.previous + self.current)
                       if u.unsharded or u is running)
        ahead, due = 0, []  # elements of the upcoming units gathered or in flight, counted in order
        for unit in _each_once(upcoming):
            if window is not None and ahead >= window:
                break  # as DeepSpeed: fetch while below the limit (the last unit may overshoot)
            ahead += unit.numel
            if not unit.unsharded and unit is not running:
                live += unit.numel
                if live > self.max_live_numel:
                    break
                due.append(unit)
        return due

    def _advance_to(self, unit: Unit) -> int | None:
        """Backward reached `unit`'s latest unvisited occurrence (returned: its position in the
        forward): the units that ran only after it are passed. Their gradients are in (autograd
        accumulates a block's weights before it moves on to the block that fed it), except those
        this rank's data never produced (an expert that got no tokens): so they are reduced now,
        with zeros there, and freed. Reducing them only when complete would put that reduce-scatter
        among the gathers at a place that depends on the data, and ranks would pair different
        collectives."""
        for i in range(self._backward_at - 1, -1, -1):
            if self.current[i] is unit:
                self._backward_at = i
                still_needed = set(map(id, self.current[:i + 1]))
                passed = [later for later in dict.fromkeys(self.current[i + 1:])
                          if id(later) not in still_needed and later.progress is not UnitProgress.PASSED]
                for later in passed:
                    later.set_progress(UnitProgress.PASSED)
                self.on_passed()
                for later in passed:
                    later.maybe_reshard()
                return i
        return None


def _each_once(units: Iterable[Unit]) -> Iterator[Unit]:
    seen: set[Unit] = set()
    for unit in units:
        if unit not in seen:
            seen.add(unit)
            yield unit


def prefetch_together(units: list[Unit]) -> None:
    """Issue the all-gathers of `units` (those not gathered or in flight), as one collective
    where their buffers are small (gather_together.py)."""
    prefetch_flats([f for u in units for f in u.flats])

