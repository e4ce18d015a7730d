"""Checkpoint integrity: every file's size and checksum is recorded at commit and verified before a
tensor is read; a damaged checkpoint is a CheckpointError naming the file (on every rank alike),
offering the newest complete checkpoint when reached through `latest`, and changing nothing. The
metadata is fuzzed: whatever it says, a load succeeds or raises CheckpointError, and a failed load
leaves the engine as it was."""
from __future__ import annotations

import copy
import json
import os
import shutil
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

import zeroshard
from helpers.models import TinyGPT, loss_fn, rank_batch
from helpers.spawn import spawn
from zeroshard.checkpoint import integrity
from zeroshard.checkpoint import save as checkpoint


def _adamw(p):
    return torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)


def _engine(stage: int, seed: int):
    torch.manual_seed(seed)
    return zeroshard.initialize(TinyGPT(), _adamw, {"zero_optimization": {"stage": stage}},
                                lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))


def _step(engine, rank: int, world_size: int) -> None:
    x, y = rank_batch(rank, world_size)
    engine.backward(loss_fn(engine(x), y))
    engine.step()


def _snapshot(engine) -> dict:
    """Everything a load writes: weights, optimizer state and hyperparameters, counters, scaler,
    scheduler, random state."""
    return {"weights": engine.full_state_dict(), "optimizer": copy.deepcopy(engine.optimizer.state_dict()),
            "steps": (engine.global_steps, engine.micro_steps), "scale": engine.loss_scale,
            "scheduler": copy.deepcopy(engine.lr_scheduler.state_dict()), "rng": torch.get_rng_state()}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# ---- two ranks: damage is named on every rank, and nothing changes ------------------------------------
def _save_two(rank: int, world_size: int, directory: str) -> None:
    engine = _engine(3, seed=0)
    _step(engine, rank, world_size)
    engine.save_checkpoint(directory)  # step1
    _step(engine, rank, world_size)
    engine.save_checkpoint(directory)  # step2, named by `latest`
    state = engine.full_state_dict()
    if rank == 0:
        torch.save(state, os.path.join(directory, "..", "state_at_step2.pt"))


