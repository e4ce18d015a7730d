"""Checkpoints: resume at another world size and stage, bit-exact resume, crash safety, offline
consolidation, and clear errors for bad checkpoints."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import zeroshard
from helpers.spawn import spawn
from helpers.margins import SIXTEEN_BIT_ATOL, SIXTEEN_BIT_RTOL, close
from helpers.models import TinyGPT, assert_weights_match, batches, loss_fn, reference_run

GLOBAL_BATCH, FIRST, SECOND = 12, 3, 3


def _adamw(p):
    return torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)


def _scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _engine(stage: int, seed: int, **config):
    torch.manual_seed(seed)
    return zeroshard.initialize(TinyGPT(), _adamw, {"zero_optimization": {"stage": stage}, **config},
                                lr_scheduler=_scheduler)


def _train(engine, rank: int, world_size: int, steps: range) -> list[float]:
    local = GLOBAL_BATCH // world_size
    data = batches(steps.stop, GLOBAL_BATCH)
    losses = []
    for step in steps:
        x, y = data[step]
        loss = loss_fn(engine(x[rank * local:(rank + 1) * local], use_sometimes=step % 2 == 0),
                       y[rank * local:(rank + 1) * local])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def reference_state() -> dict[str, torch.Tensor]:
    """One process, FIRST + SECOND steps without interruption."""
    def model() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT()
    return reference_run(model, _adamw, FIRST + SECOND, GLOBAL_BATCH, scheduler=_scheduler)[0].state_dict()


def _save(rank: int, world_size: int, stage: int, directory: str) -> None:
    engine = _engine(stage, seed=0)
    _train(engine, rank, world_size, range(FIRST))
    path = engine.save_checkpoint(directory, client_state={"next_step": FIRST})
    torch.save(engine.full_state_dict(), os.path.join(directory, f"full_at_save_{rank}.pt"))
    assert os.path.basename(path) == f"step{FIRST}"


def _resume(rank: int, world_size: int, stage: int, directory: str) -> None:
    engine = _engine(stage, seed=1234)  # another seed: nothing may lean on the initialisation
    path, client = engine.load_checkpoint(directory)  # DeepSpeed's pair
    assert os.path.basename(path) == f"step{FIRST}"
    assert client == {"next_step": FIRST} and engine.global_steps == FIRST
    _train(engine, rank, world_size, range(FIRST, FIRST + SECOND))
    assert_weights_match(engine, reference_state(), 1e-5, 2e-6, f"resumed at stage {stage}, N={world_size}:")


@pytest.mark.parametrize("saved, resumed", [((2, 3), (3, 1)), ((3, 2), (2, 3)), ((2, 1), (1, 0))])
def test_resume_at_another_world_size_and_stage(tmp_path, saved, resumed):
    spawn(_save, saved[0], saved[1], str(tmp_path))
    spawn(_resume, resumed[0], resumed[1], str(tmp_path))


def _bit_exact(rank: int, world_size: int, directory: str) -> None:
    # A short loss_scale_window: the scale grows during the first run, so it must come back on load.
    config = {"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 2}}
    straight = _engine(3, seed=0, **config)
    expected = _train(straight, rank, world_size, range(FIRST + SECOND))
    expected_state = straight.full_state_dict()
    expected_draw = torch.rand(3)  # the RNG stream continues exactly too
    first = _engine(3, seed=0, **config)
    losses = _train(first, rank, world_size, range(FIRST))
    first.save_checkpoint(directory)
    torch.manual_seed(99)
    resumed = _engine(3, seed=7, **config)
    resumed.load_checkpoint(directory)
    losses += _train(resumed, rank, world_size, range(FIRST, FIRST + SECOND))
    assert losses == expected  # bit for bit
    assert resumed.loss_scale == straight.loss_scale == 2.0 ** 15
    assert resumed.skipped_steps == straight.skipped_steps
    state = resumed.full_state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected_state.items())
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG stream continues exactly too


def test_resume_is_bit_exact_at_the_same_world_size_and_stage(tmp_path):
    spawn(_bit_exact, 2, str(tmp_path))


def _sgd(p):  # scale-sensitive: the 16-bit cases are compared with fp32 training
    return torch.optim.SGD(p, lr=0.05, momentum=0.9)


RESUME_CASES = {  # name -> (config at save, config at resume, (N, stage) saved, (N, stage) resumed)
    "bf16, offloaded when saved": ({"bf16": {"enabled": True}, "zero_optimization": {"offload_optimizer": {
        "device": "cpu"}}}, {"bf16": {"enabled": True}}, (2, 3), (3, 1)),
    "fp16": ({"fp16": {"enabled": True, "initial_scale_power": 8}},) * 2 + ((3, 2), (2, 3)),
    # The saved loss scale (256) must not reach the bf16 run, which has none. Fused AdamW decides its
    # step on the device, where a leftover scale would go unnoticed: the gradient never unscaled.
    "fp16 saved, resumed in bf16": ({"fp16": {"enabled": True, "initial_scale_power": 8}},
                                    {"bf16": {"enabled": True}}, (2, 2), (3, 3)),
    "fp32, offloaded": ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},) * 2
                       + ((2, 1), (3, 3)),
}
OPTIMIZERS = {"fp16 saved, resumed in bf16": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)}


def _sgd_engine(config: dict, stage: int, seed: int, name: str = ""):
    """SGD, or the case's own optimizer (OPTIMIZERS)."""
    torch.manual_seed(seed)
    zero = {**config.get("zero_optimization", {}), "stage": stage}
    return zeroshard.initialize(TinyGPT(), OPTIMIZERS.get(name, _sgd), {**config, "zero_optimization": zero},
                                lr_scheduler=_scheduler)


