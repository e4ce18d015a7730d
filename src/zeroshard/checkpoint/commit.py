"""The atomic commit of a checkpoint save, and what a failed or interrupted one leaves behind.

Invariants:
- DCP writes into "<dir>/.<tag>.tmp". Only a complete save (every rank's files and the manifest
  written) is renamed to "<dir>/<tag>", and only then does "<dir>/latest" name it: a crash at any
  point leaves `latest` naming a complete checkpoint.
- Re-saving an existing tag moves the old one to "<tag>.old" first (a directory cannot be renamed
  onto another). A crash between the two renames leaves `latest` naming a tag that is gone; the
  checkpoint it named is "<tag>.old", which the load takes, saying so (recovered()).
- A save that fails (a full disk, a permission) raises one CheckpointError on every rank, after
  rank 0 removed its partial files: a full disk must not stay full, and the engine trains on.
- Leftovers of saves killed before their commit (".<tag>.tmp") go at the next save into the
  directory: each holds up to a checkpoint's worth of disk, and nothing ever reads it.
"""
from __future__ import annotations

import logging
import os
import re
import shutil

from .integrity import METADATA

logger = logging.getLogger("zeroshard")

LATEST = "latest"
_LEFTOVER = re.compile(r"^\..+\.tmp$")


class LatestNotUpdated(OSError):
    """The checkpoint is committed (complete, under its tag), but `latest` could not be moved to it."""


def commit(directory: str, tmp: str, final: str, tag: str) -> None:
    """Rank 0, once every rank's files and the manifest are in `tmp`: make it `tag`, then `latest`."""
    old = final + ".old"
    if os.path.exists(final):  # replace an existing tag without a moment where neither exists
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    pointer = os.path.join(directory, f".{LATEST}.tmp")
    try:
        with open(pointer, "w") as f:
            f.write(tag)
        os.replace(pointer, os.path.join(directory, LATEST))
    except OSError as e:  # (a disk that filled with the checkpoint's last file)
        if os.path.exists(pointer):
            os.remove(pointer)
        raise LatestNotUpdated(e.errno, e.strerror) from None


def sweep_leftovers(directory: str) -> None:
    """Rank 0, before a save: remove the temporary directories of saves that never committed."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if _LEFTOVER.match(name) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed '%s', the leftover of a save that never committed", path)


def recovered(path: str) -> str | None:
    """Where `path` (a tag) is gone but its predecessor was kept aside by a commit that was
    killed between its renames: that predecessor, a complete checkpoint."""
    old = path.rstrip(os.sep) + ".old"
    if os.path.exists(path) or not os.path.isfile(os.path.join(old, METADATA)):
        return None
    logger.warning("'%s' is missing: a save of that tag was killed while committing. Loading the "
                   "checkpoint it was replacing, '%s'", path, old)
    return old


def failure_of(error: BaseException) -> str:
    """One line for a failed write: DCP's CheckpointException names the ranks and their errors."""
    failures = getattr(error, "failures", None)
    if not failures:
        return str(error)
    return "; ".join(f"rank {rank}: {exc[0] if isinstance(exc, tuple) else exc}"
                     for rank, exc in sorted(failures.items()))