def _flip(path: str, at: float = 0.5) -> None:
    """Change one byte in place: the same size, other contents."""
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * at))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _drop_from_manifest(path: str) -> None:
    manifest_path = os.path.join(os.path.dirname(path), integrity.MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    del manifest["files"][os.path.basename(path)]
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


DAMAGE = {  # case -> (file of step2, damage, what the error says about it)
    "truncated": ("__1_0.distcp", _truncate, r"'__1_0.distcp' has \d+ bytes where \d+ were written"),
    "flipped": ("__0_0.distcp", _flip, r"'__0_0.distcp' fails its checksum"),
    "metadata": (".metadata", _flip, r"'.metadata' fails its checksum"),
    "unlisted": ("__1_0.distcp", _drop_from_manifest, r"'__1_0.distcp' is not in the manifest"),
    "no .metadata": (".metadata", os.remove, r"no .metadata"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A parent with step1 and step2 (saved at N=2, stage 3) and a damaged copy per DAMAGE case."""
    root = tmp_path_factory.mktemp("integrity")
    spawn(_save_two, 2, str(root / "good"))
    for case, (name, damage, _) in DAMAGE.items():
        shutil.copytree(root / "good", root / case)
        damage(str(root / case / "step2" / name))
    shutil.copytree(root / "good", root / "no latest")
    os.remove(root / "no latest" / "latest")
    shutil.copytree(root / "good", root / "no manifest")  # copied without its manifests, then altered
    for tag in ("step1", "step2"):
        os.remove(root / "no manifest" / tag / integrity.MANIFEST)
    DAMAGE["flipped"][1](str(root / "no manifest" / "step2" / DAMAGE["flipped"][0]))
    return str(root)


def _load_checks(rank: int, world_size: int, root: str) -> None:
    engine = _engine(2, seed=1234)
    before = _snapshot(engine)
    for case, (_, _, message) in DAMAGE.items():
        if case != "no .metadata":  # named directly: the file and what is wrong with it
            with pytest.raises(zeroshard.CheckpointError, match=message):
                engine.load_checkpoint(os.path.join(root, case, "step2"))
        with pytest.raises(zeroshard.CheckpointError) as error:  # through `latest`: step1 is offered
            engine.load_checkpoint(os.path.join(root, case))
        offered = os.path.join(root, case, "step1")
        assert f"the newest complete checkpoint is '{offered}' (load it by that path, or write 'step1' " \
            f"into {os.path.join(root, case, 'latest')} to resume from it)" in str(error.value)
    with pytest.raises(zeroshard.CheckpointError) as error:  # `latest` deleted: its checkpoints named
        engine.load_checkpoint(os.path.join(root, "no latest"))
    assert "holds checkpoints (step1, step2) but no 'latest' file naming the one to load" in str(error.value)
    missing = os.path.join(root, "never_saved")
    assert engine.load_checkpoint(missing, missing_ok=True) == (None, None)
    with pytest.raises(zeroshard.CheckpointError, match="does not exist"):
        engine.load_checkpoint(missing)
    with pytest.raises(TypeError, match="missing_ok is keyword-only"):  # the old positional flag
        engine.load_checkpoint(missing, True)
    assert _same(_snapshot(engine), before)  # nothing above changed anything
    with pytest.raises(zeroshard.CheckpointError, match="'checksums.json' is missing .*cannot be verified; "
                       "there is no other complete checkpoint"):
        engine.load_checkpoint(os.path.join(root, "no manifest"))  # refused, though DCP would read it
    assert _same(_snapshot(engine), before)
    path, _ = engine.load_checkpoint(os.path.join(root, "good"), "step1")  # DeepSpeed's tag, not latest
    assert path == os.path.join(root, "good", "step1") and engine.global_steps == 1
    assert engine.load_checkpoint(os.path.join(root, "good"))[0] == os.path.join(root, "good", "step2")
    expected = torch.load(os.path.join(root, "state_at_step2.pt"))
    state = engine.full_state_dict()
    assert engine.global_steps == 2 and all(torch.equal(state[k], v) for k, v in expected.items())
    rng = torch.get_rng_state()  # DeepSpeed's load_module_only: the weights, not the run's position
    engine.load_checkpoint(os.path.join(root, "good"), "step1", load_module_only=True)
    assert engine.global_steps == 2 and torch.equal(torch.get_rng_state(), rng)
    assert not all(torch.equal(engine.full_state_dict()[k], v) for k, v in expected.items())


def test_damage_is_named_on_every_rank_and_changes_nothing(saved):
    spawn(_load_checks, 2, saved)


def test_ranks_that_see_different_directories_are_told_so(saved, tmp_path):
    spawn(_apart, 2, saved, str(tmp_path))


def _apart(rank: int, world_size: int, root: str, scratch: str) -> None:
    """Node-local disks: a checkpoint only rank 0 can see. No rank loads it alone, or starts afresh
    while the others load (missing_ok): every rank names what each found. A save into a path rank 0
    cannot create fails on every rank, none left waiting for it."""
    engine = _engine(2, seed=1234)
    before = _snapshot(engine)
    mine = os.path.join(root, "good") if rank == 0 else os.path.join(scratch, "elsewhere")
    found = os.path.join(root, "good", "step2")
    with pytest.raises(zeroshard.CheckpointError, match=f"the ranks find different checkpoints at .*rank 0: "
                                                        f"'{found}'; rank 1: nothing \\(missing_ok\\)"):
        engine.load_checkpoint(mine, missing_ok=True)
    with pytest.raises(zeroshard.CheckpointError, match="rank 1: checkpoint path '.*elsewhere' does not"):
        engine.load_checkpoint(mine)
    assert _same(_snapshot(engine), before)
    a_file = os.path.join(scratch, "a_file")
    open(a_file, "w").close()
    with pytest.raises(zeroshard.CheckpointError, match="cannot save a checkpoint into '.*a_file': .*exists"):
        engine.save_checkpoint(a_file)


def test_checkpoint_info_and_consolidate_verify_too(saved):
    good = zeroshard.checkpoint_info(os.path.join(saved, "good"))
    assert good["tag"] == "step2" and good["global_steps"] == 2 and good["world_size"] == 2
    assert zeroshard.checkpoint_info(os.path.join(saved, "never_saved"), missing_ok=True) is None
    with pytest.raises(zeroshard.CheckpointError, match="does not exist"):
        zeroshard.checkpoint_info(os.path.join(saved, "never_saved"))
    for case, (_, _, message) in DAMAGE.items():
        offered = f"the newest complete checkpoint is '{os.path.join(saved, case, 'step1')}'"
        for read in (zeroshard.checkpoint_info, zeroshard.consolidate):
            with pytest.raises(zeroshard.CheckpointError, match=message) as error:
                read(os.path.join(saved, case))
            assert offered in str(error.value)
    expected = torch.load(os.path.join(saved, "state_at_step2.pt"))
    weights = zeroshard.consolidate(os.path.join(saved, "good"))
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
    for read in (zeroshard.checkpoint_info, zeroshard.consolidate):  # no manifest: nothing is read
        with pytest.raises(zeroshard.CheckpointError, match="'checksums.json' is missing"):
            read(os.path.join(saved, "no manifest"))


def test_the_newest_complete_checkpoint_is_offered(saved, tmp_path):
    parent = tmp_path / "ckpt"
    shutil.copytree(os.path.join(saved, "flipped"), parent)  # step2 (latest) is damaged
    for name in ("step9", "step10", ".step3.tmp", "step3.old"):  # .tmp and .old are never offered
        shutil.copytree(parent / "step1", parent / name)
    _flip(str(parent / "step1" / "__1_0.distcp"))
    os.utime(parent / ".step3.tmp" / ".metadata")  # the most recently written, but not committed
    newest = "the newest complete checkpoint is '{}'"
    with pytest.raises(zeroshard.CheckpointError, match=newest.format(parent / "step10")):
        zeroshard.checkpoint_info(str(parent))  # written at the same moment: step10 follows step9
    os.utime(parent / "step9" / ".metadata")  # written last
    with pytest.raises(zeroshard.CheckpointError, match=newest.format(parent / "step9")):
        zeroshard.checkpoint_info(str(parent))
    for name in ("step9", "step10"):
        shutil.rmtree(parent / name)
    with pytest.raises(zeroshard.CheckpointError, match="there is no other complete checkpoint in"):
        zeroshard.checkpoint_info(str(parent))


# ---- one process: fuzzed metadata and bytes -------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(one_process_group, tmp_path_factory):
    """An engine one step in (so there is optimizer state) and a directory for the fuzzed saves."""
    engine = _engine(2, seed=0)
    _step(engine, 0, 1)
    directory = tmp_path_factory.mktemp("fuzz")
    engine.save_checkpoint(str(directory), tag="base")
    return engine, str(directory)


AREAS = ["format", "shapes", "starts", "elementwise", "trainable", "scalars", "buffers", "param_groups",
         "extra", "extra.global_steps", "extra.scaler", "extra.lr_scheduler", "extra.state_dict_keys", ""]
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2, 2 ** 40), st.integers(), st.floats(),
                 st.text(max_size=3),
                 st.lists(st.integers(-1, 3000), max_size=3), st.tuples(st.integers(-1, 64)),
                 st.lists(st.sampled_from(["step", "exp_avg", "lr"]), max_size=2),
                 st.dictionaries(st.sampled_from(["lr", "exp_avg", "scale"]), st.integers(-1, 3), max_size=2),
                 st.sampled_from(["exp_avg", "exp_avg_sq", "step", "tok.weight", "pos", "blocks.0.ln.bias"]),
                 st.floats(-2, 2).map(torch.tensor), st.sampled_from([torch.zeros(3), torch.tensor(1j),
                                                                      torch.tensor(True), torch.tensor(7)]))
MUTATION = st.tuples(st.sampled_from(AREAS), st.integers(0, 10 ** 6),
                     st.sampled_from(["delete", "replace", "nudge", "add"]), JUNK)


def _paths(obj, prefix: tuple = ()):
    """Every place in a nested structure of dicts, lists and tuples, the root first."""
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        yield from _paths(value, prefix + (key,))


_DELETE = object()


def _at(obj, path: tuple, change):
    """A copy of obj with change(value) at path (_DELETE removes it); the rest is shared."""
    if not path:
        return change(obj)
    key = path[0]
    new = _at(obj[key], path[1:], change)
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    if new is _DELETE:
        del out[key]
    else:
        out[key] = new
    return out if isinstance(obj, (dict, list)) else tuple(out)


def _nudge(value, junk):
    if isinstance(value, bool) or value is None:
        return not value
    if isinstance(value, int):
        return value + (junk if isinstance(junk, int) and not isinstance(junk, bool) else 1)
    if isinstance(value, float):
        return -value if value else 1.0
    if isinstance(value, torch.Tensor):
        return value.reshape(1) if value.dim() == 0 else value[:-1]
    if isinstance(value, str):
        return value + "x"
    return junk


def _mutate(meta: dict, mutation) -> dict:
    area, index, op, junk = mutation
    path = tuple(area.split(".")) if area else ()
    try:
        area_value = meta
        for key in path:
            area_value = area_value[key]
    except Exception:  # an earlier mutation removed or replaced the area
        return meta
    inner = list(_paths(area_value))
    where = path + inner[index % len(inner)]
    if op == "delete":
        return _at(meta, where, lambda v: _DELETE) if where else meta
    if op == "replace":
        return _at(meta, where, lambda v: junk)
    if op == "nudge":
        return _at(meta, where, lambda v: _nudge(v, junk))
    return _at(meta, where, lambda v: _add(v, junk))


def _add(value, junk):
    """One more entry of the container's own kind (a copy of its last), or the junk."""
    if isinstance(value, dict) and not value:
        return {0: junk}  # as group 0's entry (scalars)
    if isinstance(value, dict):
        key = junk if isinstance(junk, (str, int)) else "bogus"
        return {**value, key: copy.copy(list(value.values())[-1])}
    if isinstance(value, (list, tuple)):  # an int: a plausible extra piece start, dimension, ...
        more = junk if isinstance(junk, int) or not value else copy.copy(value[-1])
        return type(value)(list(value) + [more])
    return junk


_count = iter(range(10 ** 9))


def _load_fresh(path: str) -> None:
    """Into a fresh engine (built like the trained one): success, or a CheckpointError that changed
    nothing."""
    engine = _engine(2, seed=next(_count) % 7)
    before = _snapshot(engine)
    try:
        engine.load_checkpoint(path)
        event("loaded")  # --hypothesis-show-statistics: how often each outcome came up
    except zeroshard.CheckpointError as e:
        event(f"CheckpointError: {str(e).split(':')[0][:60]}")
        assert _same(_snapshot(engine), before), "a failed load changed the engine"


EXAMPLES = int(os.environ.get("ZEROSHARD_FUZZ_EXAMPLES", "80"))  # more for a longer hunt, off CI


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_fuzzed_metadata_loads_or_is_a_checkpoint_error(trained, mutations):
    engine, directory = trained
    made = checkpoint._meta  # the honest path: save through zeroshard with the meta mutated

    def mutated(*args):
        meta = made(*args)
        for mutation in mutations:
            meta = _mutate(meta, mutation)
        return meta
    tag = f"m{next(_count)}"
    with mock.patch.object(checkpoint, "_meta", mutated):
        path = engine.save_checkpoint(directory, tag=tag)
    try:
        _load_fresh(path)
    finally:
        shutil.rmtree(path)


@settings(max_examples=EXAMPLES // 2, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.sampled_from([".metadata", "__0_0.distcp", integrity.MANIFEST]), at=st.floats(0, 0.999),
       xor=st.integers(1, 255), truncate=st.booleans(), rewrite_manifest=st.booleans())
def test_corrupt_bytes_load_or_are_a_checkpoint_error(trained, name, at, xor, truncate, rewrite_manifest):
    """Damage the manifest sees is always named; damage it cannot see (the manifest rewritten, as if
    the bytes were bad before they were checksummed) still ends in success or CheckpointError."""
    engine, directory = trained
    path = os.path.join(directory, f"b{next(_count)}")
    shutil.copytree(os.path.join(directory, "base"), path)
    target = os.path.join(path, name)
    with open(target, "r+b") as f:
        data = bytearray(f.read())
        cut = int(len(data) * at)
        data = data[:cut] if truncate else data[:cut] + bytes([data[cut] ^ xor]) + data[cut + 1:]
        f.seek(0)
        f.truncate()
        f.write(data)
    if rewrite_manifest and name != integrity.MANIFEST:
        files = {n: integrity.checksum(os.path.join(path, n)) for n in (".metadata", "__0_0.distcp")}
        with open(os.path.join(path, integrity.MANIFEST), "w") as f:
            json.dump({"format": 1, "algorithm": "crc32", "files": files}, f)
    try:
        if name != integrity.MANIFEST and not rewrite_manifest:
            with pytest.raises(zeroshard.CheckpointError, match=f"'{name}'"):
                engine.load_checkpoint(path)
        _load_fresh(path)
    finally:
        shutil.rmtree(path)