def _save_case(rank: int, world_size: int, stage: int, directory: str, name: str) -> None:
    engine = _sgd_engine(RESUME_CASES[name][0], stage, seed=0, name=name)
    _train(engine, rank, world_size, range(FIRST))
    engine.save_checkpoint(directory)


def _resume_case(rank: int, world_size: int, stage: int, directory: str, name: str) -> None:
    config = RESUME_CASES[name][1]
    engine = _sgd_engine(config, stage, seed=1234, name=name)  # another seed: nothing may lean on the init
    engine.load_checkpoint(directory)
    _train(engine, rank, world_size, range(FIRST, FIRST + SECOND))
    norms: list[float] = []
    reference = reference_run(lambda: (torch.manual_seed(0), TinyGPT())[1], OPTIMIZERS.get(name, _sgd),
                              FIRST + SECOND, GLOBAL_BATCH, scheduler=_scheduler, norms=norms)[0].state_dict()
    exact = not ({"bf16", "fp16"} & set(config))
    rtol, atol = (1e-5, 2e-6) if exact else (SIXTEEN_BIT_RTOL, SIXTEEN_BIT_ATOL)
    what = f"{name}, resumed at stage {stage}, N={world_size}"
    if name not in OPTIMIZERS:  # (AdamW magnifies 16-bit rounding where a gradient is near zero)
        assert_weights_match(engine, reference, rtol, atol, f"{what}:")
    # The gradient's scale (SGD's few small steps could hide it within the weights' atol).
    close([engine.last_grad_norm], norms[-1:], rtol=rtol, what=f"{what}: the gradient norm")


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_16bit_and_offload_checkpoints_resume_at_another_world_size(tmp_path, name):
    _, _, saved, resumed = RESUME_CASES[name]
    spawn(_save_case, saved[0], saved[1], str(tmp_path), name)
    spawn(_resume_case, resumed[0], resumed[1], str(tmp_path), name)


def _crash_during_commit(rank: int, world_size: int, directory: str) -> None:
    engine = _engine(2, seed=0)
    _train(engine, rank, world_size, range(1))
    engine.save_checkpoint(directory, tag="good")
    _train(engine, rank, world_size, range(1, 2))
    if rank == 0:  # the process is killed just as it would commit the second checkpoint
        os.replace = lambda *args: os._exit(17)
    engine.save_checkpoint(directory, tag="doomed")


def _load_latest(rank: int, world_size: int, directory: str) -> None:
    engine = _engine(2, seed=5)
    engine.load_checkpoint(directory)
    assert engine.global_steps == 1
    engine.save_checkpoint(directory, tag="doomed")  # the leftovers do not get in the way


def test_a_crash_during_save_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(Exception):
        spawn(_crash_during_commit, 2, str(tmp_path))
    assert open(tmp_path / "latest").read() == "good"
    assert not (tmp_path / "doomed").exists()
    spawn(_load_latest, 2, str(tmp_path))
    assert open(tmp_path / "latest").read() == "doomed"


