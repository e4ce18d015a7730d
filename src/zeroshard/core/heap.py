"""Giving the heap's free pages back to the OS after a step that raised the peak (training on a CPU).

glibc's malloc keeps what a process frees for reuse. A CPU step's tensors (gathered units, gradients,
activations, the optimizer's temporaries) come and go in a slightly different order each step, so
some of the holes they leave are not reused: kept, they stack up, and the resident peak creeps up
over the first tens of steps to well above what is live (benchmarks/README.md, host_memory.py).
torch's CPU allocator has no cache to empty, so the engine asks malloc itself: malloc_trim(0)
returns every whole free page of every arena.

A release is not free: the next step faults in again the pages it reuses. So the engine releases
only after a step that raised the process's peak (VmHWM): while the peak creeps, each rise is
followed by a release; once it has settled (a step reusing what the last one freed), nothing is
paid. On a GPU the step's tensors live in the caching allocator's pool and the host holds mostly
lasting (pinned) buffers, so this runs only on a CPU device unless asked
(zeroshard.release_host_memory). Without glibc's malloc_trim, or /proc, it does nothing.
"""
from __future__ import annotations

import ctypes
import functools
import sys
from typing import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc's; musl and others have none
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def can_release() -> bool:
    """Does this process's C library give free heap pages back on request?"""
    return _malloc_trim() is not None


def release_free_host_memory() -> None:
    """Return every whole free page of malloc's heaps to the OS (a no-op without glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def status_bytes(field: str) -> int | None:
    """A figure of /proc/self/status (VmRSS: resident now; VmHWM: the peak), in bytes; None
    where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class HeapReleaser:
    """Releases the heap's free pages after a step that raised the process's peak resident size.

    Invariant: the peak grows only in a step that is followed by a release, so holes left by
    earlier steps never stack up into a new peak unreleased. A release is not free (the next step
    faults in again the pages it reuses), so a run whose peak has settled, where the next step
    reuses what the last one freed, does not pay for one."""

    def __init__(self) -> None:
        self._peak: int | None = None

    def after_step(self) -> bool:
        """Called after each optimizer step; True when it released."""
        peak = status_bytes("VmHWM")
        grew = peak is not None and (self._peak is None or peak > self._peak)
        self._peak = peak
        if grew:
            release_free_host_memory()
        return grew
