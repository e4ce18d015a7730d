"""Partitioned construction (zeroshard.init): values bit-identical to an ordinary construction,
at any world size, and peak memory near the shard size plus one unit."""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import os

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import zeroshard
from helpers.spawn import spawn
from helpers.models import TinyGPT, batches, loss_fn
from zeroshard.construct.tensor import DeferredValueError
from zeroshard.core.heap import status_bytes
from zeroshard.app.gpt import GPT, GPTConfig


class InitZoo(nn.Module):
    """Every kind of init code we know of: torch.nn.init functions that skip meta tensors, in-place
    writes through views, `.data` assignment, a parent re-initializing its children (nanoGPT),
    constants mixed in, a value read during construction, buffers and a plain tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8, bias=False)
        self.conv = nn.Conv1d(3, 3, 3)
        self.gru = nn.GRU(8, 8)
        self.w = nn.Parameter(torch.empty(4, 12))
        nn.init.trunc_normal_(self.w, std=0.02)
        self.o = nn.Parameter(torch.empty(3, 7))
        nn.init.orthogonal_(self.o)
        self.s = nn.Parameter(torch.empty(6, 5))
        nn.init.sparse_(self.s, 0.5)
        nn.init.dirac_(self.conv.weight)
        nn.init.kaiming_normal_(self.a.weight, nonlinearity="relu")
        with torch.no_grad():
            self.a.weight[:, :4].mul_(0.5)
            self.a.bias.copy_(torch.linspace(-1, 1, 16))
        self.b.weight.data = self.b.weight.data * 2
        rates = [x.item() for x in torch.linspace(0, 0.1, 3)]  # timm's drop-path schedule
        rates += torch.linspace(0.2, 0.3, 2).tolist()
        self.register_buffer("rates", torch.tensor(rates))
        self.register_buffer("mask", torch.ones(4, 4).tril())
        self.freqs = torch.randn(5)
        generator = torch.Generator().manual_seed(1)  # random factories (run into the scratch), any form
        self.pos = nn.Parameter(torch.randn(6, 4, dtype=torch.float64) * 0.02)
        self.u = nn.Parameter(torch.rand(3, 5, generator=generator))
        self.g = nn.Parameter(torch.normal(0.0, 2.0, (2, 3)))
        self.register_buffer("ids", torch.randint(3, 9, (5,), generator=generator))
        self.register_buffer("order", torch.randperm(7))
        self.apply(self._reinit)  # parent-level re-init, after the children's own

    @staticmethod
    def _reinit(m: nn.Module) -> None:
        if isinstance(m, nn.Linear) and m.out_features == 8:
            nn.init.normal_(m.weight, std=0.02 / math.sqrt(2))


class Wrappers(nn.Module):
    """Code that deep-copies (nn.TransformerEncoder), re-points tensors (parametrize), tags
    parameters with attributes (Mamba's _no_weight_decay) and keeps tensors in a list."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.orth = torch.nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, 5).float()))
        self.A_log._no_weight_decay = True
        self.saved = [torch.randn(2)]


def _tiny_hf_gpt2() -> nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config
    return AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                       n_positions=16, bos_token_id=0, eos_token_id=0))


BUILDERS = {"zoo": InitZoo, "wrappers": Wrappers, "tiny_gpt": TinyGPT,
            "gpt": lambda: GPT(GPTConfig(vocab_size=50, seq_len=16, layers=2, width=32, heads=2)),
            "hf_gpt2": _tiny_hf_gpt2}


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    out.update({f"{n}.{k}": v for n, m in model.named_modules() for k, v in vars(m).items()
                if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)})
    return out


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_materialize_is_bit_identical_to_ordinary_construction(kind):
    torch.manual_seed(3)
    reference = BUILDERS[kind]()
    rng_after_reference = torch.get_rng_state()
    torch.manual_seed(3)
    with zeroshard.init():
        model = BUILDERS[kind]()
    assert torch.equal(torch.get_rng_state(), rng_after_reference), "the generator must advance as usual"
    assert all(zeroshard.is_deferred(p) for p in model.parameters())
    tied = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    zeroshard.materialize(model)
    expected, got = _tensors(reference), _tensors(model)
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert not zeroshard.is_deferred(got[name]), name
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    for name, p in tied:  # identity (ties, optimizers holding them) survives materialization...
        assert model.get_parameter(name) is p or name.startswith("gru.")
    if kind == "wrappers":
        assert model.A_log._no_weight_decay and torch.equal(model.saved[0], reference.saved[0])
        assert torch.equal(model.orth.weight, reference.orth.weight)
    if kind == "zoo":  # ...except where weakly referenced (nn.RNN): replaced, and the RNN follows
        x = torch.randn(3, 2, 8)
        assert torch.equal(model.gru(x)[0], reference.gru(x)[0])


def test_state_outside_the_recording_is_respected():
    """Replay sees the default dtype of its time, and ops go to their tensors' own recording."""
    def build() -> nn.Module:
        torch.set_default_dtype(torch.float64)
        try:
            m = nn.Linear(3, 2)
            m.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2) / 4)))  # promotion
            return m
        finally:
            torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    reference = build()
    torch.manual_seed(0)
    with zeroshard.init():
        model = build()
    with zeroshard.init():  # a later block changes the first model: it is still recorded there
        with torch.no_grad():
            model.bias.fill_(5.0)
            reference.bias.fill_(5.0)
    zeroshard.materialize(model)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_deferred_model_is_refused_where_it_has_no_data():
    with zeroshard.init():
        model = nn.Linear(4, 4)
    with pytest.raises(DeferredValueError, match="zeroshard.initialize"):
        model(torch.randn(2, 4))
    with pytest.raises(DeferredValueError, match="not supported"):
        with zeroshard.init():
            torch.empty(3).resize_(5)
    # A meta tensor is built to be loaded into (from_pretrained builds on meta): refused by name.
    refused = "asks for a tensor on the meta device under zeroshard.init.*from_pretrained"
    with pytest.raises(DeferredValueError, match=refused):
        with zeroshard.init():
            nn.Linear(4, 4, device="meta")
    with pytest.raises(DeferredValueError, match=refused):
        with zeroshard.init(), torch.device("meta"):
            nn.Linear(4, 4)


