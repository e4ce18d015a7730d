"""Building the user's torch optimizer over flat shards, whatever form the user gave it in.

The optimizer never sees a module parameter: it sees one flat tensor per (unit, parameter group),
which is the whole buffer at stage 0 and this rank's shard at stages 1-3. Any torch optimizer works
unchanged because each element is updated independently of the others.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Union

import torch
from torch import nn

from .comm import Comm
from .offload import Copier, prefer_fused, warn_if_slow
from .config import Config, ConfigError
from .nonfinite import NonFiniteGuard
from .precision import LossScaler
from .flat_param import FlatParam
from .gather_together import write_back_together
from .nvme import stream_groups
from .states import temporarily

OptimizerSpec = Union[None, type, Callable[[Any], torch.optim.Optimizer]]
# Optimizers whose update of an element depends on the whole tensor: they cannot run on shards.
_NOT_ELEMENTWISE = tuple(getattr(torch.optim, name, None)
                         for name in ("Adafactor", "Muon", "LBFGS", "SparseAdam"))


def resolve_groups(model: nn.Module, param_groups: list[dict] | None) -> tuple[list[dict], dict[int, int]]:
    """User parameter groups -> (options per group, group index of each trainable parameter)."""
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    if param_groups is None:
        return [{}], {id(p): 0 for p in trainable}
    options, group_of = [], {}
    for index, group in enumerate(param_groups):
        group = dict(group)
        params = group.pop("params", None)
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        for p in params:
            if id(p) not in names:
                raise ValueError(f"param_groups[{index}] holds a tensor that is not a parameter of the model")
            if not p.requires_grad:
                raise ValueError(f"param_groups[{index}] holds '{names[id(p)]}', which is frozen "
                                 f"(requires_grad=False); leave frozen parameters out of the groups")
            if id(p) in group_of:
                raise ValueError(f"'{names[id(p)]}' appears in two parameter groups; put it in one")
            group_of[id(p)] = index
        options.append(group)
    missing = [names[id(p)] for p in trainable if id(p) not in group_of]
    if missing:
        raise ValueError(f"trainable parameters {missing[:5]} are in no parameter group; add them to "
                         f"a group or set requires_grad=False")
    return options, group_of


def build_optimizer(spec: OptimizerSpec, config: Config, groups: list[dict],
                    guarded: bool = True) -> torch.optim.Optimizer:
    """groups: [{"params": [flat tensors], **options}], one per user parameter group. A guarded
    optimizer refuses a step() from outside engine.step() (a probe over stand-ins is not guarded)."""
    plain = len(groups) == 1 and set(groups[0]) == {"params"}
    params: Any = groups[0]["params"] if plain else groups
    if isinstance(spec, torch.optim.Optimizer):
        raise TypeError("optimizer must be a callable params -> torch.optim.Optimizer (e.g. "
                        "lambda p: torch.optim.AdamW(p, lr=3e-4)) or an Optimizer class, not an "
                        "instance: an instance was built over the unsharded parameters")
    if spec is None:
        if config.optimizer is None:
            raise ConfigError("no optimizer: pass optimizer=... to initialize, or add "
                              "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4}} "
                              "to the config")
        cls, kwargs = config.optimizer.build_class(), config.optimizer.params
    elif isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer):
        if config.optimizer is not None and not issubclass(spec, config.optimizer.build_class()):
            raise ConfigError(f"the optimizer class {spec.__name__} and the config's \"optimizer\" section "
                              f"of type {config.optimizer.type!r} disagree (its params were written for that "
                              f"type); pass optimizer=None to build the section's, or change its type")
        cls, kwargs = spec, (config.optimizer.params if config.optimizer else {})
    elif callable(spec):
        if config.optimizer is not None:  # which one the user meant cannot be guessed
            raise ConfigError(f"two optimizers: the callable {getattr(spec, '__name__', spec)!r} and the "
                              f"config's \"optimizer\" section ({config.optimizer.type}); drop one, or pass "
                              f"the class (e.g. torch.optim.SGD) to build it with the section's params")
        cls, kwargs = spec, {}
    else:
        raise TypeError(f"optimizer must be a callable, an Optimizer class or None, "
                        f"got {type(spec).__name__}")
    offloaded = config.zero.offload_optimizer
    if offloaded and (spec is None or isinstance(spec, type)):  # keyword arguments are the config's
        kwargs = prefer_fused(cls, kwargs)
    try:
        optimizer = cls(params, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"could not build the optimizer {getattr(cls, '__name__', cls)} with "
                          f"{kwargs} over zeroshard's flat shards: {e}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the optimizer callable returned {type(optimizer).__name__}, "
                        f"not a torch.optim.Optimizer")
    whole_tensor = [c for c in _NOT_ELEMENTWISE if c is not None and isinstance(optimizer, c)]
    if whole_tensor:
        raise ConfigError(f"{whole_tensor[0].__name__} updates each parameter from properties of the whole "
                          f"tensor (its shape, norm or factored statistics); over ZeRO's flat shards "
                          f"it would compute something else. Use an elementwise optimizer (Adam, AdamW, SGD, "
                          f"Adagrad, RMSprop, ...)")
    _refuse_unsupported_options(optimizer)
    optimizer._zeroshard_stepping = not guarded  # set by _update() around its step()
    optimizer.register_step_pre_hook(_refuse_direct_step)
    if offloaded:
        warn_if_slow(optimizer)
    given = {id(t) for g in groups for t in g["params"]}
    seen = {id(t) for g in optimizer.param_groups for t in g["params"]}
    if given != seen:
        raise ValueError("the optimizer callable must build its optimizer over exactly the `params` "
                         "it is given (zeroshard's flat shards), not over model.parameters()")
    return optimizer


def _refuse_unsupported_options(optimizer: torch.optim.Optimizer) -> None:
    """Options torch accepts at construction but that fail at the first step over flat shards."""
    for group in optimizer.param_groups:
        if group.get("differentiable"):
            raise ConfigError("the optimizer has differentiable=True: zeroshard updates its flat shards in "
                              "place, outside autograd; remove the option")
        if group.get("capturable") and any(t.device.type == "cpu" for t in group["params"]):
            raise ConfigError("the optimizer has capturable=True, which needs CUDA tensors, but its shards "
                              "are on the CPU (a CPU group or offload_optimizer); remove the option")


def _refuse_direct_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The masters get their gradients only inside engine.step() (reduced, unscaled, clipped):
    engine.optimizer.step() called directly would step nothing, silently."""
    if not getattr(optimizer, "_zeroshard_stepping", False):
        raise RuntimeError("engine.optimizer.step() called directly: zeroshard's optimizer steps the "
                           "fp32 shards only inside engine.step(), which first reduces, unscales and "
                           "clips the gradients (on its own it would update nothing); call "
                           "engine.step() instead")


