"""Models and call patterns that broke earlier versions (found in review): each now trains exactly
like the single-process reference, or fails with a clear error."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from helpers.spawn import spawn
from helpers.margins import close
from helpers.models import VOCAB, TinyGPT, assert_weights_match, batches, loss_fn, reference_run


class Routed(nn.Module):
    """A block whose parameters are used or not depending on the data: an expert that got no tokens."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, choice: bool) -> torch.Tensor:
        return x + self.a(x) + (self.b(x) if choice else 0)  # `b` unused on even data


class RoutedModel(nn.Module):
    def __init__(self, d: int = 8, blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Routed(d) for _ in range(blocks))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x, choice = self.emb(idx), bool(idx[0, 0] % 2)  # differs between ranks' batches
        for block in self.blocks:
            x = block(x, choice)
        return self.head(x)


def _routed_data(step: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = batches(step + 1, 2 * world_size)[step]
    x[0::2, 0] = 2 * (x[0::2, 0] // 2)          # rank 0's first sequence starts even ...
    x[2::4, 0] = 2 * (x[2::4, 0] // 2) + 1      # ... rank 1's odd
    return [(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2]) for r in range(world_size)]


def _sgd(p):
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


def _unused_on_some_ranks(rank: int, world_size: int, blocks: int) -> None:
    """Each unit's buffer completes in backward on one rank and not on the other. With 6 blocks
    stage 3 gathers in backward too (one unit at a time; at gloo's defaults this small model stays
    gathered into backward from the second step): its reduce-scatters must still meet the gathers in
    the same order on every rank (they once went out as each buffer completed, a different place per rank)."""
    torch.manual_seed(0)
    ref = RoutedModel(blocks=blocks)
    opt = _sgd(ref.parameters())
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)
    for step in range(3):  # the reference: mean over the ranks' losses, in one process
        parts = _routed_data(step, world_size)
        (sum(loss_fn(ref(x), y) for x, y in parts) / world_size).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    one_at_a_time = {"stage3_prefetch_bucket_size": 1, "stage3_max_reuse_distance": 0}
    for stage, extra in [(0, {}), (1, {}), (2, {}), (3, {}), (3, one_at_a_time)]:
        torch.manual_seed(0)
        engine = zeroshard.initialize(RoutedModel(blocks=blocks), _sgd,
                                      {"zero_optimization": {"stage": stage, **extra}})
        for step in range(3):
            x, y = _routed_data(step, world_size)[rank]
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        assert_weights_match(engine, ref.state_dict(), 1e-5, 1e-6, f"stage {stage}, {blocks} blocks")


@pytest.mark.parametrize("blocks", [2, 6])
def test_a_parameter_unused_on_some_ranks_only(blocks):
    spawn(_unused_on_some_ranks, 2, blocks)


class _Branches(nn.Module):
    """Rank r takes branch r; branch 1 is frozen, so rank 1's backward reaches no trainable
    parameter (its loss needs grad through the input, as HF's enable_input_require_grads makes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.requires_grad_(False)

    def forward(self, x: torch.Tensor, branch: int) -> torch.Tensor:
        return (self.a(x) if branch == 0 else self.b(x)).sum()


def _no_gradient_on_one_rank(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    engine = zeroshard.initialize(_Branches(), _sgd, {"zero_optimization": {"stage": 2}})
    x = torch.randn(2, 4, requires_grad=True)
    engine.backward(engine(x, branch=rank))
    engine.step()  # rank 1 called backward(): a step like any other, on every rank alike
    assert engine.global_steps == 1


def test_a_backward_that_reaches_no_parameter_on_one_rank_still_steps():
    spawn(_no_gradient_on_one_rank, 2)


def _extra_forwards(rank: int, world_size: int) -> None:
    """Stage 3: a no_grad forward between forward and backward (a reference model pass), and a
    forward with grad between backward and step (logging): neither may change the training."""
    ref_model, ref_losses = reference_run(lambda: (torch.manual_seed(0), TinyGPT())[1], _sgd, 3, 4)
    torch.manual_seed(0)
    engine = zeroshard.initialize(TinyGPT(), _sgd, {"zero_optimization": {"stage": 3}})
    for step, (x, y) in enumerate(batches(3, 4)):
        mine = slice(2 * rank, 2 * rank + 2)
        loss = loss_fn(engine(x[mine], use_sometimes=step % 2 == 0), y[mine])
        with torch.no_grad():
            engine(x[mine])
        engine.backward(loss)
        engine(x[mine])  # grad enabled, never backpropagated
        engine.step()
    assert_weights_match(engine, ref_model.state_dict(), 1e-5, 1e-6, "extra forwards:")


def test_extra_forwards_at_stage_3():
    spawn(_extra_forwards, 2)


class DetachedUse(nn.Module):
    """A block that also uses its weight detached, before the differentiable use."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x @ self.lin.weight.detach().t())


def _detached(rank: int, world_size: int) -> None:
    results = []
    for stage in (0, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.ModuleList([DetachedUse(8), DetachedUse(8)]))
        model.forward = lambda idx, m=model: m[1][1](m[1][0](m[0](idx)))  # noqa: E731
        engine = zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": stage}})
        x, y = batches(1, 4)[0]
        engine.backward(engine(x[2 * rank:2 * rank + 2]).pow(2).mean())
        engine.step()
        results.append(engine.full_state_dict())
    for name in results[0]:
        close(results[1][name], results[0][name], rtol=1e-5, atol=1e-7, what=f"stage 3 vs 0: {name}")


def test_a_weight_used_detached_at_stage_3():
    spawn(_detached, 2)


def _resume_other_accumulation(rank: int, world_size: int, directory: str) -> None:
    torch.manual_seed(0)
    engine = zeroshard.initialize(TinyGPT(), _sgd, {"zero_optimization": {"stage": 2}})
    for x, y in batches(3, 4):
        engine.backward(loss_fn(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]))
        engine.step()
    engine.save_checkpoint(directory)
    torch.manual_seed(1)
    resumed = zeroshard.initialize(TinyGPT(), _sgd, {"zero_optimization": {"stage": 2},
                                                      "gradient_accumulation_steps": 2})
    resumed.load_checkpoint(directory)
    assert resumed.global_steps == 3 and not resumed.is_gradient_accumulation_boundary()
    resumed.save_checkpoint(directory)  # at a boundary: allowed