def _crash_between_the_renames(rank: int, world_size: int, directory: str) -> None:
    engine = _engine(2, seed=0)
    _train(engine, rank, world_size, range(1))
    engine.save_checkpoint(directory, tag="last")
    _train(engine, rank, world_size, range(1, 2))
    if rank == 0:  # killed after moving the old "last" aside, before the new one takes its name
        moved = []
        real = os.replace
        os.replace = lambda a, b: os._exit(17) if moved else (moved.append(a), real(a, b))[1]
    engine.save_checkpoint(directory, tag="last")  # the same tag again: DeepSpeed users' habit


def _load_after_the_crash(rank: int, world_size: int, directory: str) -> None:
    engine = _engine(2, seed=5)
    path, _ = engine.load_checkpoint(directory)
    assert os.path.basename(path) == "last.old" and engine.global_steps == 1, path
    engine.save_checkpoint(directory, tag="last")  # and the tag is saved again as usual


def test_a_crash_between_the_commit_renames_loses_nothing(tmp_path):
    """Re-saving a tag moves the old one aside first; killed there, `latest` names a tag that is
    gone: the load takes the one moved aside (the checkpoint `latest` named), with a warning."""
    with pytest.raises(Exception):
        spawn(_crash_between_the_renames, 2, str(tmp_path))
    assert open(tmp_path / "latest").read() == "last" and not (tmp_path / "last").exists()
    spawn(_load_after_the_crash, 2, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["last", "latest"]


def _save_onto_a_full_disk(rank: int, world_size: int, directory: str) -> None:
    import resource
    import signal
    engine = _engine(2, seed=0)
    _train(engine, rank, world_size, range(1))
    engine.save_checkpoint(directory, tag="good")
    _train(engine, rank, world_size, range(1, 2))
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # this rank's writes fail past 2 KiB, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, limits[1]))
    with pytest.raises(zeroshard.CheckpointError, match="'full' not saved.*rank 1.*File too large") as e:
        engine.save_checkpoint(directory, tag="full")
    assert "untouched" in str(e.value) and "save again" in str(e.value), e.value
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert sorted(os.listdir(directory)) == ["good", "latest"]  # the partial files are gone
    _train(engine, rank, world_size, range(2, 3))  # the engine trains on, and saves
    engine.save_checkpoint(directory, tag="later")
    assert engine.load_checkpoint(directory)[0].endswith("later")


def test_a_failed_write_is_one_clear_error_and_leaves_nothing_behind(tmp_path):
    spawn(_save_onto_a_full_disk, 2, str(tmp_path))


def _latest_not_moved(rank: int, world_size: int, directory: str) -> None:
    import errno
    engine = _engine(2, seed=0)
    _train(engine, rank, world_size, range(1))
    engine.save_checkpoint(directory, tag="a")
    replace = os.replace

    def full(src, dst):  # the disk fills with the checkpoint's last byte: the pointer cannot move
        if str(dst).endswith("latest"):
            raise OSError(errno.ENOSPC, "No space left on device")
        replace(src, dst)

    os.replace = full
    try:
        saved = "checkpoint 'b' saved, complete, at .*, but 'latest' could not be moved to it .No space left"
        with pytest.raises(zeroshard.CheckpointError, match=saved):
            engine.save_checkpoint(directory, tag="b")
    finally:
        os.replace = replace
    assert open(os.path.join(directory, "latest")).read() == "a"
    assert sorted(os.listdir(directory)) == ["a", "b", "latest"]  # b kept: complete, loadable by its tag
    assert engine.load_checkpoint(directory, tag="b")[0].endswith("b") and engine.global_steps == 1


def test_a_latest_that_cannot_move_is_said_and_the_checkpoint_kept(tmp_path):
    """A save whose files and manifest are written but whose `latest` pointer cannot be moved (the
    disk full by then) says so: the checkpoint is complete and kept, loadable by its tag. Before,
    the error said it was not saved and its files removed, while it stood complete."""
    spawn(_latest_not_moved, 2, str(tmp_path))


def _leftovers_swept(rank: int, world_size: int, directory: str) -> None:
    engine = _engine(1, seed=0)
    _train(engine, rank, world_size, range(1))
    engine.save_checkpoint(directory, tag="step1")
    listed = "/step9' does not exist; the checkpoints beside it: step1, step2"
    with pytest.raises(zeroshard.CheckpointError, match=listed):
        engine.load_checkpoint(directory, tag="step9")


def test_leftovers_of_interrupted_saves_go_and_a_wrong_tag_lists_the_tags(tmp_path):
    (tmp_path / ".step7.tmp").mkdir()  # an interrupted save of another tag
    (tmp_path / ".step7.tmp" / "__0_0.distcp").write_bytes(b"x" * 100)
    (tmp_path / "step2").mkdir()
    (tmp_path / "step2" / ".metadata").write_bytes(b"")  # listed as a checkpoint, not loaded
    spawn(_leftovers_swept, 2, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["latest", "step1", "step2"]


def test_consolidate_offline_into_a_plain_model(tmp_path):
    spawn(_save, 3, 3, str(tmp_path))
    weights = zeroshard.consolidate(str(tmp_path))  # no process group in this process
    at_save = torch.load(tmp_path / "full_at_save_0.pt")
    assert list(weights) == list(at_save)
    assert all(torch.equal(weights[k], at_save[k]) for k in at_save)
    out = tmp_path / "model.safetensors"
    done = subprocess.run([sys.executable, "-m", "zeroshard", "consolidate", str(tmp_path), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file
    plain = TinyGPT()
    plain.load_state_dict(load_file(str(out)))  # strict: every name, no zeroshard needed
    assert torch.equal(plain.tok.weight, at_save["tok.weight"]) and plain.head.weight is plain.tok.weight


def _bad_checkpoints(rank: int, world_size: int, directory: str) -> None:
    engine = _engine(1, seed=0)
    before = engine.full_state_dict()
    cases = {
        os.path.join(directory, "nowhere"): "does not exist",
        os.path.join(directory, "empty"): "not a complete checkpoint",
    }
    for path, message in cases.items():
        with pytest.raises(zeroshard.CheckpointError, match=message):
            engine.load_checkpoint(path)
    torch.manual_seed(0)
    other = zeroshard.initialize(TinyGPT(d=20), _adamw, {"zero_optimization": {"stage": 1}})
    with pytest.raises(zeroshard.CheckpointError,
                       match=r"another model: '[a-z_.]+' has shape \(16, 16\) there, \(20, 20\) here"):
        other.load_checkpoint(os.path.join(directory, "saved"))
    torch.manual_seed(0)
    untied = TinyGPT()
    untied.head.weight = torch.nn.Parameter(untied.tok.weight.detach().clone())  # tie_word_embeddings=False
    untied = zeroshard.initialize(untied, _adamw, {"zero_optimization": {"stage": 1}})
    with pytest.raises(zeroshard.CheckpointError, match=r"missing \['head.weight'\].*tied \['head.weight'\] "
                                                        r"to another parameter"):
        untied.load_checkpoint(os.path.join(directory, "saved"))
    torch.manual_seed(0)
    counted = TinyGPT()
    counted.register_buffer("seen", torch.zeros(2))  # a buffer added since the save
    counted = zeroshard.initialize(counted, _adamw, {"zero_optimization": {"stage": 1}})
    with pytest.raises(zeroshard.CheckpointError, match=r"another model: buffers missing \['seen'\]"):
        counted.load_checkpoint(os.path.join(directory, "saved"))
    with pytest.raises(zeroshard.CheckpointError, match="cannot read checkpoint"):
        engine.load_checkpoint(os.path.join(directory, "corrupt"))
    sgd = zeroshard.initialize(TinyGPT(), _sgd, {"zero_optimization": {"stage": 1}})
    with pytest.raises(zeroshard.CheckpointError, match=r"holds AdamW's state, but this engine's optimizer "
                                                        r"is SGD.*load_optimizer_states=False"):
        sgd.load_checkpoint(os.path.join(directory, "saved"))
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was modified


def _weights_alone(rank: int, world_size: int, stage: int, directory: str) -> None:
    """A checkpoint's weights under another optimizer train as if the model had been built with
    them: compared with one process that loads the weights saved and trains with SGD from scratch."""
    engine = _sgd_engine({}, stage, seed=5)
    _, client = engine.load_checkpoint(directory, load_optimizer_states=False)
    assert client == {"next_step": FIRST} and engine.global_steps == FIRST
    assert engine.optimizer.param_groups[0]["lr"] == 0.05  # SGD's own, not AdamW's saved 1e-2
    _train(engine, rank, world_size, range(SECOND))

    def saved_model() -> TinyGPT:
        model = TinyGPT()
        model.load_state_dict(torch.load(os.path.join(directory, "full_at_save_0.pt")))
        return model
    reference = reference_run(saved_model, _sgd, SECOND, GLOBAL_BATCH, scheduler=_scheduler)[0]
    assert_weights_match(engine, reference.state_dict(), 1e-5, 2e-6, f"weights alone at stage {stage}:")


def test_weights_alone_load_under_another_optimizer(tmp_path):
    spawn(_save, 2, 3, str(tmp_path))
    spawn(_weights_alone, 3, 2, str(tmp_path))


def test_bad_checkpoints_are_named_and_change_nothing(tmp_path):
    saved = tmp_path / "saved"
    spawn(_save, 2, 1, str(saved))
    (tmp_path / "empty").mkdir()
    corrupt = tmp_path / "corrupt"
    spawn(_save, 2, 1, str(corrupt))
    for name in os.listdir(corrupt / "step3"):
        if name.endswith(".distcp") and name.startswith("__1"):
            with open(corrupt / "step3" / name, "r+b") as f:
                f.truncate(100)
    spawn(_bad_checkpoints, 2, str(tmp_path))


@pytest.mark.parametrize("tag, error", [
    ("latest", ValueError), (".hidden", ValueError), ("a/b", ValueError), ("../outside", ValueError),
    ("x.old", ValueError), ("", ValueError), (100, TypeError)])
def test_a_tag_that_cannot_name_a_checkpoint_is_refused_before_writing(one_process_group, tmp_path, tag,
                                                                       error):
    engine = zeroshard.initialize(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(error, match="tag"):
        engine.save_checkpoint(str(tmp_path / "ckpt"), tag=tag)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "outside").exists()


def test_consolidate_gives_what_full_state_dict_gives_in_bf16(one_process_group, tmp_path):
    """A bf16 run's floating buffers come out in fp32 from both exports, as its parameters do."""
    engine = _engine(3, seed=0, bf16={"enabled": True})
    _train(engine, 0, 1, range(1))
    engine.save_checkpoint(str(tmp_path))
    full, weights = engine.full_state_dict(), zeroshard.consolidate(str(tmp_path))
    assert list(weights) == list(full) and weights["scale"].dtype == torch.float32
    assert all(weights[k].dtype == v.dtype and torch.equal(weights[k], v) for k, v in full.items())


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_save_with_gradients_not_yet_stepped_is_refused(one_process_group, tmp_path, accumulation):
    """A checkpoint holds no gradients: a save after a backward and before the step() that ends its
    cycle would lose them (before, a backward then a save went through whenever no step() had come
    between: the resumed cycle was missing that micro-batch, or its step() found no backward)."""
    engine = _engine(2, seed=0, gradient_accumulation_steps=accumulation)
    x, y = batches(1, 2)[0]
    refused = "save_checkpoint.. in the middle of gradient accumulation"
    for _ in range(accumulation):
        engine.backward(loss_fn(engine(x), y))
        with pytest.raises(RuntimeError, match=refused):
            engine.save_checkpoint(str(tmp_path))
        engine.step()
    assert engine.global_steps == 1
    engine.save_checkpoint(str(tmp_path))  # the cycle ended: nothing pending


def test_a_resumed_scalar_goes_where_the_loading_optimizer_keeps_it():
    """Adam's `step` is saved wherever the saving run kept it: on the CPU from a CPU, offloaded or
    unfused run. A fused (or capturable) group keeps it beside its parameters, in fp32, and a fused
    kernel on the GPU reads it there: resumed as saved, it got a host pointer. As torch's own
    load_state_dict: a fused group's step goes to the master's device, an unfused one's stays on the
    CPU, and any other scalar tensor goes to the master's device and dtype. (The master on the meta
    device stands in for a GPU's.)"""
    from types import SimpleNamespace

    from zeroshard.checkpoint.load import _fresh_state

    master = torch.empty(6, device="meta")
    flat = SimpleNamespace(master=master, opt_param=torch.nn.Parameter(master), group=0, copier=None)
    meta = {"elementwise": ["exp_avg"], "scalars": {0: {"step": torch.tensor(7.0, dtype=torch.float64),
                                                         "mu_product": torch.tensor(0.5), "count": 3}}}
    for fused, step_device in ((True, "meta"), (False, "cpu")):
        optimizer = SimpleNamespace(param_groups=[{"params": [flat.opt_param], "fused": fused}], state={})
        _fresh_state(meta, flat, optimizer)
        state = optimizer.state[flat.opt_param]
        assert state["step"].device.type == step_device and state["count"] == 3, state
        assert state["step"].dtype == (torch.float32 if fused else torch.float64)
        assert state["mu_product"].device.type == "meta" and state["exp_avg"].shape == (6,)