def sharded_step(flats: list[FlatParam], optimizer: torch.optim.Optimizer, comm: Comm, scaler: LossScaler,
                 max_norm: float, norm_is_sharded: bool, step: int, sub_group_size: int,
                 delayed: Copier | None = None,
                 after_update: Callable[[], None] = lambda: None,
                 guard: NonFiniteGuard | None = None) -> float:
    """Unscale, clip by the global norm, skip on overflow, update, write back; `after_update` runs
    once the update is done (not on a skipped step). Returns the global gradient norm, measured at
    every step as DeepSpeed and torch DDP under Trainer measure it (logged as grad_norm), clipping
    or not.

    The norm is one scalar all-reduce over the ranks' shards (stage 0 ranks hold identical reduced
    gradients, so there it is local), and one over tp when the model is split; a non-finite
    element anywhere makes it non-finite on every rank, so all ranks skip (or raise) together.
    Clipping matches torch.nn.utils.clip_grad_norm_ on the full model.

    With `delayed` (ZeRO-Offload's delayed parameter update), the parameters first take the update
    of the previous step, then this step's update starts on a worker thread and overlaps the next
    forward and backward: the gradient of step t is computed with the weights of step t-1.

    Without a loss scaler, `guard` (nonfinite.py) turns a non-finite norm (or loss) into an error
    or a skipped step; with one, an overflow skips the step and lowers the scale.
    """
    trainable = [f for f in flats if f.trainable]
    guard = None if scaler.enabled else guard
    squares = torch.zeros((), dtype=torch.float32, device=comm.device)
    for f in trainable:  # under tp, a replicated buffer counts once: on tp rank 0
        if f.tp_sharded or comm.tp_rank == 0:
            squares += squared_norm(f.local_grad()).to(comm.device)
    if guard is not None:
        squares = guard.fold_into_norm(squares, norm_is_sharded)
    if norm_is_sharded:
        comm.all_reduce(squares)
    comm.all_reduce_tp(squares)  # each tp shard's part of the norm
    norm = squares.sqrt().item() / scaler.scale
    nonfinite = not math.isfinite(norm)
    overflow = scaler.enabled and nonfinite
    if scaler.enabled:
        scaler.update(overflow, step)
    # Offload: wait for the gradients on the host, on this thread (never the worker's: the copies
    # are this thread's). This also outlasts every gather of backward that read a host shard, so
    # the delayed write-back below may write the shards.
    for f in trainable:
        f.fetch_grad()
    if delayed is not None:
        delayed.finish_update()
        if delayed.unwritten:
            _write_back(trainable)
            delayed.unwritten = False
    if overflow:
        return norm
    if guard is not None:
        if nonfinite:
            guard.handle(trainable, step)  # raises, or counts the skip
            return norm
        guard.end_cycle()
    factor = 1.0 / scaler.scale
    if max_norm > 0:
        factor *= min(1.0, max_norm / (norm + 1e-6))
    if delayed is None:
        _update(trainable, optimizer, factor, sub_group_size, write_back=True)
        after_update()
    else:
        delayed.start_update(lambda: _update(trainable, optimizer, factor, sub_group_size, False),
                             then=after_update)
    return norm