def _model(seed: int, deferred: bool, layers: int = 2, d: int = 16) -> TinyGPT:
    torch.manual_seed(seed)
    if not deferred:
        return TinyGPT(d, layers)
    with zeroshard.init():
        return TinyGPT(d, layers)


def _train(engine, rank: int, world_size: int, steps: int = 2) -> list[float]:
    losses = []
    for x, y in batches(steps, 2 * world_size):
        mine = slice(2 * rank, 2 * rank + 2)
        loss = loss_fn(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _same_as_ordinary(rank: int, world_size: int) -> None:
    for stage in (1, 3):
        config = {"zero_optimization": {"stage": stage}, "zeroshard": {"unit_modules": ["Block"]}}
        adam = lambda p: torch.optim.Adam(p, lr=1e-2)
        ordinary = zeroshard.initialize(_model(5, deferred=False), adam, config)
        partitioned = zeroshard.initialize(_model(5, deferred=True), adam, config)
        expected, got = ordinary.full_state_dict(), partitioned.full_state_dict()
        assert list(got) == list(expected)
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"stage {stage} world {world_size}: {name}"
        assert _train(partitioned, rank, world_size) == _train(ordinary, rank, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_initialize_from_partitioned_construction_is_bit_identical(world_size):
    spawn(_same_as_ordinary, world_size)


def _peak_allocated(fn) -> tuple[object, int]:
    """Run fn and return (its result, the most bytes the CPU allocator held beyond the start),
    from the profiler's allocation events: an account independent of zeroshard's own."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return result, peak


def _peak_memory(rank: int, world_size: int) -> None:
    config = {"zero_optimization": {"stage": 3, "overlap_comm": False},
              "zeroshard": {"unit_modules": ["Block"]}}
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)
    recordings = []

    def build(deferred: bool):
        model = _model(0, deferred, layers=12, d=64)
        recordings.extend(p.recording for p in model.parameters() if zeroshard.is_deferred(p))
        return zeroshard.initialize(model, sgd, config)

    engine, peak_partitioned = _peak_allocated(lambda: build(True))
    _, peak_ordinary = _peak_allocated(lambda: build(False))
    recorded = recordings[0].nbytes()  # generator states (5 KiB per random op on CPU), constants
    plain = _model(0, deferred=False, layers=12, d=64)
    unit_bytes = 4 * sum(p.numel() for p in plain.twice.parameters())  # every Block unit alike
    model_bytes = 4 * sum(p.numel() for p in plain.parameters())
    largest_unit = max(unit_bytes, model_bytes - 13 * unit_bytes)  # 13 Blocks; the rest is the root
    at_rest = engine.memory_stats()["model_states"]  # this rank's shards of params and gradients
    # Beyond the shards and the recording: one unit's materialized values, its flat buffer and
    # its shard being made.
    bound = at_rest + recorded + (2 + 1 / world_size) * largest_unit + 64 * 1024
    assert peak_partitioned <= bound, (peak_partitioned, at_rest, recorded, largest_unit)
    assert peak_ordinary >= model_bytes  # the measurement does see a full construction
    assert peak_partitioned < peak_ordinary
    if rank == 0:
        print(f"\nworld {world_size}: peak allocated during construction + initialize: partitioned "
              f"{peak_partitioned / 2**20:.2f} MiB, ordinary {peak_ordinary / 2**20:.2f} MiB; model "
              f"{model_bytes / 2**20:.2f} MiB, shards at rest {at_rest / 2**20:.2f} MiB, "
              f"largest unit {largest_unit / 2**20:.3f} MiB, recording {recorded / 2**20:.3f} MiB")


def test_partitioned_construction_peak_memory_is_shard_plus_one_unit():
    spawn(_peak_memory, 3)


def _resident_after_construction(rank: int, world_size: int) -> None:
    mallopt = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallopt", None)
    if mallopt is not None:  # glibc: tensors this size from its heap, as mid-size ones are once it
        mallopt(-3, 4 << 20)  # has raised its mmap threshold (the first frees do); -3: M_MMAP_THRESHOLD
    layers = [nn.Linear(512, 512) for _ in range(2)]  # torch's first kernels' own memory, before
    del layers
    before = status_bytes("RssAnon")
    factory = rank == 1  # initialized in place (nn.Linear) on rank 0, by a random factory on rank 1
    with zeroshard.init():
        layer = lambda: nn.Parameter(torch.randn(512, 512) * 0.02) if factory else nn.Linear(512, 512)
        model = nn.ParameterList(layer() for _ in range(32)) if factory else \
            nn.Sequential(*(layer() for _ in range(32)))
    grown = status_bytes("RssAnon") - before
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    print(f"\nconstructing a {model_bytes / 2**20:.1f} MiB model under init() "
          f"({'torch.randn' if factory else 'nn.Linear'}): resident memory grew {grown / 2**20:.2f} MiB")
    assert grown < model_bytes / 8, (grown, model_bytes)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status")
def test_partitioned_construction_leaves_no_model_sized_memory_resident():
    """Each random init runs once on a real scratch tensor (to advance the generator): a freed
    scratch must not stay in the process as heap holes, which would add up to the model's size."""
    spawn(_resident_after_construction, 2)
