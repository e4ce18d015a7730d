"""Bad models, optimizers and mismatched ranks: clear errors, never a hang or a silent corruption."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from helpers.spawn import spawn
from helpers.models import TinyGPT


pytestmark = pytest.mark.usefixtures("one_process_group")


def _adam(p):
    return torch.optim.Adam(p, lr=1e-3)


def test_model_without_trainable_parameters():
    model = nn.Linear(3, 3).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        zeroshard.initialize(model, _adam)


def test_not_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        zeroshard.initialize(lambda x: x, _adam)


def test_mixed_dtypes_and_meta_device():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match="one floating dtype"):
        zeroshard.initialize(model, _adam)
    with pytest.raises(ValueError, match="meta device"):
        zeroshard.initialize(nn.Linear(2, 2, device="meta"), _adam)


def test_optimizer_forms():
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match="not an instance"):
        zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="exactly the `params`"):
        zeroshard.initialize(nn.Linear(4, 4), lambda p: torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(zeroshard.ConfigError, match="no optimizer"):
        zeroshard.initialize(nn.Linear(4, 4))
    with pytest.raises(zeroshard.ConfigError, match="could not build the optimizer"):
        zeroshard.initialize(nn.Linear(4, 4), config={"optimizer": {"type": "Adam", "params": {"lrr": 1}}})
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        zeroshard.initialize(nn.Linear(4, 4), lambda p: 3)
    with pytest.raises(zeroshard.ConfigError, match="two optimizers: the callable .<lambda>. and"):
        zeroshard.initialize(nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.5),
                             {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    engine = zeroshard.initialize(nn.Linear(4, 4), torch.optim.SGD,
                                  {"optimizer": {"type": "sgd", "params": {"lr": 0.5}}})
    assert isinstance(engine.optimizer, torch.optim.SGD) and engine.optimizer.param_groups[0]["lr"] == 0.5
    with pytest.raises(zeroshard.ConfigError, match="class SGD and the config's .* type 'AdamW' disagree"):
        zeroshard.initialize(nn.Linear(4, 4), torch.optim.SGD, {"optimizer": {"type": "AdamW"}})
    with pytest.raises(zeroshard.ConfigError, match="class Adam and .* type 'AdamW' .a section of type "
                       "\"Adam\" is DeepSpeed's: AdamW, decoupled weight decay, unless \"adam_w_mode\": "
                       "false. disagree"):
        zeroshard.initialize(nn.Linear(4, 4), torch.optim.Adam, {"optimizer": {"type": "Adam"}})
    engine = zeroshard.initialize(nn.Linear(4, 4),
                                  config={"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    assert isinstance(engine.optimizer, torch.optim.AdamW)


def test_parameter_groups():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    decay = [model[0].weight]
    no_decay = [model[0].bias, model[1].weight, model[1].bias]
    engine = zeroshard.initialize(model, lambda p: torch.optim.AdamW(p, lr=0.1),
                                  param_groups=[{"params": decay, "weight_decay": 0.1},
                                                {"params": no_decay, "weight_decay": 0.0}])
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0]
    with pytest.raises(ValueError, match="in no parameter group"):
        zeroshard.initialize(nn.Linear(4, 4), _adam, param_groups=[{"params": []}])
    twice = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="two parameter groups"):
        zeroshard.initialize(twice, _adam, param_groups=[{"params": [twice.weight]},
                                                          {"params": [twice.weight, twice.bias]}])
    with pytest.raises(ValueError, match="not a parameter of the model"):
        zeroshard.initialize(nn.Linear(4, 4), _adam, param_groups=[{"params": [torch.zeros(2)]}])
    # torch's other form, the parameters themselves (DeepSpeed's model_parameters=model.parameters()):
    # one group of the trainable ones. Anything else is named with the forms it takes.
    partly = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    partly[0].bias.requires_grad_(False)
    engine = zeroshard.initialize(partly, _adam, model_parameters=partly.parameters())
    assert len(engine.optimizer.param_groups) == 1 and engine.num_parameters(trainable_only=True) == 21
    with pytest.raises(TypeError, match="param_groups takes torch's forms"):
        zeroshard.initialize(nn.Linear(4, 4), _adam, param_groups=["weight"])


def test_deepspeed_initialize_habits_are_answered():
    with pytest.raises(TypeError, match="'training_data' \\(deepspeed.initialize's; here: build your own"):
        zeroshard.initialize(nn.Linear(4, 4), _adam, training_data=[1, 2])
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'$"):
        zeroshard.initialize(nn.Linear(4, 4), _adam, bogus=1)
    with pytest.raises(TypeError, match="returns the engine alone, not DeepSpeed's"):
        engine, optimizer, _, scheduler = zeroshard.initialize(nn.Linear(4, 4), _adam)
    with pytest.raises(AttributeError, match="train_batch': DeepSpeed's pipeline engine's call"):
        zeroshard.initialize(nn.Linear(4, 4), _adam).train_batch()


def test_unit_modules_must_exist():
    with pytest.raises(ValueError, match="no submodule has that class"):
        zeroshard.initialize(TinyGPT(), _adam, {"zeroshard": {"unit_modules": ["Blok"]}})
    with pytest.raises(ValueError, match="the model itself is always the root unit.*classes are \\['Block'"):
        zeroshard.initialize(TinyGPT(), _adam, {"zeroshard": {"unit_modules": ["TinyGPT"]}})
    with pytest.raises(ValueError, match="names \\['ModuleList'\\], which has no forward of its own"):
        zeroshard.initialize(TinyGPT(), _adam, {"zeroshard": {"unit_modules": ["ModuleList"]}})


def test_non_scalar_loss():
    engine = zeroshard.initialize(nn.Linear(4, 4), _adam)
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(engine(torch.ones(2, 4)))


def _mismatch(rank: int, world_size: int, what: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT(d=16 if rank == 0 or what != "model" else 20)
    stage = 2 if rank == 0 or what != "config" else 3
    lr = 1e-2 if rank == 0 or what != "optimizer" else 1e-1  # each shard stepped with its own: silent
    with pytest.raises(zeroshard.ModelMismatchError) as err:
        zeroshard.initialize(model, lambda p: torch.optim.Adam(p, lr=lr),
                             {"zero_optimization": {"stage": stage}})
    expected = {"model": "parameter pos (8, 16)", "config": '"stage": 2',
                "optimizer": "ranks disagree on the optimizer: rank 0 has 'param group 0: lr=0.01', "
                             "rank 1 has 'param group 0: lr=0.1'"}[what]
    assert "rank 1" in str(err.value) and expected in str(err.value), str(err.value)


@pytest.mark.parametrize("what", ["model", "config", "optimizer"])
def test_mismatched_ranks_are_refused_on_every_rank(what):
    spawn(_mismatch, 2, what)


@pytest.mark.parametrize("config", [{"zero_optimization": {"stage": 3}},
                                    {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}])
def test_a_failed_initialize_leaves_the_model_usable(config):
    torch.manual_seed(0)
    model = TinyGPT()
    x = torch.randint(0, 37, (2, 8))
    before = model(x).detach()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(zeroshard.ConfigError, match="could not build the optimizer"):
        zeroshard.initialize(model, config={**config, "optimizer": {"type": "Adam", "params": {"lrr": 1}}})
    assert all(torch.equal(model.state_dict()[k], v) and model.state_dict()[k].dtype == v.dtype
               for k, v in state.items())
    torch.testing.assert_close(model(x), before)
    psi = sum(p.numel() for p in dict(model.named_parameters()).values())
    engine = zeroshard.initialize(model, _adam, config)  # and it can be wrapped once fixed
    assert engine.num_parameters() == psi