_NORM_CHUNK = 1 << 22  # elements: bounds the fp32 temporary, and reads the buffer in cache-sized pieces


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of squares of `grad`, without an fp32 copy of the whole shard. On a GPU one
    norm kernel reads 16-bit input straight into fp32 accumulators. On the CPU a 16-bit reduction
    copies its input first and vector_norm sums 1e8 floats 2% off, so the squares are summed
    chunk by chunk: a 16 MiB temporary, and ~4x faster than one pass over a large buffer."""
    if grad.is_cuda:
        return torch.linalg.vector_norm(grad, dtype=torch.float32).square()
    total = torch.zeros((), dtype=torch.float32, device=grad.device)
    for chunk in grad.reshape(-1).split(_NORM_CHUNK):
        total += chunk.float().pow(2).sum()
    return total


def _update(trainable: list[FlatParam], optimizer: torch.optim.Optimizer, factor: float,
            sub_group_size: int, write_back: bool) -> None:
    """Step the optimizer one sub-group at a time (DeepSpeed's sub_group_size bounds the fp32
    gradient copies alive at once), writing each back unless the caller does so later."""
    groups = stream_groups(sub_groups(trainable, sub_group_size), optimizer)  # disk offload: streamed
    landing: list = []  # the post-step gathers in flight, over every sub-group
    try:
        for group in groups:
            for f in group:  # fp32 gradient copies for one sub-group at a time
                f.attach_master_grad(factor)
            with temporarily(optimizer, "_zeroshard_stepping", True):
                optimizer.step()  # steps only the parameters that have a gradient: this sub-group's
            for f in group:
                f.release_master_grad()
            if write_back:  # issues the post-step all-gathers (stages 1-2): in flight as we go on
                write_back_together(group, landing)
    finally:  # even if a step failed (out of memory): no parameter is left a placeholder
        groups.close()
        for f in trainable:
            f.release_master_grad()
            if write_back:
                f.finish_write_back()


def _write_back(trainable: list[FlatParam]) -> None:
    try:
        write_back_together(trainable, [])
    finally:
        for f in trainable:
            f.finish_write_back()


def sub_groups(flats: list[FlatParam], size: int) -> list[list[FlatParam]]:
    """Consecutive buffers whose owned elements add up to at most `size` (a larger buffer alone).
    The same on every rank (shards are equal), so the write-backs' collectives pair up."""
    groups: list[list[FlatParam]] = []
    total = 0
    for f in flats:
        if not groups or total + f.master.numel() > size:
            groups.append([])
            total = 0
        groups[-1].append(f)
        total += f.master.numel()
    return groups
