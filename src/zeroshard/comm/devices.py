"""Where a rank's tensors live: the process group decides, the model follows.

A process group works on one device per rank: NCCL on this rank's GPU, gloo on the CPU. zeroshard
builds every buffer there, so the model must be on that device or on the CPU, from where initialize()
moves it unit by unit as each flat buffer is built (a rank never holds two copies of more than one
unit); a model on another GPU is moved the same way. Anything else (a CUDA model under gloo) is
refused before any collective, naming both devices and the fix: a mismatched broadcast fails deep
inside the backend, or hangs.

The backend is chosen once, when the group starts: the `backend` argument, else the ZEROSHARD_BACKEND
environment variable, else NCCL where CUDA is available and gloo elsewhere. Under NCCL each rank takes
the GPU numbered by LOCAL_RANK, unless CUDA_VISIBLE_DEVICES already leaves one GPU per process;
without LOCAL_RANK (a plain `python train.py`) the current GPU stays, as torch.cuda.set_device left it.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

BACKEND_ENV = "ZEROSHARD_BACKEND"
BACKENDS = ("nccl", "gloo")


def choose_backend(backend: str | None = None) -> str:
    """The backend to start: the argument, else $ZEROSHARD_BACKEND, else nccl with CUDA, gloo without."""
    chosen = backend or os.environ.get(BACKEND_ENV) or ("nccl" if torch.cuda.is_available() else "gloo")
    if chosen not in BACKENDS:
        source = "backend" if backend else BACKEND_ENV
        raise ValueError(f"{source}={chosen!r}: zeroshard runs on 'nccl' (CUDA) or 'gloo' (CPU)")
    if chosen == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("the nccl backend needs CUDA, and no CUDA device is visible; use gloo "
                           f"(backend='gloo' or {BACKEND_ENV}=gloo) to train on the CPU")
    return chosen


def local_cuda_index() -> int:
    """This rank's GPU under NCCL: LOCAL_RANK, or 0 where CUDA_VISIBLE_DEVICES shows each rank one GPU.
    Refuses more ranks on a node than GPUs (NCCL would fail with 'invalid device ordinal'). One GPU
    visible to several ranks through CUDA_VISIBLE_DEVICES cannot be told from a launcher that gave
    each rank its own: every rank then takes index 0, and NCCL reports "Duplicate GPU detected"."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    count = torch.cuda.device_count()
    if count == 1 and "CUDA_VISIBLE_DEVICES" in os.environ and local_world > 1:
        return 0  # the launcher narrowed each process to its own GPU
    if max(local_rank + 1, local_world) > count:
        raise RuntimeError(f"{local_world} ranks on this node but {count} CUDA device(s): NCCL needs one GPU "
                           f"per rank. Launch at most {count} processes per node (torchrun "
                           f"--nproc-per-node {count}), or train on the CPU with gloo "
                           f"({BACKEND_ENV}=gloo; `zeroshard train --device cpu`)")
    return local_rank


def ensure_process_group(timeout_s: float = 600.0, backend: str | None = None) -> None:
    """Start the default process group if none exists: from torchrun's variables, else world size 1.

    The timeout turns a rank that never arrives into an error instead of a hang. A group started
    elsewhere (the script, accelerate under the HF Trainer) is kept, and released at exit too."""
    if dist.is_initialized():
        _release_at_exit()
        return
    chosen = choose_backend(backend)
    timeout = timedelta(seconds=timeout_s)
    if chosen == "nccl" and "LOCAL_RANK" in os.environ:  # else keep a GPU the user already chose
        torch.cuda.set_device(local_cuda_index())
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(chosen, timeout=timeout)
    else:
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    _release_at_exit()


_release_registered = False


def _release_at_exit() -> None:
    """Once per process: a gloo group alive at the interpreter's teardown can abort it (see
    _release_group), whoever started the group."""
    global _release_registered
    if not _release_registered:
        atexit.register(_release_group)
        _release_registered = True


SETTLE_S = 1.0          # the most an exit waits for the backend's threads to go quiet
RELEASE_WAIT_S = 15.0  # what a clean teardown takes is milliseconds
_abandoned = False      # a collective of the default group will never complete (see abandon_group)


def abandon_group() -> None:
    """Called as a DivergenceError is raised: a collective of this rank's may never complete, so the
    exit hook must not wait for the group's teardown without bound."""
    global _abandoned
    _abandoned = True


def _release_group() -> None:
    """At exit, the default group is destroyed, unless the script did it already: a gloo
    group left alive to the interpreter's teardown can abort the process there (std::terminate,
    seen on torch 2.13 once torch._dynamo has run). Then the backend's threads are let finish
    what they still hold (_let_workers_finish), for the same reason.

    After a DivergenceError a collective is still in flight, and destroying the group blocks until
    it times out (up to collective_timeout): the job would sit there long after its error was
    printed. Then (only then: a clean teardown may wait for a peer still saving) the teardown gets
    RELEASE_WAIT_S, and the process leaves with status 1, its error already reported."""
    if dist.is_initialized():
        if _abandoned:
            _destroy_within(RELEASE_WAIT_S)
        else:
            dist.destroy_process_group()
    _let_workers_finish()


