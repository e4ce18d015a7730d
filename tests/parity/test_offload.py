"""ZeRO-Offload on CPU, where host and device are one memory: offload must not change a single bit of
training, memory_stats() must say where every byte lives, the delayed parameter update must follow
its own definition, and an offloaded stage-3 shard must be the only lasting copy of its parameters."""
from __future__ import annotations

import logging
import os
import tempfile

import pytest
import torch

import zeroshard
from helpers.accounting import live_tensor_bytes
from helpers.margins import close
from helpers.models import TinyGPT, batches, loss_fn
from helpers.spawn import spawn

STEPS, GLOBAL_BATCH = 4, 12
OPTIMIZER = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}}
PARAMS = {"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True}}}


def _merge(*configs: dict) -> dict:
    out: dict = {}
    for c in configs:
        for k, v in c.items():
            out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def _train(rank: int, world_size: int, config: dict, steps: int | range = STEPS, scheduler=None, d: int = 16,
           engine=None, fused: bool | None = None):
    """Train `steps` (a count, or a range of the batch sequence) on a new engine, or on `engine`;
    `fused`: AdamW's fused kernel (whose offloaded step runs on the host in one pass)."""
    steps = range(steps) if isinstance(steps, int) else steps
    if engine is None:
        torch.manual_seed(0)
        engine = zeroshard.initialize(
            TinyGPT(d=d), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=fused), config,
            lr_scheduler=scheduler)
    local, micro = GLOBAL_BATCH // world_size, engine.config.gradient_accumulation_steps
    data, losses = batches(steps.stop, GLOBAL_BATCH), []
    for step in steps:
        x, y = data[step]
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        total = torch.zeros(())
        for m in range(micro):
            part = slice(m * local // micro, (m + 1) * local // micro)
            loss = loss_fn(engine(x[part], use_sometimes=step % 2 == 0).float(), y[part])
            engine.backward(loss)
            engine.step()
            total += loss.detach() / micro
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world_size)
    return engine, losses


def _expected_places(engine) -> tuple[int, int]:
    """(host bytes, transfer bytes) from the layout alone: the fp32 master and AdamW's two
    moments (12 bytes) per owned element plus a step counter per buffer; the gradient's and the
    update's host copies (none where host and device are one memory and no delayed update reads
    them on a worker thread; no update copy in fp32, where the master goes up); offloaded stage-3
    shards in the compute dtype."""
    cfg, dtype = engine.config.zero, engine.precision.param_dtype
    compute, host, transfer = torch.finfo(dtype).bits // 8, 0, 0
    for f in engine.flats:
        shard = f.layout.shard_numel
        off_params = cfg.offload_param and not f.persistent
        if off_params:
            host += compute * shard
        if f.trainable and cfg.offload_optimizer:
            host += 12 * shard + 4
            if not engine.copier.one_memory:
                goes_up = 0 if off_params or dtype == torch.float32 else compute * shard  # (fp32: the
                transfer += f.grad_dtype.itemsize * shard + goes_up                       # master itself)
    return host + transfer, transfer


def _parity(rank: int, world_size: int) -> None:
    """Offload changes no bit, with torch's optimizer.step() (AdamW unfused) and with the host's
    step in one pass (fused AdamW: offload/host_step.py, counted to be sure it ran)."""
    from zeroshard.offload import host_step
    folded, update = [], host_step.update
    host_step.update = lambda *args, **kwargs: (folded.append(1), update(*args, **kwargs))[1]
    cases = [(False, "fp32", 2), (False, "fp32", 3), (False, "bf16", 2), (False, "bf16", 3),
             (True, "fp32", 3), (True, "bf16", 2), (True, "bf16", 3), (True, "fp16", 2), (False, "fp16", 3)]
    for fused, precision, stage in cases:
        base = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
                "gradient_clipping": 0.5, "gradient_accumulation_steps": 2}
        if precision == "fp16":  # a scale the first step overflows at: skipped, then halved
            base["fp16"] = {"enabled": True, "initial_scale_power": 16, "hysteresis": 1}
        ref, ref_losses = _train(rank, world_size, base, fused=fused)
        ref_state = ref.full_state_dict()
        variants = {"optimizer": OPTIMIZER} | ({"params": PARAMS, "both": _merge(OPTIMIZER, PARAMS)}
                                                if stage == 3 else {})
        for name, extra in variants.items():
            what = f"{precision} stage {stage} offload {name}{' fused' if fused else ''}"
            folded.clear()
            engine, losses = _train(rank, world_size, _merge(base, extra), fused=fused)
            assert bool(folded) == (fused and name != "params"), what  # the step in one pass ran
            assert losses == ref_losses, what  # bit for bit: offload moves values, never rounds
            assert engine.skipped_steps == ref.skipped_steps == (precision == "fp16"), what
            state = engine.full_state_dict()
            assert all(torch.equal(state[k], ref_state[k]) for k in ref_state), what
            stats, (host, transfer) = engine.memory_stats(), _expected_places(engine)
            assert stats["host"] == host and stats["transfer"] == transfer, (what, stats, host)
            assert stats["device"] + stats["host"] == \
                stats["model_states"] + stats["buffers"] + stats["temporary"] + transfer, what
            # What left the device is what the host took on: the optimizer state (and its fp32
            # master) and the offloaded shards. Only fp32 with the shards alone on the host adds
            # to the device: an fp32 master for the optimizer there (the shards can't be it). And
            # a 16-bit stage-3 shard kept on the device for a master on the host (in place, the
            # gather casts the device master: no such shard).
            ref_stats, zero = ref.memory_stats(), extra["zero_optimization"]
            on_host = sum(f.shard.nbytes for f in engine.flats if f.shard_on_host)
            expected = ref_stats["device"] - ref_stats["params"] + stats["params"] - on_host
            if "offload_optimizer" in zero:
                expected -= ref_stats["optimizer"]
            else:
                expected += stats["optimizer"] - ref_stats["optimizer"]
                assert precision != "fp32" or stats["optimizer"] - ref_stats["optimizer"] == \
                    4 * sum(f.layout.shard_numel for f in engine.flats if f.trainable), what
            assert stats["device"] == expected, (what, stats, ref_stats)


