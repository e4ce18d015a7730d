"""The files of one rank's disk offload, as tensors, and the reads and writes that stream them.

Invariants:
- Each offloaded tensor (an fp32 master shard, one optimizer state of a shard, a parameter shard) is
  one file, preallocated to its size, and exposed as a tensor that maps it (`from_file`, shared):
  code outside the step (checkpoints, state_dict, memory_stats) reads and writes it as any tensor.
  The step never touches the maps: it moves data with pread/pwrite (`read`, `write`), so memory
  holds what is being stepped, not the state.
- The page cache does not quietly keep the state: every read and write ends with
  posix_fadvise(DONTNEED) over what it moved (a write after fdatasync, so its pages are clean and
  actually dropped); drop_pages() also unmaps what a reader outside the step paged in (madvise
  DONTNEED), and the step's stream calls it first.
- Bytes read and written are counted (thread-safe): per step (`end_step` closes one) and in total.
- close() removes every directory (idempotent); maps still alive keep their memory, not the files.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from typing import Any

import torch

from . import rundir
from .cache import ShardCache

_MADV_DONTNEED = 4
_CHUNK = 1 << 30  # one pread/pwrite moves at most this much (Linux moves < 2 GiB per call)


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no libc (not Linux): maps are left to the kernel
        return None


def _disk_error(e: OSError, doing: str, path: str) -> OSError:
    """An offload file's OSError, naming the file and, for a full disk, what filled it."""
    why = (": the disk filled after initialize() checked its free space (another process, or other "
           "files there, took it). Free space there, or give nvme_path a larger disk"
           if e.errno == errno.ENOSPC else "")
    return OSError(e.errno, f"disk offload (nvme_path): {doing} {path}: {e.strerror}{why}")


