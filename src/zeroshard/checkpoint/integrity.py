"""Checkpoint integrity: a checkpoint is read only if its files are exactly what was committed.

Invariants:
- Every checkpoint this version commits holds a manifest, `checksums.json`: the size and CRC-32 of
  each file DCP wrote (`.metadata` and every `*.distcp`). Each rank checksums the files it wrote;
  rank 0 writes the manifest into the temporary directory *before* the atomic rename, so no
  committed checkpoint lacks it.
- Nothing is read from a checkpoint, its metadata included, until every listed file has its
  recorded size and checksum and no DCP file is unlisted. Otherwise: a CheckpointError naming each
  damaged file and what is wrong and, when the checkpoint was reached through a parent's `latest`,
  the newest sibling that does verify, offered by path and never loaded in its place. A
  checkpoint without its manifest is refused like a damaged one: the manifest was lost (deleted,
  or left behind by a copy), and without it nothing tells an intact checkpoint from an altered one.
- The metadata is checked after the files (meta.py).
- A collective check (given a Comm) ends alike on every rank: each rank checks its share, the
  verdicts are all-gathered, and every rank raises the same error or none. No rank waits alone.
"""
from __future__ import annotations

import json
import os
import re
import zlib
from typing import TYPE_CHECKING, Any

from ..comm.agree import first_error

if TYPE_CHECKING:
    from ..comm.collectives import Comm

MANIFEST = "checksums.json"
METADATA = ".metadata"  # DCP's index of the stored items
_CHUNK = 4 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, damaged or from another model; nothing was modified."""


# ---- checksums --------------------------------------------------------------------------------------
def _is_dcp_file(name: str) -> bool:
    return name == METADATA or name.endswith(".distcp")


def checksum(path: str) -> dict[str, Any]:
    """Size and CRC-32 of a file, read in chunks (a shard can be larger than memory)."""
    crc, size, buffer = 0, 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc, size = zlib.crc32(view[:n], crc), size + n
    return {"size": size, "crc32": f"{crc:08x}"}


def _written_by(directory: str, rank: int, world_size: int) -> list[str]:
    """The DCP files `rank` checksums at save: those it wrote ("__<rank>_*"); rank 0 also the rest."""
    mine = []
    for name in sorted(os.listdir(directory)):
        writer = re.match(r"__(\d+)_", name)
        owner = int(writer.group(1)) if writer and int(writer.group(1)) < world_size else 0
        if _is_dcp_file(name) and owner == rank:
            mine.append(name)
    return mine


def commit_manifest(directory: str, comm: Comm) -> str | None:
    """Collective, after dcp.save into `directory` (not yet committed): every rank checksums the
    files it wrote and rank 0 writes the manifest. Returns what failed: any rank's checksum
    (known to every rank), or rank 0's write (rank 0's to pass on: save() agrees on it)."""
    try:
        local: Any = {n: checksum(os.path.join(directory, n))
                      for n in _written_by(directory, comm.rank, comm.world_size)}
    except OSError as e:
        local = f"rank {comm.rank} cannot checksum what it wrote: {e}"
    views = comm.all_gather_objects(local)
    failed = next((v for v in views if isinstance(v, str)), None)
    if comm.rank == 0 and failed is None:
        files = {name: entry for view in views for name, entry in view.items()}
        try:
            with open(os.path.join(directory, MANIFEST), "w") as f:
                json.dump({"format": 1, "algorithm": "crc32", "files": files}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())  # durable before the rename commits it, as DCP's own files are
        except OSError as e:
            failed = f"rank 0 cannot write {MANIFEST}: {e}"
    return failed


def agree(comm: Comm | None, error: str | None) -> None:
    """Collective with a Comm: raise on every rank the first rank's error, if any rank has one."""
    first = first_error(comm, error)
    if first:
        raise CheckpointError(first)


