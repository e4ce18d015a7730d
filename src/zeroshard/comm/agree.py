"""Ranks agreeing on an error: a check some ranks fail and others pass must end alike on every
rank, or the ones that passed go on into a collective the others never join."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .collectives import Comm


def first_error(comm: "Comm | None", error: str | None) -> str | None:
    """Collective with a Comm: the first rank's error, if any rank has one, on every rank."""
    errors = comm.all_gather_objects(error) if comm is not None else [error]
    return next((e for e in errors if e), None)