@pytest.mark.parametrize("world_size", [2, 3])
def test_offload_matches_training_in_place(world_size):
    spawn(_parity, world_size)


def _delayed(rank: int, world_size: int, stage: int) -> None:
    """The delayed parameter update by its definition: at each step the parameters take the master
    as the previous step left it, then the master is updated with this step's gradient (computed
    from those older parameters). The reference is single-process torch; it also steps the
    scheduler after each update, which the engine does once its worker's update has ended."""
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7)  # noqa: E731
    torch.manual_seed(0)
    model = TinyGPT()
    trainable = [p for p in model.parameters() if p.requires_grad]
    master = [torch.nn.Parameter(p.detach().clone()) for p in trainable]
    opt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    ref_sched, ref_losses = sched(opt), []
    for p in trainable:
        p.grad = torch.zeros_like(p)
    for step, (x, y) in enumerate(batches(STEPS, GLOBAL_BATCH)):
        loss = loss_fn(model(x, use_sometimes=step % 2 == 0), y)
        loss.backward()
        ref_losses.append(loss.item())
        with torch.no_grad():
            for p, m in zip(trainable, master):
                p.copy_(m)  # the previous step's update reaches the parameters now
                m.grad = p.grad.clone()
                p.grad.zero_()
        opt.step()
        ref_sched.step()
    config = _merge({"zero_optimization": {"stage": stage}, "zeroshard": {"delayed_param_update": True}},
                    OPTIMIZER)
    engine, losses = _train(rank, world_size, config, scheduler=sched)
    close(losses, ref_losses, rtol=1e-5, atol=2e-6, what=f"stage {stage} delayed update losses")
    state = engine.full_state_dict()  # waits for the last update: the master, a step ahead
    names = {id(p): n for n, p in model.named_parameters()}
    for p, m in zip(trainable, master):
        close(state[names[id(p)]], m, rtol=1e-5, atol=2e-6, what=f"stage {stage} {names[id(p)]}")
    assert engine.lr_scheduler.last_epoch == STEPS
    # The worker reads the host gradient while the next backward writes the device's: two buffers.
    transfer = engine.memory_stats()["transfer"]
    assert not engine.copier.one_memory and transfer == _expected_places(engine)[1] > 0
    _, plain = _train(rank, world_size, {"zero_optimization": {"stage": stage}})
    assert abs(plain[-1] - losses[-1]) > 1e-3  # the delay is real: without it training differs


@pytest.mark.parametrize("stage", [2, 3])
def test_delayed_param_update_follows_its_definition(stage):
    spawn(_delayed, 2, stage)


def _casts(rank: int, world_size: int) -> None:
    """"offload_casts": "device" (gradients down and updates up in fp32, converted where the
    gradient is): the same training to the bit as casting on the host, with fp32 host buffers,
    twice the link bytes. On the CPU the host copies exist where the delayed update keeps them."""
    results = {}
    for casts in ("host", "device"):
        config = _merge({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                         "gradient_clipping": 0.5, "zeroshard": {"delayed_param_update": True,
                                                                 "offload_casts": casts}}, OPTIMIZER)
        engine, losses = _train(rank, world_size, config, fused=True)
        hosts = [f.host for f in engine.flats if f.host is not None]
        if casts == "host":  # 16-bit both ways, by way of a 16-bit staging buffer
            assert {h.grad.dtype for h in hosts} | {h.staging.dtype for h in hosts} == {torch.bfloat16}
        else:  # fp32 down, and the fp32 master itself goes up: no staging buffer
            assert {h.grad.dtype for h in hosts} == {torch.float32}
            assert all(f.host.staging is None and f.host.master is f.master
                       for f in engine.flats if f.host is not None)
        results[casts] = losses, engine.full_state_dict(), engine.memory_stats()["transfer"]
    (losses, state, transfer), (device_losses, device_state, device_transfer) = results.values()
    assert device_losses == losses and all(torch.equal(device_state[k], v) for k, v in state.items())
    assert device_transfer == transfer > 0  # (fp32 grad) == (16-bit grad + 16-bit staging)