def test_resume_with_other_accumulation_steps(tmp_path):
    spawn(_resume_other_accumulation, 2, str(tmp_path))


def _lifecycle(rank: int, world_size: int, directory: str) -> None:
    import gc
    import weakref
    torch.manual_seed(0)
    model = TinyGPT()
    engine = zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": 3}})
    flats = [weakref.ref(f) for f in engine.flats]
    with pytest.raises(ValueError, match="already wrapped"):
        zeroshard.initialize(model, _sgd)
    del engine
    gc.collect()
    assert all(f() is None for f in flats)  # a dropped engine frees its buffers
    # A model with a zero-element parameter consolidates; unfreezing before resume is named.
    torch.manual_seed(0)
    odd = TinyGPT()
    odd.empty = nn.Parameter(torch.zeros(0))
    engine = zeroshard.initialize(odd, _sgd, {"zero_optimization": {"stage": 1}})
    engine.backward(loss_fn(engine(batches(1, 2)[0][0]), batches(1, 2)[0][1]))
    engine.step()
    engine.save_checkpoint(directory)
    torch.manual_seed(0)
    thawed = TinyGPT()
    thawed.empty = nn.Parameter(torch.zeros(0))
    thawed.frozen.requires_grad_(True)
    other = zeroshard.initialize(thawed, _sgd, {"zero_optimization": {"stage": 1}})
    with pytest.raises(zeroshard.CheckpointError,
                       match=r"frozen at save time are trainable now.*frozen\.bias"):
        other.load_checkpoint(directory)
    other.load_checkpoint(directory, load_optimizer_states=False)  # the weights alone: allowed
    saved = engine.full_state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in other.full_state_dict().items())


def test_engine_lifecycle_and_checkpoint_edges(tmp_path):
    spawn(_lifecycle, 2, str(tmp_path))
    weights = zeroshard.consolidate(str(tmp_path))
    assert weights["empty"].shape == (0,) and "frozen.weight" in weights


def test_a_loss_from_before_the_step_is_refused_as_torch_refuses_it():
    spawn(_stale_graph, 2)


