"""engine.gathered_parameters(): the full weights in the module outside forward at every stage, and
one rank's in-place changes becoming the training state on every rank, compared with one process
that trains the same changed model."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from zeroshard.engine.engine import TrainingState
from helpers.models import TinyGPT, assert_weights_match, batches, loss_fn, reference_run
from helpers.spawn import spawn

GLOBAL_BATCH, STEPS = 6, 2
CHANGED = {"blocks.1.up.bias": lambda t: t + 1.0, "frozen.weight": lambda t: t * 2.0,  # a frozen one
           "tok.weight": lambda t: t.index_fill(0, torch.tensor([3]), 0.5)}  # tied with head.weight


def _sgd(p):
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


def _change(model: torch.nn.Module) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, how in CHANGED.items():
            params[name].copy_(how(params[name]))


def _changed_model() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT()
    _change(model)
    return model


def _offload(where: str, directory: str) -> dict:
    """Where the masters and shards rest: "" on the device; "cpu" in host memory; "nvme" the
    parameters in files with a host cache of shards (written through their maps)."""
    if where == "cpu":
        return {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    if where == "nvme":
        return {"offload_param": {"device": "nvme", "nvme_path": directory, "max_in_cpu": 10**8}}
    return {}


def _gathered(rank: int, world_size: int, stage: int, precision: str, offload: str, directory: str) -> None:
    torch.manual_seed(0)
    config = {"zero_optimization": {"stage": stage, **_offload(offload, directory)},
              "bf16": {"enabled": precision == "bf16"}}
    engine = zeroshard.initialize(TinyGPT(), _sgd, config)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    before = engine.full_state_dict()
    # Changes that do not count are undone on every rank: without modifier_rank, or when the block raises.
    with engine.gathered_parameters() as model:
        if rank == 0:
            _change(model)
    with pytest.raises(KeyError):
        with engine.gathered_parameters(modifier_rank=0) as model:
            if rank == 0:
                _change(model)
            raise KeyError("a failure inside the block")
    with engine.gathered_parameters() as model:  # reading: the same full values on every rank
        for name, p in model.named_parameters():
            assert p.shape == before[name].shape and torch.equal(p, before[name].to(dtype)), name
    with engine.gathered_parameters(modifier_rank=world_size - 1) as model:
        if rank == world_size - 1:  # the others' changes would not count; they make none
            _change(model)
    after = engine.full_state_dict()
    aliases = {"head.weight": "tok.weight"}
    for name, value in before.items():
        how = CHANGED.get(aliases.get(name, name))
        if how is None:  # untouched: the fp32 master keeps its full precision, bit for bit
            assert torch.equal(after[name], value), name
        else:  # each changed element is what the modifier wrote (in the compute dtype); the rest keep
            seen = value.to(dtype)  # their fp32 values
            assert torch.equal(after[name], torch.where(how(seen) != seen, how(seen).float(), value)), name
    if stage == 3:
        assert all(p.numel() == 0 for p in engine.module.blocks[0].parameters())  # freed again
    with torch.no_grad(), engine.gathered_parameters():
        if rank == 0:  # DeepSpeed's "gather, then generate on rank 0": no collective, so no hang
            engine(batches(1, 2)[0][0])
    local = GLOBAL_BATCH // world_size
    for step, (x, y) in enumerate(batches(STEPS, GLOBAL_BATCH)):
        mine = slice(rank * local, (rank + 1) * local)
        engine.backward(loss_fn(engine(x[mine], use_sometimes=step % 2 == 0), y[mine]))
        engine.step()
    if precision == "fp32":
        reference = reference_run(_changed_model, _sgd, STEPS, GLOBAL_BATCH)[0].state_dict()
        assert_weights_match(engine, reference, 1e-5, 2e-6, f"changed in gathered_parameters, stage {stage}:")


@pytest.mark.parametrize("world_size, stage, precision, offload", [
    (3, 3, "fp32", ""), (2, 3, "bf16", ""), (3, 2, "bf16", ""), (2, 1, "fp32", ""), (3, 0, "bf16", ""),
    (3, 0, "fp32", ""), (2, 3, "bf16", "cpu"), (3, 3, "fp32", "cpu"), (2, 3, "fp32", "nvme")])
def test_gathered_parameters_read_and_change(tmp_path, world_size, stage, precision, offload):
    spawn(_gathered, world_size, stage, precision, offload, str(tmp_path))


def test_gathered_parameters_refusals(one_process_group, tmp_path):
    engine = zeroshard.initialize(TinyGPT(), _sgd, {"zero_optimization": {"stage": 3}})
    engine.save_16bit_model(str(tmp_path), exclude_frozen_parameters=True)  # DeepSpeed's export
    saved = torch.load(tmp_path / "pytorch_model.bin")
    assert saved["head.weight"].data_ptr() == saved["tok.weight"].data_ptr()  # tied: saved once
    assert "frozen.weight" not in saved and "blocks.0.ln.bias" not in saved
    frozen_tied = TinyGPT()
    frozen_tied.tok.weight.requires_grad_(False)  # head.weight is the same tensor: left out as well
    zeroshard.initialize(frozen_tied, _sgd, {"zero_optimization": {"stage": 3}}).save_16bit_model(
        str(tmp_path / "tied"), exclude_frozen_parameters=True)
    saved = torch.load(tmp_path / "tied" / "pytorch_model.bin")
    assert "tok.weight" not in saved and "head.weight" not in saved and "blocks.0.up.weight" in saved
    engine.save_16bit_model(str(tmp_path), "model.safetensors")  # what the name says, ties and all
    from safetensors.torch import load_file
    as_safetensors, pickled = load_file(tmp_path / "model.safetensors"), engine.full_state_dict()
    assert as_safetensors.keys() == pickled.keys() and "head.weight" in as_safetensors
    assert all(torch.equal(as_safetensors[k], v) for k, v in pickled.items())
    with pytest.raises(ValueError, match="modifier_rank 1 is not a rank of the 1-rank group"):
        with engine.gathered_parameters(modifier_rank=1):
            pass
    # A module's own state_dict() at stage 3 (torch.save, save_pretrained) would hold empty tensors.
    with pytest.raises(RuntimeError, match="'tok' at stage 3 outside forward: .* saved as empty tensors"):
        engine.module.state_dict()
    with engine.gathered_parameters():
        assert engine.module.state_dict()["tok.weight"].shape == engine.module.tok.weight.shape != (0,)
    with pytest.raises(TypeError, match="no positional argument, got Parameter: it gathers every parameter"):
        with engine.gathered_parameters(engine.module.head.weight):  # DeepSpeed's GatheredParameters habit
            pass
    with pytest.raises(TypeError, match="no positional argument, got generator"):
        with engine.gathered_parameters(engine.module.parameters(), modifier_rank=0):
            pass
    with pytest.raises(TypeError, match="modifier_rank=\\) takes a rank or None, got list"):
        with engine.gathered_parameters(modifier_rank=[0]):
            pass
    x, _ = batches(1, 2)[0]
    with torch.no_grad():
        outside = engine(x)
        with engine.gathered_parameters(modifier_rank=0):
            calls = engine.comm_stats()["total"]["all_gather"]["calls"]
            inside = engine(x)  # on the gathered weights: no gather, nothing freed
            assert engine.comm_stats()["total"]["all_gather"]["calls"] == calls
            assert all(p.numel() > 0 for p in engine.module.parameters())
    assert torch.equal(inside, outside)
    assert all(p.numel() == 0 for p in engine.module.blocks[0].parameters())  # freed on exit


@pytest.mark.parametrize("stage, extra, kept_elsewhere", [
    (0, {}, False), (2, {}, False),  # fp32 in place: the parameters are what training keeps
    (1, {"bf16": {"enabled": True}}, True), (3, {}, True),
    (2, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, True)])
def test_module_load_state_dict_after_initialize(one_process_group, stage, extra, kept_elsewhere):
    """A load the next step would silently undo (the fp32 master, a shard or a host copy keeps the
    values) is refused by name; inside gathered_parameters(modifier_rank=0) it is taken and lasts."""
    torch.manual_seed(1)
    loaded = {k: v.clone() for k, v in TinyGPT().state_dict().items()}
    torch.manual_seed(0)
    config = {**extra, "zero_optimization": {**extra.get("zero_optimization", {}), "stage": stage}}
    engine = zeroshard.initialize(TinyGPT(), lambda p: torch.optim.SGD(p, lr=0.0), config)
    if kept_elsewhere:
        with pytest.raises(RuntimeError, match="into 'the model' after zeroshard.initialize: "):
            engine.module.load_state_dict(loaded)
        with pytest.raises(RuntimeError, match="without modifier_rank, every change is undone on exit"):
            with engine.gathered_parameters() as model:
                model.load_state_dict(loaded)
        with engine.gathered_parameters(modifier_rank=0) as model:
            model.load_state_dict(loaded)
    else:
        engine.module.load_state_dict(loaded)
    x, y = batches(1, 2)[0]
    engine.backward(loss_fn(engine(x), y))
    engine.step()  # lr 0: the loaded values must survive it
    dtype = torch.bfloat16 if "bf16" in extra else torch.float32  # bf16: an element whose bf16 value
    for name, value in engine.full_state_dict().items():             # stayed keeps its fp32 master
        assert torch.equal(value.to(dtype), loaded[name].to(dtype)), name


@pytest.mark.parametrize("stage, extra", [(3, {}), (2, {"zeroshard": {"defer_param_gather": True}})])
def test_a_write_into_a_placeholder_is_refused_by_name(one_process_group, stage, extra):
    """Outside forward at stage 3 (and before a deferred all-gather lands) a parameter is an empty
    placeholder: an in-place write there reaches neither the shard nor the master. Lost silently
    before; now the next gather names it, and the way that works."""
    torch.manual_seed(0)
    engine = zeroshard.initialize(TinyGPT(), _sgd, {"zero_optimization": {"stage": stage}, **extra})
    x, y = batches(1, 2)[0]
    for _ in range(2):  # zeroshard's own version bumps at each step are no user's write
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    with torch.no_grad():
        torch.nn.init.zeros_(engine.module.blocks[1].up.weight)
    with pytest.raises(RuntimeError, match="blocks.1.up.weight changed in place while this rank held only "
                                           "its shard .* engine.gathered_parameters\\(modifier_rank=0\\)"):
        engine(x)
    torch.manual_seed(0)
    engine = zeroshard.initialize(TinyGPT(), _sgd, {"zero_optimization": {"stage": stage}, **extra})
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    with engine.gathered_parameters(modifier_rank=0) as model, torch.no_grad():  # the way that works
        torch.nn.init.zeros_(model.blocks[1].up.weight)
    engine.backward(loss_fn(engine(x), y))
    assert engine.full_state_dict()["blocks.1.up.weight"].abs().sum() == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("how", ["assign", "half", "inside gathered_parameters", "new Parameter",
                                 "load_state_dict(assign=True) inside"])
def test_a_replaced_parameter_tensor_is_refused_by_name(one_process_group, stage, how):
    """`p.data = t` (or model.half()) after initialize() leaves the parameter computing with a tensor
    zeroshard never reads: at stages 0-2 the forward used it while the flat buffer trained on and
    the checkpoint kept the old values; at stage 3 the next gather undid it. Silent before (the
    version counter does not see it); now refused by name at the next gather, free or step, before
    the optimizer touches anything, and undone, so that training goes on from a whole engine. So is
    a new Parameter set in the model in its place (`module.weight = nn.Parameter(t)`, or
    load_state_dict(assign=True), transformers' habit): it computed and took gradients unseen, and
    an export held the old values."""
    torch.manual_seed(0)
    engine = zeroshard.initialize(TinyGPT(), _sgd, {"zero_optimization": {"stage": stage}})
    x, y = batches(1, 2)[0]
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    before = [f.owned_values().clone() for f in engine.flats]
    match = {"half": "tensor was replaced", "new Parameter": "blocks.1.up.weight: a new Parameter was set",
             "load_state_dict(assign=True) inside": "a new Parameter was set in the model after initialize"}
    with pytest.raises(RuntimeError, match=match.get(how, "blocks.1.up.weight: the parameter's tensor was "
                                                          "replaced after initialize")):
        if how == "inside gathered_parameters":
            with engine.gathered_parameters(modifier_rank=0) as model:
                model.blocks[1].up.weight.data = torch.zeros_like(model.blocks[1].up.weight)
        elif how == "load_state_dict(assign=True) inside":
            with engine.gathered_parameters(modifier_rank=0) as model:
                state = {k: v.clone() for k, v in model.state_dict().items()}
                model.load_state_dict({**state, "blocks.1.up.weight": torch.full((64, 16), 7.0)}, assign=True)
        else:
            if how == "assign":
                engine.module.blocks[1].up.weight.data = torch.full((64, 16), 7.0)
            elif how == "new Parameter":
                engine.module.blocks[1].up.weight = torch.nn.Parameter(torch.full((64, 16), 7.0))
            else:
                engine.module.half()
            engine.backward(loss_fn(engine(x).float(), y))
            engine.step()
    for flat, values in zip(engine.flats, before):
        assert torch.equal(flat.owned_values(), values), f"{flat.label}: changed although refused"
    if how == "half":
        return  # (its buffers are half too: not a model to go on with)
    if engine.state is TrainingState.BACKWARD_DONE:
        engine.step()  # the refused step, retried: it was refused before anything changed
    else:  # refused inside forward (stage 3) or at gathered_parameters()'s exit: train on
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    assert engine.global_steps == 2 and engine.module.blocks[1].up.weight.numel() in (0, 64 * 16)
    assert engine.full_state_dict()["blocks.1.up.weight"].abs().max() < 7.0  # the replacement: undone


def _replaced_on_the_modifying_rank(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    engine = zeroshard.initialize(TinyGPT(), _sgd, {"zero_optimization": {"stage": 3}})
    with pytest.raises(RuntimeError, match="blocks.1.up.weight: the parameter's tensor was replaced"):
        with engine.gathered_parameters(modifier_rank=0) as model:
            if rank == 0:
                model.blocks[1].up.weight.data = torch.zeros_like(model.blocks[1].up.weight)
    x, y = batches(1, 2 * world_size)[0]
    engine.backward(loss_fn(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
    engine.step()  # every rank raised alike and the engine is whole: training goes on
    # An exception inside on rank 0 alone (an evaluation there failing): rank 0 gets its own, the
    # others one naming it, and training goes on (before, rank 1 paired the exit's collective with
    # rank 0's next forward, and gloo aborted the process).
    for modifier in (None, 0):
        with pytest.raises(ValueError if rank == 0 else RuntimeError,
                           match="evaluation failed" if rank == 0 else
                           "rank 0 raised inside gathered_parameters\\(\\): ValueError: evaluation failed"):
            with engine.gathered_parameters(modifier_rank=modifier):
                if rank == 0:
                    raise ValueError("evaluation failed")
        engine.backward(loss_fn(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
        engine.step()


def test_a_tensor_replaced_by_the_modifying_rank_alone_is_refused_on_every_rank():
    """`p.data = t` on rank 0 alone inside gathered_parameters(modifier_rank=0) (the pattern of
    rank-0 edits), or an exception raised there: every rank raises, none is left waiting in the
    exit's broadcasts."""
    spawn(_replaced_on_the_modifying_rank, 2)