def test_casts_on_the_device_train_as_on_the_host():
    spawn(_casts, 2)


def _census(rank: int, world_size: int) -> None:
    """Stage 3 + offload_param: between uses a unit holds nothing but its host shard. Every live
    storage of the process is accounted for by memory_stats(), and no gathered copy survives."""
    engine, _ = _train(rank, world_size, _merge({"zero_optimization": {"stage": 3}}, PARAMS, OPTIMIZER),
                       d=64)
    assert all(f.shard_on_host for f in engine.flats)  # no buffer is small enough to stay gathered
    assert all(f.full.untyped_storage().nbytes() == 0 for f in engine.flats)  # freed between uses
    stats = engine.memory_stats()
    shards = sum(f.shard.numel() * f.shard.element_size() for f in engine.flats)
    assert stats["params"] == shards > 200_000  # a stray copy would stand out of the census' slack
    assert stats["device"] == stats["grads"] + stats["buffers"] + stats["temporary"]  # no parameter
    measured = live_tensor_bytes()
    library = stats["device"] + stats["host"]
    assert measured >= library, (measured, library)
    close(measured - library, 0, atol=16 * 1024, what="census beyond memory_stats()")


def test_offloaded_shards_are_the_only_copy():
    spawn(_census, 2)


def _fused(rank: int, world_size: int) -> None:
    """A config "optimizer" section gets the fused CPU kernel over host shards; a user's slow
    Adam is used as given, with one warning."""
    torch.manual_seed(0)
    config = _merge({"zero_optimization": {"stage": 2},
                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, OPTIMIZER)
    engine = zeroshard.initialize(TinyGPT(), None, config)
    assert engine.optimizer.defaults["fused"] is True
    # A checkpoint carries hyperparameters, not how a run computes them: each side keeps its kernel.
    plain = zeroshard.initialize(TinyGPT(), None, {**config, "zero_optimization": {"stage": 2}})
    with tempfile.TemporaryDirectory() as d:
        engine.save_checkpoint(d)
        plain.load_checkpoint(d)
        plain.save_checkpoint(d, tag="plain")
        engine.load_checkpoint(os.path.join(d, "plain"))
    assert engine.optimizer.param_groups[0]["fused"] is True and not plain.optimizer.param_groups[0]["fused"]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zeroshard").addHandler(handler)
    try:
        from zeroshard.core import optim as offload
        offload._SLOW_WARNED.clear()
        for _ in range(2):
            zeroshard.initialize(TinyGPT(), lambda p: torch.optim.Adam(p, lr=1e-3),
                                 _merge({"zero_optimization": {"stage": 2}}, OPTIMIZER))
    finally:
        logging.getLogger("zeroshard").removeHandler(handler)
    slow = [r for r in records if "fused" in r.getMessage()]
    assert len(slow) == 1 and "Adam" in slow[0].getMessage()


def test_offload_uses_the_fused_cpu_kernel():
    spawn(_fused, 1)


def _pins(rank: int, world_size: int) -> None:
    """With pin_memory, the master is pinned only where it is itself copied up (fp32 training, or
    casts on the device, and no shard resting on the host); a 16-bit update goes up through its
    staging buffer, so pinning the master would buy nothing and cost the pinned allocator's
    rounding. (On a CPU nothing is pinned: this reads what the engine asks for.)"""
    from zeroshard.offload.host import Copier

    asked: list[bool] = []
    new_master = Copier.new_master

    def record(self, values, pin):
        asked.append(pin)
        return new_master(self, values, pin)

    Copier.new_master = record
    try:
        cases = {("bf16", "host", False): False, ("fp32", "host", False): True,
                 ("bf16", "device", False): True, ("fp32", "host", True): False}
        for (precision, casts, params), pinned in cases.items():
            asked.clear()
            config = _merge({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                             "bf16": {"enabled": precision == "bf16"},
                             "zeroshard": {"offload_casts": casts}}, OPTIMIZER, PARAMS if params else {})
            zeroshard.initialize(TinyGPT(), lambda p: torch.optim.AdamW(p, lr=1e-3), config)
            assert asked and set(asked) == {pinned}, (precision, casts, params, asked)
    finally:
        Copier.new_master = new_master


def test_a_master_is_pinned_only_where_it_is_copied_up():
    spawn(_pins, 1)


def test_a_failed_delayed_update_is_raised_at_the_step_not_in_backward():
    """The worker's error waits for a call that may raise on every rank alike (step, checkpoint):
    raising inside a backward hook on one rank would leave its peers in their collectives. The
    half-done update never reaches the parameters, and the scheduler does not step for it."""
    from zeroshard.offload.host import Copier
    copier, stepped = Copier(torch.device("cpu")), []

    def update() -> None:
        raise MemoryError("host out of memory")
    copier.start_update(update, then=lambda: stepped.append(1))
    copier.finish_update(raise_error=False)  # what a gradient's download does, inside backward
    assert not copier.unwritten and not stepped
    with pytest.raises(MemoryError, match="host out of memory"):
        copier.finish_update()
    copier.finish_update()  # raised once: the engine can go on (or be dropped)
