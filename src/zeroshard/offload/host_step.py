"""The host's part of an offloaded step, in one pass over memory.

Between a buffer's reduced gradient arriving in host memory and its updated parameters being ready
to go up, the host used to pass over memory three times beside the update itself: the 16-bit
gradient upcast to an fp32 copy, that copy multiplied by the unscale/clip factor, and the updated
fp32 master cast down into the 16-bit staging buffer. Each pass reads and writes the whole shard, so
the host step cost about 40-48 bytes of memory traffic an element where Adam's own update needs 28
(read the 16-bit gradient and the fp32 master and moments; write the master, the moments and the
16-bit copy). Even kept in cache, separate passes cost as much again as the update
(benchmarks/host_step.py, "separate passes").

Here they are one loop: host_adam.c reads the gradient in its dtype, scales it, applies torch's
fused Adam/AdamW arithmetic operation for operation, and writes the new value in the compute dtype,
element by element; slices run on a pool of threads (ctypes releases the GIL). It is compiled on
first use with the system's C compiler (about a second; cached by its source's hash). Where there
is none, or torch's CPU kernels are not ones whose arithmetic it reproduces (AVX2, AVX-512), the
update runs torch's own kernel chunk by chunk with the conversions beside it (`_update_in_chunks`):
the same bits, more time.

Invariants:
- The same bits as `optimizer.step()` over the whole shard: the state is created as torch creates
  it, the step count is advanced once per shard, the body of the shard gets the kernel's vectorized
  arithmetic and its last (n mod 16) elements torch's own kernel, so they take its scalar path as
  in one call over the whole (tests/parity/test_host_step.py holds this against torch).
- Only torch's own Adam and AdamW with fused=True, plain-number hyperparameters and no step hooks
  but zeroshard's (`folds`); anything else steps through `optimizer.step()` as before.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

logger = logging.getLogger("zeroshard")

# Elements per chunk (the fallback's): a multiple of 16 (the fused CPU kernel's task unit, a cache
# line, so every element takes its vectorized path exactly as in one call over the whole tensor), and
# small enough that a chunk's fp32 scratch (256 KiB) and its slices of the master and moments stay in
# cache between the passes.
CHUNK = 1 << 16


def folds(optimizer: torch.optim.Optimizer, has_user_hooks: bool) -> bool:
    """Can this optimizer's update of host shards run here, in one pass? torch's own Adam/AdamW
    (a subclass may step otherwise), fused in every group, with plain-number hyperparameters (a
    tensor lr or betas would need torch's own handling) and no hooks a step() would run."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or has_user_hooks:
        return False
    plain = (float, int)
    return all(group.get("fused") and not group.get("capturable") and not group.get("differentiable")
               and isinstance(group["lr"], plain) and all(isinstance(b, plain) for b in group["betas"])
               for group in optimizer.param_groups)


def group_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return group
    raise KeyError("the parameter is in none of the optimizer's groups")


def _state(optimizer: torch.optim.Optimizer, param: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
    """The parameter's state, created as torch's Adam creates it on a first step (fused)."""
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


@torch.no_grad()
def update(optimizer: torch.optim.Optimizer, param: torch.Tensor, grad: torch.Tensor, factor: float,
           out: torch.Tensor | None, scratch: torch.Tensor, group: dict[str, Any] | None = None) -> None:
    """optimizer's update of `param` (one of its parameters: an fp32 host tensor) with gradient
    `factor` x `grad` (fp32 or 16-bit), as `optimizer.step()` would make it; the new values also go
    into `out` (any float dtype; None: nowhere). `scratch`: at least CHUNK fp32 elements. `group`:
    the hyperparameters to use (default: param's group, as it is now; a pipelined update passes a
    copy taken when it started, so an lr scheduler stepping meanwhile changes nothing)."""
    group = group if group is not None else group_of(optimizer, param)
    optimizer._opt_called = True  # as a step() would mark it (torch's lr schedulers look)
    state = _state(optimizer, param, group["amsgrad"])
    state["step"].add_(1)  # as torch's _foreach_add_: once per parameter
    values = param.detach()  # the same storage, sliced outside autograd
    kernel = _kernel()
    body = values.numel() - values.numel() % 16 if kernel is not None else 0
    if body:
        _update_in_one_loop(kernel, group, state, values, grad, factor, out, body)
    _update_in_chunks(group, state, values, grad, factor, out, scratch, start=body)


def _update_in_chunks(group: dict[str, Any], state: dict[str, Any], values: torch.Tensor, grad: torch.Tensor,
                      factor: float, out: torch.Tensor | None, scratch: torch.Tensor, start: int) -> None:
    """Elements [start, n): torch's fused kernel chunk by chunk, the gradient converted beside it
    into `scratch` (kept in cache) and the new values cast into `out` after each chunk."""
    kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
    beta1, beta2 = group["betas"]
    options = dict(amsgrad=group["amsgrad"], lr=group["lr"], beta1=beta1, beta2=beta2,
                   weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                   grad_scale=None, found_inf=None)
    moments = _moments(state, group["amsgrad"])
    convert = grad.dtype != torch.float32 or factor != 1.0
    for a in range(start, values.numel(), CHUNK):
        b = min(a + CHUNK, values.numel())
        g = grad[a:b]
        if convert:  # exact upcast, then one rounding by the factor: the bits of grad.float() * factor
            g = scratch[:b - a].copy_(g)
            if factor != 1.0:
                g.mul_(factor)
        m, v, *vmax = (t[a:b] for t in moments)
        kernel([values[a:b]], [g], [m], [v], vmax, [state["step"]], **options)
        if out is not None:
            out[a:b].copy_(values[a:b])


def _moments(state: dict[str, Any], amsgrad: bool) -> list[torch.Tensor]:
    return [state["exp_avg"], state["exp_avg_sq"]] + ([state["max_exp_avg_sq"]] if amsgrad else [])


# ---- the loop in C ------------------------------------------------------------------------------
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_adam.c")
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared"]
_loaded: dict[str, Any] = {}  # the compiled loop and its threads, made once a process
SLICE = 1 << 20  # elements a thread takes at a time (any split gives the same bits)


def _update_in_one_loop(kernel: Any, group: dict[str, Any], state: dict[str, Any], values: torch.Tensor,
                        grad: torch.Tensor, factor: float, out: torch.Tensor | None, n: int) -> None:
    """Elements [0, n) in host_adam.c's loop, in slices of SLICE elements: over torch's OpenMP
    threads where the loop was built with OpenMP, else on a pool of Python threads (which compete
    with torch's idle OpenMP threads while those spin, after each of its parallel ops)."""
    beta1, beta2 = group["betas"]
    step = float(state["step"])  # torch's kernel reads the count as a float, computes in double
    bc1, bc2 = 1 - math.pow(beta1, step), 1 - math.pow(beta2, step)
    scalars = (float(factor), int(group.get("decoupled_weight_decay", False)), int(group["maximize"]),
               int(group["amsgrad"]), group["lr"], group["weight_decay"], beta1, beta2, group["eps"],
               group["lr"] / bc1, math.sqrt(bc2))
    moments = _moments(state, group["amsgrad"])
    p, m, v = (t.data_ptr() for t in (values, *moments[:2]))
    vmax = moments[2].data_ptr() if group["amsgrad"] else None
    g, g_dtype = grad.data_ptr(), _DTYPES[grad.dtype]
    o, o_dtype = (out.data_ptr(), _DTYPES[out.dtype]) if out is not None else (None, -1)

    if _loaded["openmp"]:  # slices over torch's own OpenMP threads, in one call
        codes = [kernel(p, m, v, vmax, g, g_dtype, o, o_dtype, n, *scalars, SLICE, torch.get_num_threads())]
    else:
        def run(a: int) -> int:
            b = min(a + SLICE, n)
            return kernel(p + 4 * a, m + 4 * a, v + 4 * a, vmax and vmax + 4 * a,
                          g + grad.element_size() * a, g_dtype, o and o + out.element_size() * a, o_dtype,
                          b - a, *scalars, 0, 1)
        pool = _loaded["pool"]
        if n <= SLICE or pool is None:
            codes = [run(a) for a in range(0, n, SLICE)]
        else:  # slices taken as threads come free: a thread slowed by a neighbour takes fewer
            codes = list(pool.map(run, range(0, n, SLICE)))
    if any(codes):
        raise RuntimeError("zeroshard's host Adam loop refused its arguments (a dtype it does not take)")


def _kernel() -> Any:
    """The compiled loop (and its thread pool), or None where it cannot reproduce torch's bits or
    cannot be built (a warning says so, once)."""
    if "kernel" in _loaded:
        return _loaded["kernel"]
    _loaded["kernel"], _loaded["pool"] = None, None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512") or os.environ.get("ZEROSHARD_HOST_ADAM") == "torch":
        return None  # (torch's kernels there round otherwise: its own, chunk by chunk)
    try:
        path, openmp = _build()
        library = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("zeroshard: the host's Adam loop could not be built (%s); offloaded steps run "
                       "torch's kernel chunk by chunk instead: the same results, slower", e)
        return None
    fn = library.zeroshard_adam_step
    p, i64, d, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
    fn.argtypes = [p, p, p, p, p, i, p, i, i64, d, i, i, i, d, d, d, d, d, d, d, i64, i]
    fn.restype = i
    threads = torch.get_num_threads()
    _loaded["kernel"], _loaded["openmp"] = fn, openmp
    _loaded["pool"] = ThreadPoolExecutor(threads, thread_name_prefix="zeroshard-adam") \
        if threads > 1 and not openmp else None
    return fn


def _build() -> tuple[str, bool]:
    """host_adam.c compiled into the cache (ZEROSHARD_CACHE, else ~/.cache/zeroshard), once per
    source, compiler and flags; written beside and renamed, so ranks building at once agree. With
    OpenMP where the compiler has it (libgomp.so.1: the copy torch loaded, by its soname), else
    without. Returns the library and whether it uses OpenMP."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc) found")
    error: Exception | None = None
    for flags, openmp in ((_FLAGS + ["-fopenmp"], _torch_uses_gomp()), (_FLAGS, False)):
        if not openmp and "-fopenmp" in flags:
            continue  # (torch without libgomp: its OpenMP runtime is not one ours can share)
        try:
            return _compiled(compiler, flags), openmp
        except (OSError, subprocess.SubprocessError) as e:
            error = e
    raise error


def _torch_uses_gomp() -> bool:
    """Has this process loaded GNU OpenMP (libgomp.so.1, with torch)? Then a library linked to it
    shares torch's threads."""
    try:
        with open("/proc/self/maps") as f:
            return "libgomp.so.1" in f.read()
    except OSError:
        return False


def _compiled(compiler: str, flags: list[str]) -> str:
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + " ".join([compiler] + flags).encode()).hexdigest()[:16]
    cache = os.environ.get("ZEROSHARD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zeroshard")
    target = os.path.join(cache, f"host_adam-{key}.so")
    if not os.path.exists(target):
        os.makedirs(cache, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=cache, suffix=".so")
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, _SOURCE, "-o", partial], check=True, capture_output=True,
                           timeout=120)
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return target


def scratch_for(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """A chunk's fp32 scratch."""
    return torch.empty(CHUNK, dtype=torch.float32, device=device)
