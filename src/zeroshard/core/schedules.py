"""DeepSpeed's learning-rate schedules, from the config's "scheduler" section, as torch schedulers.

    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100, "total_num_steps": 1000}}

WarmupLR warms up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then holds;
WarmupDecayLR then decays linearly to 0 at total_num_steps; WarmupCosineLR warms up a ratio of each
group's lr from warmup_min_ratio to 1, then follows a cosine down to cos_min_ratio. Warm-up is
logarithmic (warmup_type "log", DeepSpeed's default) or "linear".

Invariant: the learning rate of every step equals DeepSpeed's. DeepSpeed sets the lr of iteration
-1 when it builds the schedule and steps it after each optimizer step; a torch scheduler sets epoch
0 when built and is stepped likewise, so epoch e here is DeepSpeed's iteration e - 1.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from ..config.sections import ConfigError, SchedulerConfig


def scheduler_factory(lr_scheduler: Any, section: SchedulerConfig | None) -> Callable | None:
    """What the engine builds its scheduler with, over its own optimizer: initialize's lr_scheduler
    (a callable optimizer -> scheduler), or the config's "scheduler" section; never both."""
    if hasattr(lr_scheduler, "state_dict"):
        raise TypeError("lr_scheduler must be a callable optimizer -> scheduler (e.g. lambda opt: "
                        "StepLR(opt, 10)): a scheduler instance was built over another optimizer, "
                        "not over engine.optimizer, and would change nothing")
    if section is None:
        return lr_scheduler
    if lr_scheduler is not None:
        raise ConfigError("the config has a \"scheduler\" section and initialize() got lr_scheduler=: "
                          "the engine steps one schedule; remove one of them")
    return partial(DeepSpeedSchedule, config=section)


def refuse_metric_schedule(scheduler: Any) -> None:
    """The engine steps its scheduler after each update, with no argument: one that needs a metric
    (ReduceLROnPlateau) is refused at initialize, not at the first step, half-way through it."""
    if isinstance(scheduler, ReduceLROnPlateau):
        raise TypeError("lr_scheduler= ReduceLROnPlateau steps on a metric, which the engine's step() "
                        "does not have: leave it out of initialize(), build it over engine.optimizer, "
                        "and call its step(val_loss) yourself after each evaluation")


class DeepSpeedSchedule(LRScheduler):
    """One of DeepSpeed's three warm-up schedules (see the module docstring)."""

    def __init__(self, optimizer: Optimizer, config: SchedulerConfig) -> None:
        p, groups = config.params, len(optimizer.param_groups)
        self.kind = config.type
        self.warmup = max(2, int(p.get("warmup_num_steps", 1000)))
        self.total = int(p.get("total_num_steps", 0))
        self.log_warmup = p.get("warmup_type", "log") == "log"
        if self.kind == "WarmupCosineLR":
            self.min_ratio, self.cos_min = p.get("warmup_min_ratio", 0.0), p.get("cos_min_ratio", 1e-4)
        else:
            default_max = 0.001 if self.kind == "WarmupDecayLR" else [g["lr"] for g in optimizer.param_groups]
            self.min_lrs = _per_group("warmup_min_lr", p.get("warmup_min_lr", 0.0), groups)
            self.max_lrs = _per_group("warmup_max_lr", p.get("warmup_max_lr", default_max), groups)
        super().__init__(optimizer)

    def state_dict(self) -> dict:
        """Only the position, as DeepSpeed saves only its iteration: a resumed run follows its own
        config's schedule (a longer total_num_steps, say), not the one it was saved with."""
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count, "_last_lr": self._last_lr}

    def load_state_dict(self, state_dict: dict) -> None:
        self.__dict__.update({k: state_dict[k] for k in ("last_epoch", "_step_count", "_last_lr")})

    def _warmed(self, iteration: int) -> float:
        """The warm-up's progress, 0 to 1, at `iteration` (< warmup)."""
        return math.log(iteration + 1) / math.log(self.warmup) if self.log_warmup else iteration / self.warmup

    def get_lr(self) -> list[float]:
        iteration = self.last_epoch - 1
        if self.kind == "WarmupCosineLR":
            return [base * self._cosine_ratio(iteration) for base in self.base_lrs]
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.warmup:
            gamma = self._warmed(iteration)
        elif self.kind == "WarmupDecayLR":
            gamma = max(0.0, (self.total - iteration) / max(1.0, self.total - self.warmup))
        else:
            gamma = 1.0
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def _cosine_ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup:
            return self.min_ratio + self._warmed(iteration) * (1.0 - self.min_ratio)
        progress = min(1.0, (iteration - self.warmup + 1) / max(1, self.total - self.warmup))
        return max(0.0, self.cos_min + (1.0 - self.cos_min) * (1 + math.cos(math.pi * progress)) / 2)


def _per_group(key: str, value: float | list[float], groups: int) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * groups
    if len(values) != groups:
        raise ConfigError(f"config key 'scheduler.params.{key}' gives {len(values)} learning rates for "
                          f"{groups} parameter groups: give one number, or one per group")
    return [float(v) for v in values]