def _stale_graph(rank: int, world_size: int) -> None:
    """A forward, then a step that updates the weights, then backward of that forward's loss: its
    gradients would be taken at the old weights. Plain torch refuses it (a saved tensor modified
    in place), and so does every stage, in fp32 and bf16."""
    x, y = next(iter(batches(1, 2 * world_size)))
    mine = slice(2 * rank, 2 * rank + 2)
    for stage in (0, 1, 2, 3):
        for bf16 in (False, True):
            torch.manual_seed(0)
            config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
            engine = zeroshard.initialize(TinyGPT(), _sgd, config)
            stale = loss_fn(engine(x[mine]), y[mine])
            engine.backward(loss_fn(engine(x[mine]), y[mine]))
            engine.step()
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                engine.backward(stale)


def test_silent_mistakes_are_refused(one_process_group, tmp_path):
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match="scheduler instance was built over another optimizer"):
        other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
        zeroshard.initialize(model, _sgd, lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    # A scheduler stepped on a metric cannot be stepped by the engine: refused at initialize (it
    # failed half-way through the first step). Built over engine.optimizer, the user steps it.
    plateau = lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)  # noqa: E731
    with pytest.raises(TypeError, match="ReduceLROnPlateau steps on a metric"):
        zeroshard.initialize(nn.Linear(4, 4), _sgd, lr_scheduler=plateau)
    mine = zeroshard.initialize(nn.Linear(4, 4), _sgd)
    lr, by_hand = mine.get_lr()[0], plateau(mine.optimizer)
    for _ in range(3):
        by_hand.step(1.0)
    assert mine.get_lr()[0] < lr
    with pytest.raises(ValueError, match="bfloat16 but the config trains in fp32"):
        zeroshard.initialize(nn.Linear(4, 4).bfloat16(), _sgd)
    if hasattr(torch.optim, "Adafactor"):
        with pytest.raises(zeroshard.ConfigError, match="Adafactor updates each parameter from"):
            zeroshard.initialize(nn.Linear(4, 4), lambda p: torch.optim.Adafactor(p))
    try:  # transformers' own (what Trainer's optim="adafactor" builds), by its class name
        from transformers.optimization import Adafactor
    except ImportError:
        Adafactor = None
    if Adafactor is not None:
        with pytest.raises(zeroshard.ConfigError, match="Adafactor updates each parameter from"):
            zeroshard.initialize(nn.Linear(4, 4), lambda p: Adafactor(p, lr=1e-3, relative_step=False))
    # A stray step() (an accumulation loop off by one): torch's would not move a parameter without
    # a gradient; ZeRO's zero gradients would take weight decay. Refused, nothing changed; after a
    # backward the same engine steps.
    engine = zeroshard.initialize(nn.Linear(4, 4), lambda p: torch.optim.AdamW(p, lr=0.1),
                                  {"zero_optimization": {"stage": 2}})
    before = engine.full_state_dict()
    with pytest.raises(RuntimeError, match="step\\(\\) with no backward since the last update"):
        engine.step()
    assert all(torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    assert engine.global_steps == 1
    with pytest.raises(RuntimeError, match="no backward since the last update"):
        engine.step()
    # A parameter frozen after initialize would still be moved by Adam with a zero gradient: refused.
    late = zeroshard.initialize(nn.Linear(4, 4), lambda p: torch.optim.AdamW(p, lr=0.1))
    late.module.bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"\['bias'\] frozen \(requires_grad=False\) after zeroshard"):
        late.backward(late(torch.ones(2, 4)).sum())
    # ... and one unfrozen after initialize has no gradient buffer or optimizer state: it would
    # silently not train. Refused too, at every stage.
    for stage in (0, 3):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        model[0].weight.requires_grad_(False)
        thawed = zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": stage}})
        model[0].weight.requires_grad_(True)
        with pytest.raises(RuntimeError, match=r"\['0.weight'\] unfrozen \(requires_grad=True\) after"):
            thawed.backward(thawed(torch.ones(2, 4)).sum())
    # A weight written in place where training keeps its values elsewhere (16-bit: the fp32 master)
    # would be written over by the next step: refused by name. In fp32 (stages 0-2) the parameter is
    # the master, and the write simply trains on.
    for precision in ("bf16", "fp32"):
        config = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": precision == "bf16"}}
        edited = zeroshard.initialize(nn.Linear(4, 4), _sgd, config)
        with torch.no_grad():
            edited.module.weight.fill_(0.5)
        edited.backward(edited(torch.ones(2, 4, dtype=edited.module.weight.dtype)).float().sum())
        if precision == "bf16":
            with pytest.raises(RuntimeError, match="weight changed in place after zeroshard.initialize"):
                edited.step()
        else:
            edited.step()
    # At stage 3 a module writing its own weight in forward (Embedding's max_norm renormalizes the
    # rows it reads) writes the gathered copy, which is freed after use: refused by name when freed.
    # Renormalized inside gathered_parameters(modifier_rank=0) instead, the change is kept.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 4, max_norm=1.0), nn.ModuleList([nn.Linear(4, 1)]))
    model.forward = lambda x: model[1][0](model[0](x)).sum()
    with torch.no_grad():
        model[0].weight.mul_(3.0)
    renormed = zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": 3}})
    with pytest.raises(RuntimeError, match="0.weight changed in place while gathered"):
        renormed.backward(renormed(torch.tensor([1, 2])))
    model[0].max_norm = None
    renormed.backward(renormed(torch.tensor([1, 2])))
    renormed.step()
    with torch.no_grad(), renormed.gathered_parameters(modifier_rank=0):
        model[0].weight.copy_(torch.renorm(model[0].weight, 2, 0, 1.0))
    norms = renormed.full_state_dict()["0.weight"].norm(dim=1)
    assert norms.max() <= 1.0 + 1e-6 and norms.min() > 0.5, norms
    # DeepSpeed's conveniences, and nn.Module's names answered with what to use instead.
    assert engine.get_lr() == [0.1] and engine.get_global_grad_norm() > 0
    engine.zero_grad()  # a torch loop's habit before the forward: nothing to clear
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.zero_grad()  # after a backward (a batch abandoned before its step): its gradients go
    with pytest.raises(RuntimeError, match="step\\(\\) with no backward since the last update"):
        engine.step()
    engine.backward(engine(torch.ones(2, 4)).sum())
    # The torch optimizer's own step() would update nothing: its shards get gradients only inside
    # engine.step() (reduced, unscaled, clipped). Refused by name; the engine's step still works.
    with pytest.raises(RuntimeError, match="engine.optimizer.step\\(\\) called directly"):
        engine.optimizer.step()
    before = engine.full_state_dict()
    engine.step()
    assert not torch.equal(before["weight"], engine.full_state_dict()["weight"])
    with pytest.raises(AttributeError, match="no attribute 'state_dict': the full fp32 weights are "
                                             "engine.full_state_dict"):
        engine.state_dict()
    with pytest.raises(AttributeError, match="no attribute 'nonsense'$"):
        engine.nonsense
    # DeepSpeed's accessors, answered.
    assert engine.was_step_applied() and engine.zero_optimization_stage() == 2 and engine.training
    assert (engine.global_rank, engine.world_size, engine.gradient_accumulation_steps()) == (0, 1, 1)
    assert engine.dp_world_size == 1 and not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.gradient_clipping() == 0.0
    assert engine.train_batch_size() is None and torch.equal(engine.forward(torch.ones(1, 4)),
                                                              engine(torch.ones(1, 4)))
    assert engine.save_16bit_model(str(tmp_path), "model.bin")  # DeepSpeed's export, rank 0 writes it
    saved, full = torch.load(tmp_path / "model.bin"), engine.full_state_dict()
    assert saved.keys() == full.keys() and all(torch.equal(saved[k], full[k]) for k in full)  # fp32 run
    # loss.backward() instead of engine.backward(loss), where the engine would have scaled the loss:
    # the gradients would be off by the accumulation steps. Refused at step(), nothing changed.
    engine = zeroshard.initialize(nn.Linear(4, 4), _sgd, {"gradient_accumulation_steps": 2,
                                                          "train_micro_batch_size_per_gpu": 3})
    assert engine.train_batch_size() == 6
    total_only = zeroshard.initialize(nn.Linear(4, 4), _sgd, {"train_batch_size": 8,
                                                              "gradient_accumulation_steps": 2})
    assert (total_only.train_batch_size(), total_only.train_micro_batch_size_per_gpu()) == (8, 4)
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    assert not engine.was_step_applied()  # within the accumulation cycle
    engine(torch.ones(2, 4)).sum().backward()
    before = engine.full_state_dict()
    with pytest.raises(RuntimeError, match="after loss.backward.*gradient_accumulation_steps \\(2\\)"):
        engine.step()
    assert all(torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
    for _ in range(2):  # the cycle starts again, as the message says: the engine is not stuck
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    loss = engine(torch.ones(2, 4)).sum()
    loss.register_hook(lambda grad: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # an engine.backward that fails inside autograd ...
        engine.backward(loss)
    engine(torch.ones(2, 4)).sum().backward()  # ... leaves a later plain backward still caught
    with pytest.raises(RuntimeError, match="after loss.backward"):
        engine.step()


def _gather_behind_forward(rank: int, world_size: int, directory: str) -> None:
    """Stages 1-2 with defer_param_gather leave the post-step all-gather in flight until the next
    forward: nothing that reads the parameters through a module may see a half-written buffer."""
    for stage in (1, 2):
        config = {"zero_optimization": {"stage": stage, "overlap_comm": True},
                  "zeroshard": {"defer_param_gather": True}}
        torch.manual_seed(0)
        model = TinyGPT()
        seen = []  # a user's forward pre-hook, registered before initialize, sees current weights
        model.register_forward_pre_hook(lambda *_: seen.append(model.tok.weight.norm().item()))
        engine = zeroshard.initialize(model, _sgd, config)
        (x, y), = batches(1, 2 * world_size)
        mine = slice(2 * rank, 2 * rank + 2)

        def train_step() -> None:
            engine.backward(loss_fn(engine(x[mine]), y[mine]))
            engine.step()
        train_step()
        train_step()
        assert min(seen) > 0
        assert engine.module.tok.weight.numel() == 0  # a placeholder until it lands: loud, not stale
        block = engine.module.blocks[0].state_dict()  # a submodule's state_dict waits for its unit
        full = engine.full_state_dict()
        assert all(torch.equal(v, full[f"blocks.0.{k}"]) for k, v in block.items()), stage
        train_step()
        plain = engine.module.state_dict()  # and the whole model's
        full = engine.full_state_dict()
        for name, value in full.items():
            assert torch.equal(plain[name], value), (stage, name)
        train_step()
        engine.module.load_state_dict(plain)  # waits first: loads into whole buffers
        train_step()
        h = torch.ones(2, 16)
        direct = engine.module.ln_f(h)  # a root-owned submodule called directly waits for its unit
        engine.wait_for_parameters()
        assert torch.equal(direct, engine.module.ln_f(h))
        train_step()
        engine.wait_for_parameters()
        assert engine.module.tok.weight.numel() > 0
        # A no_grad forward, then a checkpoint round trip, see the same weights.
        with torch.no_grad():
            before = engine(x[mine])
        engine.save_checkpoint(directory + f"/s{stage}")
        engine.load_checkpoint(directory + f"/s{stage}")
        with torch.no_grad():
            assert torch.equal(engine(x[mine]), before)


def test_stages_1_2_gather_behind_the_next_forward(tmp_path):
    spawn(_gather_behind_forward, 3, str(tmp_path))


def _activation_checkpointing(rank: int, world_size: int) -> None:
    """Blocks recomputed in backward (torch.utils.checkpoint, both flavours, and zeroshard's own): at
    stage 3 the recomputation runs inside backward on the gathered unit, which must not be freed by
    it. A reentrant recompute runs a backward of its own, so the block called twice reports its
    gradients twice in one backward, the second time after its buffer was reduced."""
    ref_model, ref_losses = reference_run(lambda: (torch.manual_seed(0), TinyGPT())[1], _sgd, 3, 4)
    for flavour in ("non-reentrant", "reentrant", "zeroshard"):
        for stage in (0, 1, 2, 3):
            config = {"zero_optimization": {"stage": stage}}
            if flavour == "zeroshard":  # every Block a unit, so `twice` is checkpointed at each call
                config.update(activation_checkpointing={}, zeroshard={"unit_modules": ["Block"]})
            engine, losses, gathered = _train_tiny_gpt(rank, world_size,
                                                       None if flavour == "zeroshard" else flavour, config)
            what = f"activation checkpointing ({flavour}) at stage {stage}"
            if stage == 3 and flavour != "zeroshard":  # the recompute reuses the unit gathered for backward
                everything = 4 * sum(f.layout.padded_numel for f in engine.flats)
                root = 4 * sum(f.layout.padded_numel for f in engine.units[0].flats)
                # The first step has no record of an earlier forward to decide by. Non-reentrant: the
                # record holds the recomputes too (each unit runs again in backward, within gloo's
                # reuse distance), so from the second step on each unit stays gathered from its
                # forward to its recompute: gathered once a step, as without checkpointing.
                # Reentrant: the checkpointed forward runs under no_grad, which frees each unit
                # right after it (nothing tells that a backward will follow), so backward gathers
                # every unit again.
                once = everything if flavour == "non-reentrant" else 2 * everything - root
                assert gathered == [2 * everything - root, once, once], (what, gathered)
            elif stage == 3:  # each recompute runs a unit's forward hooks: it must gather nothing more
                plain = {k: v for k, v in config.items() if k != "activation_checkpointing"}
                totals = [e.comm_stats()["total"]["all_gather"]["bytes"]
                            for e in (engine, _train_tiny_gpt(rank, world_size, None, plain)[0])]
                assert totals[0] == totals[1], f"{what}: gathered {totals}, checkpointed and not"
            close(losses, ref_losses, rtol=1e-5, atol=1e-6, what=f"{what}: losses")
            assert_weights_match(engine, ref_model.state_dict(), 1e-5, 1e-6, f"{what}:")


def _train_tiny_gpt(rank: int, world_size: int, checkpointing: str | None,
                    config: dict) -> tuple[zeroshard.Engine, list[float], list[int]]:
    """Three steps of TinyGPT from seed 0 (each rank its two samples); the mean loss of each, and
    the bytes each step all-gathered."""
    torch.manual_seed(0)
    engine = zeroshard.initialize(TinyGPT(checkpointing=checkpointing), _sgd, config)
    losses, gathered = [], []
    for step, (x, y) in enumerate(batches(3, 4)):
        mine = slice(2 * rank, 2 * rank + 2)
        loss = loss_fn(engine(x[mine], use_sometimes=step % 2 == 0), y[mine])
        engine.backward(loss)
        engine.step()
        gathered.append(engine.comm_stats()["last_step"]["all_gather"]["bytes"])
        torch.distributed.all_reduce(loss := loss.detach())
        losses.append(loss.item() / world_size)
    return engine, losses, gathered


def test_activation_checkpointing_at_every_stage():
    spawn(_activation_checkpointing, 2)


class _FailInBackward(torch.autograd.Function):
    """Identity whose backward raises while `armed`: a backward that fails part-way."""

    armed = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if _FailInBackward.armed:
            raise ValueError("injected failure in backward")
        return grad


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if i == 1:
                x = _FailInBackward.apply(x)
        return x.sum(dim=1)


def _caught_failures(rank: int, world_size: int) -> None:
    """A loop that catches a failure and goes on with the next batch: a backward raising part-way
    (step 1), an error between backward and step followed by the loop's zero_grad() (step 2), and a
    NaN on one rank raising NonFiniteError on every rank (step 3). Each drops its batch: the result
    equals single-process torch that never saw those batches (before, their partial gradients went
    into the next update, and a caught NonFiniteError failed every later step)."""
    def data(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(step)
        return [(torch.randn(4, 8, generator=g), torch.randn(4, generator=g)) for _ in range(world_size)]

    def adamw(p):
        return torch.optim.AdamW(p, lr=1e-2)

    torch.manual_seed(0)
    ref = _Stack()
    opt = adamw(ref.parameters())
    for step in (0, 4, 5):
        opt.zero_grad()
        (sum(nn.functional.mse_loss(ref(x), y) for x, y in data(step)) / world_size).backward()
        opt.step()
    for stage in (1, 3):
        torch.manual_seed(0)
        engine = zeroshard.initialize(_Stack(), adamw, {"zero_optimization": {"stage": stage}})
        for step in range(6):
            engine.zero_grad()  # a torch loop's habit: after the abandoned step 2, it drops its gradients
            x, y = data(step)[rank]
            if step == 3 and rank == 1:
                x = x.clone()
                x[0, 0] = float("nan")
            _FailInBackward.armed = step == 1
            try:
                engine.backward(nn.functional.mse_loss(engine(x), y))
                if step == 2:
                    raise KeyError("injected failure between backward and step")
                engine.step()
            except (ValueError, KeyError, zeroshard.NonFiniteError) as e:
                assert step in (1, 2, 3), e
        assert_weights_match(engine, ref.state_dict(), 1e-5, 1e-6, f"stage {stage}")


def test_a_caught_failure_drops_its_batch_as_torch_would():
    spawn(_caught_failures, 2)
