"""State kept in enums with guarded transitions: a wrong move is an internal error naming both
states, and the states follow the step as documented (docs/architecture.md)."""
from __future__ import annotations

from enum import Enum

import pytest
import torch

import zeroshard
from helpers.models import TinyGPT, loss_fn, rank_batch
from zeroshard.engine.engine import TrainingState
from zeroshard.core.flat_grad import GradState
from zeroshard.core.reduce import CyclePhase
from zeroshard.common.states import StateError, move

pytestmark = pytest.mark.usefixtures("one_process_group")


class Light(Enum):
    RED = 1
    GREEN = 2
    AMBER = 3


def test_a_wrong_transition_names_both_states():
    allowed = {Light.RED: {Light.GREEN}, Light.GREEN: {Light.AMBER}}
    assert move(Light.RED, Light.GREEN, allowed, "the light") is Light.GREEN
    assert move(Light.AMBER, Light.AMBER, allowed, "the light") is Light.AMBER  # staying is no move
    with pytest.raises(StateError, match="the light cannot go from RED to AMBER"):
        move(Light.RED, Light.AMBER, allowed, "the light")


def _states(engine) -> tuple:
    grads = {f.grad_state for f in engine.flats if f.trainable}
    return engine.state, engine.reducer.phase, grads


@pytest.mark.parametrize("stage, overlap", [(0, False), (1, True), (2, False), (3, True)])
def test_states_follow_the_step(stage, overlap):
    x, y = rank_batch(0, 1)
    torch.manual_seed(0)
    engine = zeroshard.initialize(TinyGPT(), lambda p: torch.optim.SGD(p, lr=0.1), {
        "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage, "overlap_comm": overlap}})
    assert _states(engine) == (TrainingState.IDLE, CyclePhase.ACCUMULATING, {GradState.EMPTY})
    engine.backward(loss_fn(engine(x), y))  # not the boundary: stages 0-1 accumulate locally
    held = GradState.HELD if stage >= 2 else GradState.ACCUMULATING
    assert _states(engine) == (TrainingState.BACKWARD_DONE, CyclePhase.ACCUMULATING, {held})
    engine.step()
    engine.backward(loss_fn(engine(x), y))  # the boundary: reduced in backward where overlap_comm
    if stage >= 2:
        expected = (CyclePhase.ACCUMULATING, {GradState.HELD})
    else:
        expected = (CyclePhase.REDUCED, {GradState.REDUCED}) if overlap else \
            (CyclePhase.ACCUMULATING, {GradState.ACCUMULATING})
    assert _states(engine)[1:] == expected
    engine.step()
    assert _states(engine) == (TrainingState.IDLE, CyclePhase.ACCUMULATING, {GradState.EMPTY})
    with pytest.raises(StateError, match="gradient cannot go from EMPTY to HELD"):
        engine.flats[0]._set_grad_state(GradState.HELD)


def test_modes_are_states_too():
    """no_sync() is the reducer's Sync state, gathered_parameters() the units' Edits, the delayed
    update the copier's Update: each moves through its table and back."""
    from zeroshard.core.guards import Edits
    from zeroshard.core.reduce import Sync
    from zeroshard.offload.host import Copier, Update
    x, y = rank_batch(0, 1)
    torch.manual_seed(0)
    engine = zeroshard.initialize(TinyGPT(), lambda p: torch.optim.SGD(p, lr=0.1),
                                  {"zero_optimization": {"stage": 3}})
    assert engine.reducer.sync is Sync.REDUCE
    with engine.no_sync():
        with engine.no_sync():  # nested: stays LOCAL
            assert engine.reducer.sync is Sync.LOCAL
        assert engine.reducer.sync is Sync.LOCAL
        engine.backward(loss_fn(engine(x), y))
    assert engine.reducer.sync is Sync.REDUCE
    for modifier, inside in ((None, Edits.READ_ONLY), (0, Edits.TAKEN)):
        with engine.gathered_parameters(modifier_rank=modifier):
            assert {u.edits for u in engine.units} == {inside}
        assert {u.edits for u in engine.units} == {Edits.NONE}
    engine.units[0].set_edits(Edits.READ_ONLY)
    with pytest.raises(StateError, match="cannot go from READ_ONLY to TAKEN"):
        engine.units[0].set_edits(Edits.TAKEN)
    engine.units[0].set_edits(Edits.NONE)
    copier = Copier(torch.device("cpu"), delayed=True)
    copier.start_update(lambda: None, then=lambda: None)
    assert copier.update_state is Update.RUNNING
    copier.finish_update()
    assert copier.update_state is Update.UNWRITTEN and copier.unwritten
    copier.written()
    assert copier.update_state is Update.IDLE
