"""The directories disk offload writes into, and the checks that come before anything is written.

Invariants:
- Files live in `<nvme_path>/zeroshard-<run id>/rank<r>/` (`rank<r>.<k>` for a process's k-th
  further engine) and nowhere else. The run id is the elastic
  launcher's (TORCHELASTIC_RUN_ID, as torchrun and `zeroshard train` set it) or one drawn by rank 0;
  it is the same on every rank.
- Before the first file: every nvme_path exists, is a writable directory, and has room for every
  byte the ranks of this host will write there (`free_space` is the probe: tests replace it through
  set_free_space_probe, so no full disk is needed). All ranks pass, or all raise the same ConfigError.
- A directory already there for this run is what a killed attempt left: an elastic restart
  (TORCHELASTIC_RESTART_COUNT > 0) reclaims it, anything else is refused by name. Directories of
  other runs whose owner process is gone are reported (a warning with their size), never touched.
- remove() deletes this rank's directory (and the run's, once empty): the store calls it at close().
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import uuid
from typing import Any, Callable

from ...comm.collectives import Comm
from ...config import ConfigError

logger = logging.getLogger("zeroshard")
PREFIX = "zeroshard-"
OWNER = "owner.json"


def _disk_free(path: str) -> int:
    return shutil.disk_usage(path).free


free_space: Callable[[str], int] = _disk_free


def set_free_space_probe(probe: Callable[[str], int] | None) -> None:
    """Replace the free-space probe (path -> free bytes); None restores the real one."""
    global free_space
    free_space = probe or _disk_free


def run_id(comm: Comm) -> str:
    """The launcher's run id, or rank 0's fresh one: the same string on every rank."""
    given = os.environ.get("TORCHELASTIC_RUN_ID", "")
    local = given if given and given != "none" else uuid.uuid4().hex[:16]
    chosen = comm.all_gather_objects(local)[0]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in chosen)
    return safe if safe.startswith(PREFIX) else PREFIX + safe


def _alive(owner: dict[str, Any]) -> bool:
    if owner.get("host") != socket.gethostname():
        return True  # another machine's: not ours to judge
    try:
        os.kill(int(owner.get("pid", -1)), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def _owners(run_dir: str) -> list[dict[str, Any]]:
    found = []
    for name in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        try:
            with open(os.path.join(run_dir, name, OWNER)) as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            found.append({})  # no owner file: killed before it was written
    return found


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _writable(path: str) -> bool:
    """Can this process create directories there? (Tried: access() says yes to root everywhere.)"""
    if not os.access(path, os.W_OK | os.X_OK):
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".zeroshard-probe-", dir=path))
    except OSError:
        return False
    return True


_opened: dict[str, int] = {}  # run directory -> engines of this process that opened one there


def _rank_dir(path: str, run: str, rank: int) -> str:
    """This rank's directory for the next engine of this process: rank<r>, then rank<r>.1, ... (the
    same names in the same order after an elastic restart, which reclaims them)."""
    k = _opened.get(os.path.join(path, run), 0)
    return os.path.join(path, run, f"rank{rank}" + (f".{k}" if k else ""))


def _problem(path: str, run: str, rank: int, needed: int, restart: bool) -> str | None:
    """Why this rank cannot write `needed` bytes under path/run, or None."""
    if not os.path.isdir(path):
        return f"nvme_path '{path}' does not exist or is not a directory; create it or point nvme_path " \
               f"at a directory on the disk to use"
    if not _writable(path):
        return f"nvme_path '{path}' is not writable by this process; fix its permissions or choose another"
    mine = _rank_dir(path, run, rank)
    if os.path.exists(mine) and not restart:
        alive = [o for o in _owners(os.path.join(path, run)) if o and _alive(o)]
        why = "in use by a live process" if alive else "left by a killed run"
        return f"'{mine}' already exists ({why}); this run will not reuse it: remove it, or give another " \
               f"nvme_path (an elastic restart of the same run reclaims its own directory)"
    free = free_space(path)
    if free < needed:
        return f"nvme_path '{path}' has {free / 2**30:.2f} GiB free, but disk offload will write " \
               f"{needed / 2**30:.2f} GiB there (all ranks of this host); free space or use another disk"
    return None


def report_leftovers(path: str, run: str) -> None:
    """A warning for each other run's directory whose owner process is gone."""
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name == run or not name.startswith(PREFIX) or not os.path.isdir(full):
            continue
        owners = _owners(full)
        if all(not o or not _alive(o) for o in owners):
            logger.warning("disk offload: '%s' (%.1f MiB) was left by a killed run; zeroshard does not "
                           "reuse it: remove it to free the space", full, _size(full) / 2**20)


def prepare(needs: dict[str, int], comm: Comm) -> dict[str, str]:
    """nvme_path -> this rank's new, empty directory there, for `needs` (nvme_path -> bytes this rank
    writes). Collective; every check comes before the first write, and all ranks agree."""
    run, restart = run_id(comm), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    host = socket.gethostname()
    everyone = comm.all_gather_objects((host, {os.path.realpath(p): n for p, n in needs.items()}))
    problems = []
    for path in needs:
        real = os.path.realpath(path)
        total = sum(n.get(real, 0) for h, n in everyone if h == host)  # the ranks sharing this disk
        problems.append(_problem(path, run, comm.rank, total, restart))
    found = [p for p in comm.all_gather_objects(next((p for p in problems if p), None)) if p]
    if found:
        raise ConfigError(f"disk offload: {found[0]}")
    dirs = {}
    for path in needs:
        mine = _rank_dir(path, run, comm.rank)
        _opened[os.path.join(path, run)] = _opened.get(os.path.join(path, run), 0) + 1
        if os.path.exists(mine):  # an elastic restart of this run: its files are reclaimed
            logger.warning("disk offload: reclaiming '%s' from the previous attempt of this run", mine)
            shutil.rmtree(mine)
        os.makedirs(mine)
        with open(os.path.join(mine, OWNER), "w") as f:
            json.dump({"host": host, "pid": os.getpid(), "rank": comm.rank}, f)
        if comm.rank == 0:
            report_leftovers(path, run)
        dirs[path] = mine
    return dirs


def remove(directory: str) -> None:
    """Delete this rank's directory, and the run's directory once no rank's is left in it."""
    shutil.rmtree(directory, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(directory))
    except OSError:
        pass  # another rank's directory is still there (it removes the parent last)