class DiskStore:
    """One rank's offload files, by kind ("optimizer", "param") -> directory."""

    def __init__(self, dirs: dict[str, str], block_size: int = _CHUNK) -> None:
        self.dirs = dirs
        self.block = max(4096, min(block_size, _CHUNK))
        self._fds: dict[str, int] = {}                 # file path -> open descriptor
        self._maps: dict[str, torch.UntypedStorage] = {}  # file path -> its mapping
        self._lock = threading.Lock()
        self._step = {"read": 0, "written": 0}
        self.last_step = {"read": 0, "written": 0}
        self.total = {"read": 0, "written": 0}
        self._libc = _libc()
        self.closed = False
        self.stream: Any = None  # the optimizer step's sub-group stream (stream.py), made on first use
        self.cache = ShardCache(0)  # parameter shards kept in host memory (offload_param.max_in_cpu)

    # ---- files as tensors ------------------------------------------------------------------------
    def new_tensor(self, kind: str, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor of `numel` elements resting in its own new file."""
        path = os.path.join(self.dirs[kind], name)
        if path in self._maps:
            return self.tensor(path, dtype)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(0, dtype=dtype)  # nothing to store (an empty shard)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # the space is reserved now, not found missing later
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # (a filesystem without fallocate)
                os.close(fd)
                os.remove(path)
                raise _disk_error(e, f"reserving {nbytes / 2**20:.1f} MiB for", path) from None
            os.ftruncate(fd, nbytes)  # sparse: a write through the map then finds the space or not
        except AttributeError:  # pragma: no cover - no posix_fallocate (not Linux)
            os.ftruncate(fd, nbytes)
        self._fds[path] = fd
        self._maps[path] = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
        return self.tensor(path, dtype)

    def state_tensor(self, master: torch.Tensor, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Optimizer state `key` of the shard whose master rests in the file `master`: its own file
        beside it (made zero-filled on first use, the same file afterwards)."""
        name = f"{os.path.basename(self.path_of(master)).removesuffix('.master')}.{key}"
        return self.new_tensor("optimizer", name, master.numel(), dtype or master.dtype)

    def tensor(self, path: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(0, dtype=dtype).set_(self._maps[path])

    def owns(self, t: torch.Tensor | None) -> bool:
        """Does `t` rest in one of this store's files?"""
        return t is not None and t.device.type == "cpu" and t.untyped_storage().filename in self._maps

    def path_of(self, t: torch.Tensor) -> str:
        return t.untyped_storage().filename

    # ---- streaming -------------------------------------------------------------------------------
    def _moves(self, t: torch.Tensor, buffer: torch.Tensor):
        """(fd, file offset, byte view of buffer) chunks covering `t` (a file tensor)."""
        fd = self._fds[self.path_of(t)]
        start, nbytes = t.storage_offset() * t.element_size(), t.numel() * t.element_size()
        size = buffer.numel() * buffer.element_size()
        if size != nbytes or not buffer.is_contiguous():
            raise ValueError(f"disk offload: a {size}-byte buffer for a {nbytes}-byte tensor")
        # A view of the buffer's memory by address, not through numpy: numpy would make its storage
        # non-resizable, and stage 3 frees a unit's buffer by resizing its storage. The caller keeps
        # `buffer` alive for the call.
        data = memoryview((ctypes.c_char * nbytes).from_address(buffer.data_ptr())).cast("B") if nbytes \
            else memoryview(b"")
        for a in range(0, nbytes, self.block):
            yield fd, start + a, data[a:a + self.block]

    def read(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """out <- the file behind `t` (pread), then drop those pages from the page cache."""
        if out.device.type != "cpu" or not out.is_contiguous():
            host = torch.empty(t.numel(), dtype=t.dtype)
            self.read(t, host)
            out.copy_(host.view_as(out))
            return
        for fd, offset, view in self._moves(t, out):
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(f"disk offload: short read from {self.path_of(t)} at {offset + done}")
                done += n
            os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        self._count("read", t.numel() * t.element_size())

    def write(self, t: torch.Tensor, values: torch.Tensor) -> None:
        """The file behind `t` <- values (pwrite), synced, and its pages dropped."""
        if values.device.type != "cpu" or values.dtype != t.dtype or not values.is_contiguous():
            values = values.to("cpu", t.dtype).contiguous()
        try:
            for fd, offset, view in self._moves(t, values):
                done = 0
                while done < len(view):
                    done += os.pwritev(fd, [view[done:]], offset + done)
            fd = self._fds[self.path_of(t)]
            os.fdatasync(fd)  # clean pages: DONTNEED drops them (dirty ones it would only start writing)
        except OSError as e:
            raise _disk_error(e, "writing", self.path_of(t)) from None
        start = t.storage_offset() * t.element_size()
        os.posix_fadvise(fd, start, t.numel() * t.element_size(), os.POSIX_FADV_DONTNEED)
        self._count("written", t.numel() * t.element_size())

    def read_shard(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """out <- a parameter shard: from the host cache if it holds it, else from its file (and
        then kept in the cache, room permitting)."""
        key = (self.path_of(t), t.storage_offset())
        if not self.cache.read_into(key, out):
            self.read(t, out)
            self.cache.keep(key, out)

    def write_shard(self, t: torch.Tensor, values: torch.Tensor) -> None:
        """A parameter shard <- values: its file, and its cached copy if there is one."""
        self.write(t, values)
        self.cache.refresh((self.path_of(t), t.storage_offset()), values)

    def drop_pages(self, only: list[torch.Tensor] | None = None) -> None:
        """Unmap and drop what readers outside the step (a checkpoint, state_dict) paged in or
        wrote: in every file, or in the files behind `only` (tensors the store does not own are
        skipped)."""
        paths = self._maps if only is None else {self.path_of(t) for t in only if self.owns(t)}
        for path in paths:
            storage = self._maps[path]
            if self._libc is not None:
                self._libc.madvise(ctypes.c_void_p(storage.data_ptr()), ctypes.c_size_t(storage.nbytes()),
                                   _MADV_DONTNEED)  # a dirty page's data goes to the page cache, kept
            fd = self._fds[path]
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    # ---- accounting ----------------------------------------------------------------------------
    def _count(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self._step[kind] += nbytes
            self.total[kind] += nbytes

    def end_step(self) -> None:
        """Close one step's I/O figures (called once the optimizer step's stream is done)."""
        with self._lock:
            self.last_step, self._step = self._step, {"read": 0, "written": 0}

    def file_bytes(self) -> int:
        return sum(s.nbytes() for s in self._maps.values())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"last_step": dict(self.last_step), "total": dict(self.total),
                    "files": len(self._maps), "file_bytes": self.file_bytes(),
                    "buffers": self.stream.nbytes if self.stream is not None else 0,
                    "cached": self.cache.nbytes, "cache_hits": self.cache.hits,
                    "cache_misses": self.cache.misses}

    # ---- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the files (engine teardown, exit, a failed initialize). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.stream is not None:
            self.stream.shutdown()
        for fd in self._fds.values():
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        for directory in self.dirs.values():
            rundir.remove(directory)
