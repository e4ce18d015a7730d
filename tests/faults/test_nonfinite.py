"""bf16/fp32 have no loss scaler: a NaN gradient is found at the step on every rank together, then
raised with the step and the first parameter named, or skipped and counted (on_nonfinite)."""
from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import zeroshard
from zeroshard.core.nonfinite import NonFiniteError
from zeroshard.core.step import decides_on_device
from helpers.models import TinyGPT, loss_fn, rank_batch
from helpers.spawn import spawn


def _poisoned_run(rank: int, world_size: int, stage: int, clip: float, action: str, fused: bool) -> None:
    """fused: torch's fused AdamW, which skips on the device (optim_step.py) with no host sync first."""
    torch.manual_seed(0)
    config = {"zero_optimization": {"stage": stage}, "gradient_clipping": clip,
              "zeroshard": {"on_nonfinite": action}}
    engine = zeroshard.initialize(TinyGPT(d=16, layers=2),
                                  lambda p: torch.optim.AdamW(p, lr=1e-2, fused=fused), config)
    assert decides_on_device(engine.optimizer, [f for f in engine.flats if f.trainable],
                             engine.comm.device) == fused
    x, y = rank_batch(rank, world_size)
    for step in range(4):
        before = engine.full_state_dict() if step == 2 else None
        moments = _optimizer_state(engine) if step == 2 else None
        loss = loss_fn(engine(x), y)
        if step == 2 and rank == 1:
            loss = loss * float("nan")  # one rank's loss only: every rank must agree on the step
        engine.backward(loss)
        try:
            with _warnings() as said:
                engine.step()
            skipped = [m for m in said if "skipped: non-finite gradient" in m]
            assert len(skipped) == (step == 2 and rank == 0), (rank, said)  # one line, from rank 0
        except NonFiniteError as e:
            assert action == "raise" and step == 2, (step, e)
            assert "step 2: non-finite gradient, first in unit" in str(e) and "parameter '" in str(e), e
            assert "the loss was not finite on ranks [1]" in str(e), e
            after = engine.full_state_dict()  # nothing lost: the raised step changed no weight
            assert all(torch.equal(before[k], after[k]) for k in before), "a raised step changed weights"
            return
        if step == 2:  # skipped: weights untouched, and counted on every rank
            after = engine.full_state_dict()
            assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed weights"
            assert all(torch.equal(a, b) for a, b in zip(moments, _optimizer_state(engine), strict=True)), \
                "a skipped step changed the optimizer state"
            assert engine.skipped_steps == 1
    assert action == "skip" and engine.skipped_steps == 1
    assert all(torch.isfinite(v).all() for v in engine.full_state_dict().values() if v.is_floating_point())


def _optimizer_state(engine) -> list[torch.Tensor]:
    """Copies of every optimizer state tensor (moments and step counts), in a fixed order."""
    return [v.clone() for f in engine.flats if f.trainable
            for _, v in sorted(engine.optimizer.state[f.opt_param].items())]


@contextlib.contextmanager
def _warnings():
    """The messages zeroshard's logger warns of inside the block."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("zeroshard")
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)


def _runs(rank: int, world_size: int, action: str, cases: list[tuple[int, float, bool]]) -> None:
    for stage, clip, fused in cases:  # the answer rides on the norm's all-reduce, clipping or not
        _poisoned_run(rank, world_size, stage, clip, action, fused)


@pytest.mark.parametrize("action,cases", [
    ("raise", [(0, 0.0, False), (2, 1.0, False), (3, 0.0, False), (1, 1.0, True), (3, 0.0, True)]),
    ("skip", [(1, 0.0, False), (3, 1.0, False), (0, 1.0, True), (2, 0.0, True), (3, 1.0, True)])])
def test_nonfinite_gradient_is_raised_or_skipped_on_every_rank(action: str, cases) -> None:
    spawn(_runs, 2, action, cases)


def _one_bad_element(rank: int, world_size: int, fused: bool) -> None:
    """An inf in one element of one parameter's gradient on one rank (the norm is measured anyway;
    fused, it also clips: a skipped step's gradient must not be scaled by inf/inf's clip factor),
    then finite elements whose squares overflow fp32 (so would Adam's g²)."""
    for value, expected in ((float("inf"), "parameter 'blocks.1.down.weight' (element 3: inf"),
                            (1e20, "norm: every element is finite, but their squared norm overflowed")):
        torch.manual_seed(0)
        engine = zeroshard.initialize(TinyGPT(d=16, layers=2),
                                      lambda p: torch.optim.AdamW(p, lr=1e-2, fused=fused),
                                      {"zero_optimization": {"stage": 2}, "gradient_clipping": float(fused)})
        target = dict(engine.module.named_parameters())["blocks.1.down.weight"]
        if rank == 1:
            target.register_hook(lambda g: g.flatten().index_fill(0, torch.tensor([3]), value).view_as(g)
                                 if value == float("inf") else torch.full_like(g, value))
        x, y = rank_batch(rank, world_size)
        engine.backward(loss_fn(engine(x), y))
        with pytest.raises(NonFiniteError) as caught:
            engine.step()
        message = str(caught.value)
        assert "step 0: non-finite gradient" in message and expected in message, message  # (or its norm)


@pytest.mark.parametrize("fused", [False, True])
def test_one_inf_element_or_an_overflowing_norm_is_found(fused: bool) -> None:
    spawn(_one_bad_element, 2, fused)


class _OwnStepAdamW(torch.optim.AdamW):
    """A subclass whose step may ignore found_inf: the device cannot be trusted to skip for it."""


@pytest.mark.parametrize("how", ["fused", "subclass", "a group not fused", "a post-hook", "foreach"])
def test_the_step_is_decided_on_the_device_only_where_the_optimizer_honours_it(one_process_group, how):
    """Only torch's own fused Adam/AdamW, fused in every group and with no user step hooks, skips on
    the device; anything else decides on the host, where a skipped step calls no step() at all."""
    torch.manual_seed(0)
    model = TinyGPT(d=16, layers=2)
    cls = _OwnStepAdamW if how == "subclass" else torch.optim.AdamW
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in trained if n.startswith("blocks.")],
               "fused": how != "a group not fused"},
              {"params": [p for n, p in trained if not n.startswith("blocks.")]}]
    engine = zeroshard.initialize(model, lambda p: cls(p, lr=1e-2, fused=how != "foreach"),
                                  {"zeroshard": {"on_nonfinite": "skip"}, "gradient_clipping": 1.0},
                                  param_groups=groups)
    posted = []
    if how == "a post-hook":
        engine.optimizer.register_step_post_hook(lambda *_: posted.append(1))
    trainable = [f for f in engine.flats if f.trainable]
    assert decides_on_device(engine.optimizer, trainable, engine.comm.device) == (how == "fused")
    x, y = rank_batch(0, 1)
    before = engine.full_state_dict()
    engine.backward(loss_fn(engine(x), y) * float("nan"))
    engine.step()  # skipped on either path; a group that is not fused never sees found_inf
    assert engine.skipped_steps == 1 and not posted
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