def read_manifest(directory: str) -> dict[str, dict[str, Any]] | None:
    """The manifest's files ({name: {size, crc32}}), None where there is no manifest."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        valid = manifest["algorithm"] == "crc32" and isinstance(files, dict) and all(
            isinstance(name, str) and os.path.basename(name) == name and name not in ("", ".", "..")
            and isinstance(e, dict) and type(e.get("size")) is int and isinstance(e.get("crc32"), str)
            for name, e in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        raise CheckpointError(f"its manifest '{MANIFEST}' is unreadable or malformed")
    return files


def _check_file(directory: str, name: str, expected: dict[str, Any]) -> str | None:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"'{name}' is missing"
    try:
        size = os.path.getsize(path)
        if size != expected["size"]:
            return f"'{name}' has {size} bytes where {expected['size']} were written (truncated or extended)"
        found = checksum(path)["crc32"]
    except OSError as e:
        return f"'{name}' cannot be read: {e}"
    if found != expected["crc32"]:
        return f"'{name}' fails its checksum (crc32 {found}, {expected['crc32']} at save): altered since"
    return None


def _share_problems(directory: str, rank: int, world_size: int) -> list[str]:
    """This rank's share of the check (files split by index): what is wrong. Rank 0 also looks for
    DCP files the manifest does not list."""
    try:
        files = read_manifest(directory)
        present = sorted(n for n in os.listdir(directory) if _is_dcp_file(n)) if rank == 0 else []
    except (CheckpointError, OSError) as e:
        return [str(e)]
    missing = [f"'{METADATA}' is missing"] if rank == 0 and METADATA not in present else []
    if files is None:
        return missing + [f"'{MANIFEST}' is missing (every checkpoint zeroshard commits holds one: it was "
                          f"deleted, or not copied with the checkpoint); without it the files cannot be "
                          f"verified"]
    names = sorted(files)
    found = [p for n in names[rank::world_size] if (p := _check_file(directory, n, files[n]))]
    found += [f"'{n}' is not in the manifest" for n in present if n not in files]
    return found + (missing if METADATA not in files else [])


def _problems(directory: str, comm: Comm | None) -> list[str]:
    """Every rank's share of the check, gathered: the same answer on every rank."""
    if comm is None:
        return _share_problems(directory, 0, 1)
    views = comm.all_gather_objects(_share_problems(directory, comm.rank, comm.world_size))
    return sorted({p for found in views for p in found})


def verify(directory: str, comm: Comm | None = None, parent: str | None = None) -> None:
    """Raise CheckpointError naming every damaged file (collective with a Comm); `parent`: the
    directory whose `latest` named this one, where a complete sibling is looked for."""
    problems = _problems(directory, comm)
    if problems:
        listed = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        raise CheckpointError(f"cannot read checkpoint '{directory}', it is damaged: {listed}"
                              + offer(parent, directory, comm))


def offer(parent: str | None, broken: str, comm: Comm | None = None) -> str:
    """The end of an error about `broken`, reached through `parent`'s `latest`: the newest complete
    sibling to load instead, by path. Only offered: loading an older checkpoint is the user's call."""
    if parent is None:
        return ""
    newest = newest_complete(parent, broken, comm)
    if newest is None:
        return f"; there is no other complete checkpoint in '{parent}'"
    return (f"; the newest complete checkpoint is '{newest}' (load it by that path, or write "
            f"'{os.path.basename(newest)}' into {os.path.join(parent, 'latest')} to resume from it)")


def committed(parent: str) -> list[str]:
    """The names of the checkpoints in `parent`, by name: directories holding DCP's index, skipping
    a save in progress (".x.tmp") and a replaced tag ("x.old")."""
    if not os.path.isdir(parent):
        return []
    return sorted(n for n in os.listdir(parent) if not (n.startswith(".") or n.endswith(".old"))
                  and os.path.isfile(os.path.join(parent, n, METADATA)))


def newest_complete(parent: str, exclude: str, comm: Comm | None = None) -> str | None:
    """The most recently written checkpoint under `parent`, other than `exclude`, whose files
    verify. Temporary (".x.tmp") and replaced (".old") ones are skipped."""
    candidates = []
    for name in committed(parent):
        path = os.path.join(parent, name)
        if os.path.normpath(path) != os.path.normpath(exclude):
            candidates.append((os.path.getmtime(os.path.join(path, METADATA)), _natural(name), path))
    paths = [path for *_, path in sorted(candidates, reverse=True)]
    if comm is not None:  # rank 0's list: every rank then checks the same checkpoints in the same order
        paths = comm.all_gather_objects(paths)[0]
    return next((path for path in paths if not _problems(path, comm)), None)


def _natural(name: str) -> list[Any]:
    """step9 before step10. re.split puts the digit runs at the odd positions, so two keys hold a
    string or an int at the same position and always compare."""
    return [int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name))]
