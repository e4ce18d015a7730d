"""The config's "scheduler" section: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, step by
step. The expected rates are DeepSpeed's formulas written out by hand (the implementation was also
checked against DeepSpeed 0.19.8's own classes, equal to 1e-18, outside CI); the engine builds and
steps the schedule; a bad section is refused by name at load."""
from __future__ import annotations

import math

import pytest
import torch

import zeroshard
from zeroshard.config.sections import SchedulerConfig
from zeroshard.core.schedules import DeepSpeedSchedule

LOG2_3 = math.log(2) / math.log(3)


@pytest.mark.parametrize("kind, params, expected", [
    # DeepSpeed sets iteration -1 when built: the lr of the first step is warmup_min_lr (or 0).
    ("WarmupLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 1.1, "warmup_num_steps": 4, "warmup_type": "linear"},
     [0.1, 0.1, 0.35, 0.6, 0.85, 1.1, 1.1]),
    ("WarmupDecayLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 3, "total_num_steps": 7},  # log warm-up
     [0.0, 0.0, LOG2_3, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]),
    ("WarmupCosineLR", {"warmup_num_steps": 2, "total_num_steps": 6, "cos_min_ratio": 0.0,
                        "warmup_type": "linear"},
     [0.0, 0.0, 0.5, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 - math.cos(math.pi / 4)) / 2, 0.0, 0.0]),
])
def test_each_schedule_step_by_step(kind, params, expected):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = DeepSpeedSchedule(optimizer, SchedulerConfig(kind, params))
    rates = []
    for _ in expected:
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates == pytest.approx(expected, abs=1e-12)


def test_the_engine_builds_and_steps_the_section(one_process_group):
    # (the type in any case, as the optimizer's: a ported config's "warmuplr" means WarmupLR)
    config = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
              "scheduler": {"type": "warmuplr", "params": {"warmup_num_steps": 2, "warmup_type": "linear"}}}
    engine = zeroshard.initialize(torch.nn.Linear(4, 2), config=config)
    assert isinstance(engine.lr_scheduler, DeepSpeedSchedule)
    rates = []
    for _ in range(4):
        rates.append(engine.optimizer.param_groups[0]["lr"])
        engine.backward(engine(torch.ones(3, 4)).sum())
        engine.step()
    assert rates == [0.0, 0.0, 0.5, 1.0]  # warmup_max_lr: the optimizer's lr
    with pytest.raises(zeroshard.ConfigError, match=r"\"scheduler\" section and initialize\(\) got"):
        zeroshard.initialize(torch.nn.Linear(4, 2), config=config, lr_scheduler=lambda opt: None)
    config["scheduler"]["params"]["warmup_max_lr"] = [1.0, 0.5]  # one per group: there is one group
    with pytest.raises(zeroshard.ConfigError, match="'scheduler.params.warmup_max_lr' gives 2 learning "
                                                    "rates for 1 parameter groups"):
        zeroshard.initialize(torch.nn.Linear(4, 2), config=config)


def test_a_resumed_run_follows_its_own_config(one_process_group, tmp_path):
    # Saved 2 steps into WarmupDecayLR over 4 steps, resumed with 10: the position is restored, the
    # schedule is the new config's (DeepSpeed saves only its iteration). Warm-up: linear over 2.
    def engine(total: int):
        torch.manual_seed(0)
        section = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1.0, "warmup_num_steps": 2,
                                                       "warmup_type": "linear", "total_num_steps": total}}
        config = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
                  "scheduler": section}
        return zeroshard.initialize(torch.nn.Linear(4, 2), config=config)

    def steps(e, n: int) -> list[float]:
        rates = []
        for _ in range(n):
            rates.append(e.optimizer.param_groups[0]["lr"])
            e.backward(e(torch.ones(3, 4)).sum())
            e.step()
        return rates
    first = engine(4)
    assert steps(first, 2) == [0.0, 0.0]
    first.save_checkpoint(str(tmp_path))
    resumed = engine(10)
    resumed.load_checkpoint(str(tmp_path))
    assert steps(resumed, 4) == pytest.approx([0.5, 1.0, 7 / 8, 6 / 8])  # (total - i) / (total - 2)


@pytest.mark.parametrize("section, words", [
    ({"type": "OneCycle"}, "'scheduler.type' is 'OneCycle'; zeroshard runs DeepSpeed's WarmupLR"),
    ({"type": "WarmupDecayLR"}, "'scheduler.params.total_num_steps' is required by WarmupDecayLR"),
    ({"type": "WarmupLR", "params": {"warmup_steps": 5}}, "unknown config key 'scheduler.params.warmup_step"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "must be \"log\" or \"linear\""),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "warmup_num_steps' must be an integer >= 1"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}, "is \"auto\": a placeholder"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": 2}}, "<= 1"),
])
def test_a_bad_section_is_named(section, words):
    with pytest.raises(zeroshard.ConfigError) as error:
        zeroshard.Config.load({"scheduler": section})
    assert words in str(error.value), str(error.value)
