"""The pipelined offloaded update (core/pipeline.py): the same training, to the bit, as the
sequential update it replaces, at every stage; the next forward waits for each buffer's own update
and reads nothing before it; a checkpoint right after a pipelined step holds the update; an error in
the update is raised (and keeps being raised) until a checkpoint is loaded, and training then goes
on as if it had never happened. On CPU, where host and device are one memory: the worker thread
and the next forward really do run at once."""
from __future__ import annotations

import os
import tempfile
import time
import warnings

import pytest
import torch

import zeroshard
from helpers.models import TinyGPT, batches, loss_fn
from helpers.spawn import spawn
from zeroshard.core import pipeline as pipeline_module
from zeroshard.core.flat_param import FlatParam
from zeroshard.offload import host_step

STEPS, GLOBAL_BATCH = 4, 12
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}


def _engine(config: dict, pipelined: bool, scheduler: bool = True):
    torch.manual_seed(0)
    config = {**config, "zeroshard": {**config.get("zeroshard", {}), "pipelined_update": pipelined}}
    sched = (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7)) if scheduler else None
    adamw = lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True)  # noqa: E731
    return zeroshard.initialize(TinyGPT(), adamw, config, lr_scheduler=sched)


def _train(engine, rank: int, world_size: int, steps: range) -> list[float]:
    local, micro = GLOBAL_BATCH // world_size, engine.config.gradient_accumulation_steps
    data, losses = batches(steps.stop, GLOBAL_BATCH), []
    for step in steps:
        x, y = data[step]
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        for m in range(micro):
            part = slice(m * local // micro, (m + 1) * local // micro)
            loss = loss_fn(engine(x[part], use_sometimes=step % 2 == 0).float(), y[part])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


CASES = [  # (stage, precision, extra zero_optimization, clipping, accumulation)
    (1, "fp32", {}, 0.0, 1),
    (2, "bf16", {}, 0.5, 2),
    (3, "bf16", {}, 0.5, 2),
    (3, "fp32", {"offload_param": {"device": "cpu"}}, 1.0, 1),
    (3, "fp16", {}, 0.5, 1),  # the first step overflows: skipped, nothing pipelined
]


def _parity(rank: int, world_size: int) -> None:
    for stage, precision, extra, clipping, accumulation in CASES:
        config = {"zero_optimization": {"stage": stage, **OFFLOAD, **extra}, "gradient_clipping": clipping,
                  "gradient_accumulation_steps": accumulation, "bf16": {"enabled": precision == "bf16"}}
        if precision == "fp16":
            config["fp16"] = {"enabled": True, "initial_scale_power": 16, "hysteresis": 1}
        what = f"stage {stage} {precision} {extra} N={world_size}"
        runs = {}
        for pipelined in (False, True):
            engine = _engine(config, pipelined)
            losses = _train(engine, rank, world_size, range(STEPS))
            runs[pipelined] = (losses, engine.full_state_dict(), engine.skipped_steps,
                               engine.lr_scheduler.last_epoch)
            started = engine.pipeline.started if engine.pipeline is not None else 0
            assert started == (STEPS - engine.skipped_steps if pipelined else 0), what
        (losses, state, skipped, epoch), (p_losses, p_state, p_skipped, p_epoch) = runs[False], runs[True]
        assert p_losses == losses and (p_skipped, p_epoch) == (skipped, epoch), what
        assert all(torch.equal(p_state[k], v) for k, v in state.items()), what


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_pipelined_update_is_the_sequential_one(world_size):
    spawn(_parity, world_size)


def _trace(rank: int, world_size: int) -> None:
    """One buffer's update made slow: the next forward waits for that buffer alone, and no buffer's
    shard is read (gathered) before its update has ended."""
    engine = _engine({"zero_optimization": {"stage": 3, **OFFLOAD}}, pipelined=True)
    _train(engine, rank, world_size, range(1))  # a first step: the state exists, the units are known
    engine.wait_for_parameters()  # (its update ends before the tracing starts)
    flats = [f for f in engine.flats if f.trainable]
    slow = flats[len(flats) // 2]
    label = {id(f.opt_param): f.label for f in flats}
    events: list[tuple[str, str, float]] = []
    update, shard_on_device, wait = host_step.update, FlatParam._shard_on_device, pipeline_module.Pending.wait

    def slow_update(optimizer, param, *args, **kwargs):
        if param is slow.opt_param:
            time.sleep(1.0)
        update(optimizer, param, *args, **kwargs)
        events.append(("updated", label[id(param)], time.monotonic()))

    def timed_wait(self, flat, raise_error):
        start = time.monotonic()
        wait(self, flat, raise_error)
        events.append(("waited", flat.label, time.monotonic() - start))

    def read(self):
        shard = shard_on_device(self)
        if self.trainable:
            events.append(("read", self.label, time.monotonic()))
        return shard
    patched = (host_step, "update", slow_update), (FlatParam, "_shard_on_device", read), \
        (pipeline_module.Pending, "wait", timed_wait)
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, fn in patched:
        setattr(owner, name, fn)
    try:
        _train(engine, rank, world_size, range(1, 3))
        engine.wait_for_parameters()
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    updated, checked = {}, 0
    for kind, name, t in events:
        if kind == "updated":
            updated.setdefault(name, []).append(t)
        elif kind == "read" and name in updated:  # (before: the first forward, of an untimed update)
            assert t >= updated[name][-1], (name, events)  # a read follows its buffer's latest update
            checked += 1
    assert checked >= len(flats), events
    long_waits = {name for kind, name, seconds in events if kind == "waited" and seconds > 0.5}
    assert long_waits == {slow.label}, (long_waits, slow.label)
    assert all(len(times) == 2 for times in updated.values()) and len(updated) == len(flats), updated


def test_the_next_forward_waits_for_each_buffer_alone():
    spawn(_trace, 2)


def _scheduler_after_a_slow_first_update(rank: int, world_size: int) -> None:
    """The lr scheduler steps right after engine.step(), while the pipelined update may not have
    begun on its worker: torch must not take that for a scheduler stepped before its optimizer."""
    run = pipeline_module.PipelinedUpdate._run

    def late(self, *args):
        time.sleep(0.3)
        return run(self, *args)
    pipeline_module.PipelinedUpdate._run = late
    engine = _engine({"zero_optimization": {"stage": 2, **OFFLOAD}}, pipelined=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(engine, rank, world_size, range(2))
        engine.wait_for_parameters()
    assert engine.pipeline.started == 2 and engine.lr_scheduler.last_epoch == 2
    assert not [w.message for w in caught if "lr_scheduler.step()" in str(w.message)]


def test_no_scheduler_warning_while_the_first_update_is_pending():
    spawn(_scheduler_after_a_slow_first_update, 1)


def _checkpoint_and_failure(rank: int, world_size: int, root: str) -> None:
    config = {"zero_optimization": {"stage": 3, **OFFLOAD}, "gradient_clipping": 1.0}
    sequential = _engine(config, pipelined=False)
    _train(sequential, rank, world_size, range(2))
    after_two = sequential.full_state_dict()
    engine = _engine(config, pipelined=True)
    _train(engine, rank, world_size, range(2))
    engine.save_checkpoint(root)  # right after a pipelined step: the checkpoint holds its update
    loaded = _engine(config, pipelined=True)
    loaded.load_checkpoint(root)
    state = loaded.full_state_dict()
    assert all(torch.equal(state[k], v) for k, v in after_two.items())
    # An update that fails on its third buffer: the next forward raises, and so does every call
    # after it, until a checkpoint is loaded; then training goes on as the sequential run does.
    third = [f for f in engine.flats if f.trainable][2].opt_param
    update = host_step.update

    def failing(optimizer, param, *args, **kwargs):
        if param is third:
            raise MemoryError("injected: the host ran out of memory")
        update(optimizer, param, *args, **kwargs)
    host_step.update = failing
    try:
        _train(engine, rank, world_size, range(2, 3))  # returns: the update fails later, on the worker
        for attempt in (lambda: _train(engine, rank, world_size, range(3, 4)), engine.full_state_dict,
                        lambda: engine.save_checkpoint(os.path.join(root, "never"))):
            with pytest.raises(zeroshard.core.pipeline.UpdateFailed, match="injected") as caught:
                attempt()
            assert "load a checkpoint" in str(caught.value)
            assert isinstance(caught.value.__cause__, MemoryError)
    finally:
        host_step.update = update
    assert not os.path.exists(os.path.join(root, "never"))
    engine.load_checkpoint(root)
    losses = _train(engine, rank, world_size, range(2, STEPS))
    assert losses == _train(sequential, rank, world_size, range(2, STEPS))
    state, expected = engine.full_state_dict(), sequential.full_state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items())


def test_checkpoints_and_a_failed_update():
    with tempfile.TemporaryDirectory() as root:
        spawn(_checkpoint_and_failure, 2, root)