def _destroy_within(seconds: float) -> None:
    """Destroy the default group on a thread of its own; leave the process (status 1) if that
    takes longer than `seconds`."""
    released = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        finally:
            released.set()
    try:
        threading.Thread(target=destroy, name="zeroshard-release", daemon=True).start()
    except RuntimeError:  # no new thread at interpreter shutdown (Python 3.12.0-3.12.2)
        _leave("exiting without destroying the process group")
    if not released.wait(seconds):
        _leave(f"the process group could not be shut down within {seconds:.0f} s: exiting")


def _leave(what: str) -> None:
    """Exit with status 1 now, past the group's blocked teardown, with what was written flushed."""
    sys.stderr.write(f"zeroshard: {what} (a collective is still in flight after a DivergenceError)\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a group's collectives work on, for this rank: this rank's GPU where NCCL serves the
    group. That is "nccl", a per-device string naming it ("cpu:gloo,cuda:nccl"), or "undefined" where
    CUDA is available: init_process_group() without a backend (and init_device_mesh("cuda", ...),
    which calls it so) pairs CUDA with NCCL and the CPU with gloo."""
    backend = str(dist.get_backend(group))
    if not ("nccl" in backend or (backend == "undefined" and torch.cuda.is_available())):
        return torch.device("cpu")
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    if bound is not None:  # init_process_group(device_id=...)
        return bound
    index = torch.cuda.current_device()
    if index == 0 and "LOCAL_RANK" in os.environ:  # a group the script started without set_device:
        index = local_cuda_index()                 # every rank would work on GPU 0
        if index != 0:
            torch.cuda.set_device(index)
    return torch.device("cuda", index)


def check_placement(module: nn.Module, device: torch.device) -> None:
    """Refuse a model the group cannot use: every parameter and buffer must be on the CPU or on a
    device of the group's type (initialize() moves it to this rank's). Refusals depend only on the
    device types, the same on every rank, so they can come before any collective: a model on GPU 0
    on every rank (`.cuda()` before the rank's GPU was set) is moved rather than refused on all but
    rank 0, which would leave rank 0 waiting for the others."""
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            if t.device.type in ("cpu", "meta", device.type):
                continue  # the meta device is refused with its own message (checks.check_model)
            raise ValueError(_mismatch(f"{kind} '{name}'", t.device, device))


def _mismatch(what: str, have: torch.device, need: torch.device) -> str:
    head = f"{what} is on {have}, but this rank's process group works on {need}"
    if need.type == "cpu":
        return (f"{head} (gloo). Train on the GPU with an NCCL group (zeroshard.ensure_process_group("
                f"backend='nccl') or {BACKEND_ENV}=nccl before initialize()), or move the model to the CPU "
                f"(model.cpu())")
    return (f"{head}. Build the model on the CPU (initialize() moves it to {need} unit by unit) or on "
            f"{need}")


def move_buffers(module: nn.Module, device: torch.device) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every registered buffer onto `device` (a buffer shared by two modules stays shared).
    Returns (module, name, the buffer before) for each one moved, to undo it."""
    moved: dict[int, torch.Tensor] = {}
    before = []
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.device != device:
                m._buffers[name] = moved.setdefault(id(b), b.to(device))
                before.append((m, name, b))
    return before


def _let_workers_finish() -> None:
    """Return once no other thread of this process has been running at two looks in a row, each
    after a sleep (the GIL released), or after SETTLE_S.

    Why: a gloo worker thread drops its reference to a collective only after the caller's wait()
    has returned. When that is the last reference, the drop releases Python tensors and so takes
    the GIL. A worker that gets to it only once the interpreter is finalizing is made to exit by
    Python, through C++ frames that cannot unwind: std::terminate and SIGABRT, after the script's
    work is done (seen at the end of a 2-rank run that saved a checkpoint, on a loaded machine).
    The sleep hands the GIL to a worker waiting for it; the looks at /proc wait for one the
    scheduler has not run yet. Where /proc is not there, one short sleep is all it gets."""
    deadline, quiet = time.monotonic() + SETTLE_S, 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.002)
        running = other_threads_running()
        if running is None:
            time.sleep(0.05)
            return
        quiet = 0 if running else quiet + 1


def other_threads_running() -> bool | None:
    """Is a thread of this process, other than the caller, running or ready to run (state R in
    /proc/self/task/*/stat)? None where /proc is not there."""
    me = threading.get_native_id()
    try:
        tasks = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return None
    for task in tasks:
        if task == me:
            continue
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]  # (the name, in parentheses, may hold spaces)
        except (OSError, IndexError):
            continue  # the thread has exited
        if state == "R":
            return True
    return False
