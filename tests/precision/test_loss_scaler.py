"""fp16 dynamic loss scaling against DeepSpeed's semantics, on schedules where overflows land in the
middle of a window and fewer clean steps than the window follow (the hysteresis then stays used up).

The reference is written from DeepSpeed's DynamicLossScaler.update_scale (consecutive_hysteresis
off, the default): it counts iterations and the last overflow's iteration, where zeroshard counts
clean steps in a row, so the two formulations agree only if both are right."""
from __future__ import annotations

import random

import pytest
import torch

import zeroshard
from helpers.models import TinyGPT, loss_fn, rank_batch
from helpers.spawn import spawn
from zeroshard.config import ScalerConfig
from zeroshard.core.precision import LossScaler


class DeepSpeedScaler:
    """DeepSpeed's dynamic loss scaler, update by update (scale factor 2)."""

    def __init__(self, power: int, window: int, hysteresis: int, min_scale: float) -> None:
        self.cur_scale, self.scale_window, self.min_scale = 2.0 ** power, window, min_scale
        self.delayed_shift = self.cur_hysteresis = hysteresis
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise FloatingPointError("minimum loss scale")
                self.cur_scale = max(self.cur_scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= 2
        self.cur_iter += 1


def _expected(schedule: list[bool], power: int, window: int, hysteresis: int, floor: float) -> list:
    """The scale after each step, or 'raise' where the reference gives up."""
    ref, out = DeepSpeedScaler(power, window, hysteresis, floor), []
    for overflow in schedule:
        try:
            ref.update_scale(overflow)
        except FloatingPointError:
            return out + ["raise"]
        out.append(ref.cur_scale)
    return out


def test_the_scaler_follows_deepspeed_on_random_schedules():
    rng = random.Random(0)
    for case in range(400):
        window, hysteresis = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3])
        power, floor = rng.choice([6, 8]), 2.0 ** rng.choice([0, 3, 5])
        schedule = [rng.random() < rng.choice([0.15, 0.35, 0.6]) for _ in range(40)]
        expected = _expected(schedule, power, window, hysteresis, floor)
        scaler = LossScaler(ScalerConfig(loss_scale=0, initial_scale_power=power, loss_scale_window=window,
                                         hysteresis=hysteresis, min_loss_scale=floor), report=False)
        for step, (overflow, want) in enumerate(zip(schedule, expected)):
            what = (case, step, window, hysteresis, schedule[:step + 1])
            if want == "raise":
                with pytest.raises(FloatingPointError, match="minimum loss scale"):
                    scaler.update(overflow, step)
                break
            scaler.update(overflow, step)
            assert scaler.scale == want, what
            assert scaler.skipped_steps == sum(schedule[:step + 1]), what


# Window 4, hysteresis 3: an overflow after 2 clean steps (mid-window), 3 clean steps (fewer than the
# window: no growth, hysteresis not restored), two overflows (the second halves: the hysteresis was
# not restored), a full window (growth, hysteresis back), then overflows down to the floor.
SCHEDULE = [False, False, True, False, False, False, True, True, False, False, False, False,
            True, False, True, True, True, True, True]
POWER, WINDOW, HYSTERESIS, FLOOR = 10, 4, 3, 256.0


def _engine_schedule(rank: int, world_size: int) -> None:
    expected = _expected(SCHEDULE, POWER, WINDOW, HYSTERESIS, FLOOR)
    # The schedule does what it is for: no growth before a full window, a halving once the
    # hysteresis is used up, growth after a full window, and the floor.
    assert expected[:7] == [1024.0] * 7 and expected[7] == 512.0 and expected[11] == 1024.0
    assert expected[-1] == "raise"
    x, y = rank_batch(rank, world_size)
    torch.manual_seed(0)
    model = TinyGPT()
    poison = {"on": False}
    if rank == 1:  # the overflow on one rank only: every rank must take the same decision
        model.blocks[0].up.weight.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    engine = zeroshard.initialize(model, lambda p: torch.optim.SGD(p, lr=0.05), {
        "zero_optimization": {"stage": 3},
        "fp16": {"enabled": True, "initial_scale_power": POWER, "loss_scale_window": WINDOW,
                 "hysteresis": HYSTERESIS, "min_loss_scale": FLOOR}})
    for step, (overflow, want) in enumerate(zip(SCHEDULE, expected)):
        poison["on"] = overflow
        engine.backward(loss_fn(engine(x).float(), y))
        if want == "raise":
            with pytest.raises(FloatingPointError, match="minimum loss scale"):
                engine.step()
            return
        engine.step()
        assert (engine.loss_scale, engine.skipped_steps) == (want, sum(SCHEDULE[:step + 1])), step
        assert engine.was_step_applied() is not overflow, step
    raise AssertionError("the schedule should end at the minimum scale")


def test_the_engine_scales_as_deepspeed_when_overflows_land_mid_window():
    spawn(_engine_schedule, 2)
