"""Building the user's torch optimizer over flat shards, whatever form the user gave it in.

The optimizer never sees a module parameter: it sees one flat tensor per (unit, parameter group),
which is the whole buffer at stage 0 and this rank's shard at stages 1-3. Any torch optimizer works
unchanged because each element is updated independently of the others.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Union

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

from ..config import Config, ConfigError

logger = logging.getLogger("zeroshard")

OptimizerSpec = Union[None, type, Callable[[Any], torch.optim.Optimizer]]
# Optimizers whose update of an element depends on the whole tensor (its shape, norm, factored or
# preconditioning statistics): they cannot run on shards. By class name, torch's and others' alike
# (transformers' Adafactor, bitsandbytes' LAMB and LARS), through subclasses too.
_NOT_ELEMENTWISE = {"Adafactor", "Muon", "LBFGS", "SparseAdam", "LAMB", "Lamb", "LARS", "Lars", "Shampoo",
                    "SOAP"}


_SLOW_WARNED: set[str] = set()
# torch optimizers with a fused CPU kernel (torch >= 2.4).
_FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def warn_if_slow(optimizer: torch.optim.Optimizer) -> None:
    """Once per optimizer class: an Adam-family optimizer over host shards without the fused CPU
    kernel runs several times slower (benchmarks/host_step.py times the fused kernel)."""
    name = type(optimizer).__name__
    slow = isinstance(optimizer, _FUSED_ON_CPU) and not optimizer.defaults.get("fused")
    if slow and name not in _SLOW_WARNED:
        _SLOW_WARNED.add(name)
        logger.warning("offload_optimizer: %s runs over host shards without its fused CPU kernel, "
                       "several times slower; build it with fused=True (e.g. lambda p: "
                       "torch.optim.%s(p, lr=..., fused=True)), or give the optimizer in the "
                       "config's \"optimizer\" section, which does so", name, name)


def prefer_fused(cls: type, kwargs: dict) -> dict:
    """A config-built optimizer over host shards or on a GPU gets torch's fused kernel where it has
    one (as DeepSpeed's "Adam" is its FusedAdam), unless the config chose an implementation itself.
    torch's own classes only: a subclass's __init__ may take no `fused`."""
    if cls in _FUSED_ON_CPU and not {"fused", "foreach"} & set(kwargs):
        return {**kwargs, "fused": True}
    return kwargs


def resolve_groups(model: nn.Module, param_groups: list[dict] | None) -> tuple[list[dict], dict[int, int]]:
    """User parameter groups -> (options per group, group index of each trainable parameter)."""
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    if param_groups is None:
        return [{}], {id(p): 0 for p in trainable}
    param_groups = list(param_groups)
    if param_groups and all(isinstance(g, torch.Tensor) for g in param_groups):
        # torch's other form, DeepSpeed's model_parameters=model.parameters(): one group, of the
        # trainable ones (a frozen one would get no gradient from torch's optimizer either)
        param_groups = [{"params": [p for p in param_groups if p.requires_grad]}]
    if not all(isinstance(g, dict) for g in param_groups):
        raise TypeError("param_groups takes torch's forms: a list of dicts, each with its 'params' (e.g. "
                        "[{'params': decay}, {'params': no_decay, 'weight_decay': 0.0}]), or the parameters "
                        "themselves")
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
            adam = issubclass(spec, torch.optim.Adam) and config.optimizer.type == "AdamW"
            why = (" (a section of type \"Adam\" is DeepSpeed's: AdamW, decoupled weight decay, unless "
                   "\"adam_w_mode\": false)") if adam else ""
            raise ConfigError(f"the optimizer class {spec.__name__} and the config's \"optimizer\" section "
                              f"of type {config.optimizer.type!r}{why} disagree (its params were written "
                              f"for that type); pass optimizer=None to build the section's, or change its "
                              f"type")
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
    on_gpu = any(t.is_cuda for g in groups for t in g["params"])
    if (offloaded or on_gpu) and (spec is None or isinstance(spec, type)):  # the config's kwargs
        kwargs = prefer_fused(cls, kwargs)
    try:
        optimizer = cls(params, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"could not build the optimizer {getattr(cls, '__name__', cls)} with "
                          f"{kwargs} over zeroshard's flat shards: {e}") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"the optimizer callable returned {type(optimizer).__name__}, "
                        f"not a torch.optim.Optimizer")
    whole_tensor = [c for c in type(optimizer).__mro__ if c.__name__ in _NOT_ELEMENTWISE]
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


def has_user_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether step() would run hooks besides zeroshard's guard: the optimizer's own or global ones."""
    own = [h for h in optimizer._optimizer_step_pre_hooks.values() if h is not _refuse_direct_step]
    return bool(own or optimizer._optimizer_step_post_hooks or torch_optimizer._global_optimizer_pre_hooks
                or torch_optimizer._global_optimizer_post_hooks)


def _refuse_direct_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The masters get their gradients only inside engine.step() (reduced, unscaled, clipped):
    engine.optimizer.step() called directly would step nothing, silently."""
    if not getattr(optimizer, "_zeroshard_stepping", False):
        raise RuntimeError("engine.optimizer.step() called directly: zeroshard's optimizer steps the "
                           "fp32 shards only inside engine.step(), which first reduces, unscales and "
                           "clips the gradients (on its own it would update nothing); call "
                           "engine.step() instead")
