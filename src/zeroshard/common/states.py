"""Guarded state transitions, as FSDP2 guards its training and sharding states.

Every object whose state changes during a step (a flat buffer's gathered storage and its gradient,
a unit's progress through backward, the reduction schedule, the engine's step) keeps that state in
an Enum defined beside it, and changes it only through `move`, which checks the change against the
owner's table of allowed transitions. A wrong transition is a bug in zeroshard, never silent: it
raises StateError naming both states.
"""
from __future__ import annotations

from contextlib import contextmanager
from enum import Enum
from typing import Any, Collection, Iterator, Mapping, TypeVar

S = TypeVar("S", bound=Enum)


class StateError(RuntimeError):
    """zeroshard moved an object between two states its table does not connect (an internal bug)."""


def move(current: S, new: S, allowed: Mapping[S, Collection[S]], owner: str) -> S:
    """Return `new` if `current -> new` is in `allowed`, else raise StateError naming both."""
    if new is not current and new not in allowed.get(current, ()):
        legal = sorted(s.name for s in allowed.get(current, ())) or "nothing"
        raise StateError(f"internal error in zeroshard: {owner} cannot go from {current.name} to "
                         f"{new.name} (allowed from {current.name}: {legal}); please report it")
    return new


@contextmanager
def temporarily(owner: object, attribute: str, value: Any) -> Iterator[None]:
    """A mode for the length of a block (no_sync, one-off traffic): owner.attribute is `value`
    inside, and what it was before after, even on error; blocks nest."""
    previous = getattr(owner, attribute)
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        setattr(owner, attribute, previous)
