"""Disk offload's error cases: a bad nvme_path, too little free space (the probe injected), a leftover
directory of a killed run (refused, or reclaimed by an elastic restart of that run), bad keys; and
no file left behind: not after a failed initialize, not after an exception ends the process."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import zeroshard
from helpers import ROOT
from helpers.models import TinyGPT
from zeroshard.offload.nvme import set_free_space_probe


def _config(path: str, **extra) -> dict:
    return {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": path},
                                  "offload_param": {"device": "nvme", "nvme_path": path}}, **extra}


def _initialize(path: str, **kwargs):
    torch.manual_seed(0)
    return zeroshard.initialize(TinyGPT(), lambda p: torch.optim.AdamW(p, lr=1e-3), _config(path), **kwargs)


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True)
    return int(done.stdout)


def _leftover(root, run: str, pid: int) -> str:
    rank_dir = root / run / "rank0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "owner.json").write_text(json.dumps({"host": os.uname().nodename, "pid": pid}))
    (rank_dir / "flat1.master").write_bytes(b"old")
    return str(rank_dir)


@pytest.mark.parametrize("where, words", [
    ("missing", ["nvme_path", "does not exist"]),
    ("a file", ["nvme_path", "not a directory"]),
    ("/sys", ["nvme_path '/sys' is not writable"]),
])
def test_a_bad_nvme_path_is_named_before_any_file(one_process_group, tmp_path, where, words):
    path = {"missing": str(tmp_path / "missing"), "a file": str(tmp_path / "file"), "/sys": "/sys"}[where]
    (tmp_path / "file").write_text("")
    model_before = TinyGPT()
    with pytest.raises(zeroshard.ConfigError) as err:
        _initialize(path)
    for word in words:
        assert word in str(err.value), str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["file"] and model_before is not None


def test_too_little_free_space_is_named_before_any_file(one_process_group, tmp_path):
    asked = []
    set_free_space_probe(lambda path: asked.append(path) or 10_000)
    try:
        with pytest.raises(zeroshard.ConfigError, match=r"GiB free, but disk offload will write"):
            _initialize(str(tmp_path))
    finally:
        set_free_space_probe(None)
    assert asked and not os.listdir(tmp_path)
    engine = _initialize(str(tmp_path))  # the real probe: there is room
    stats = engine.memory_stats()
    assert stats["disk"] > 0 and os.listdir(tmp_path)


def test_one_directory_spelled_two_ways_is_one_place(one_process_group, tmp_path, caplog):
    """The optimizer's and the parameters' nvme_path as `/d` and `/d/.`: one run directory, one
    free-space check of both needs (not two, each seeing half), and no "reclaiming" of the first."""
    config = _config(str(tmp_path))
    config["zero_optimization"]["offload_param"]["nvme_path"] = os.path.join(str(tmp_path), ".")
    asked = []
    set_free_space_probe(lambda path: asked.append(path) or 1 << 40)
    try:
        with caplog.at_level(logging.WARNING, logger="zeroshard"):
            engine = zeroshard.initialize(TinyGPT(), lambda p: torch.optim.AdamW(p, lr=1e-3), config)
    finally:
        set_free_space_probe(None)
    assert len(asked) == 1 and "reclaiming" not in caplog.text, (asked, caplog.text)
    (run,) = os.listdir(tmp_path)
    assert os.listdir(tmp_path / run) == ["rank0"] and engine.memory_stats()["disk"] > 0


def test_a_leftover_directory_is_refused_unless_an_elastic_restart_reclaims_it(
        one_process_group, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run1")
    old = _leftover(tmp_path, "zeroshard-run1", _dead_pid())
    with pytest.raises(zeroshard.ConfigError, match=r"left by a killed run\); this run will not reuse it"):
        _initialize(str(tmp_path))
    assert sorted(os.listdir(old)) == ["flat1.master", "owner.json"]  # untouched
    other = _leftover(tmp_path, "zeroshard-other", _dead_pid())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the same run, restarted: reclaimed
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        engine = _initialize(str(tmp_path))
    assert engine.memory_stats()["disk"] > 0
    owner = json.loads(open(os.path.join(old, "owner.json")).read())
    assert owner["pid"] == os.getpid() and len(os.listdir(old)) > 2  # this engine's own files now
    assert any("zeroshard-other" in r.getMessage() and "killed run" in r.getMessage() for r in caplog.records)
    assert os.path.exists(other)  # reported, never touched


def test_no_file_outlives_a_failed_initialize(one_process_group, tmp_path):
    def bad_scheduler(optimizer):
        raise RuntimeError("scheduler failed")
    with pytest.raises(RuntimeError, match="scheduler failed"):
        _initialize(str(tmp_path), lr_scheduler=bad_scheduler)
    assert not os.listdir(tmp_path)


def test_no_file_outlives_a_process_ended_by_an_exception(tmp_path):
    script = (f"import torch, zeroshard, sys; sys.path.insert(0, {os.path.join(ROOT, 'tests')!r}); "
              f"from helpers.models import TinyGPT; "
              f"e = zeroshard.initialize(TinyGPT(), lambda p: torch.optim.SGD(p, lr=0.1), "
              f"{_config(str(tmp_path))!r}); "
              f"assert e.memory_stats()['disk'] > 0; raise SystemExit('boom' if 0 else 3)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    assert done.returncode == 3, done.stderr
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("raw, words", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     ["offload_optimizer.device", "needs zero_optimization.offload_optimizer.nvme_path"]),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}},
      "zeroshard": {"delayed_param_update": True}}, ["delayed_param_update", "nvme"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": 3}}},
     ["nvme_path", "string"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "buffer_count": 0}}},
     ["offload_optimizer.buffer_count", ">= 1"]),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "max_in_cpu": -1}}}, ["max_in_cpu", ">= 0"]),
    ({"aio": {"block_size": 0}}, ["aio.block_size", ">= 1"]),
    ({"aio": {"single_submit": 1}}, ["aio.single_submit", "true or false"]),
    ({"aio": {"use_gds": True}}, ["aio.use_gds", "not implemented"]),
    ({"aio": {"queue": 8}}, ["aio.queue", "accepted", "queue_depth"]),
])
def test_bad_disk_offload_keys_are_named(raw, words):
    with pytest.raises(zeroshard.ConfigError) as err:
        zeroshard.Config.load(raw)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_the_deepspeed_disk_offload_keys_are_accepted():
    cfg = zeroshard.Config.load({
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme",
                                                                "buffer_count": 4, "pin_memory": True},
                              "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 5,
                                                "buffer_size": 1e8, "max_in_cpu": 1e9}},
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True}})
    assert cfg.zero.offload_optimizer and cfg.zero.offload_param and cfg.nvme.optimizer and cfg.nvme.params
    assert cfg.nvme.optimizer_path == "/nvme" and cfg.nvme.buffer_count == 4 and cfg.nvme.max_in_cpu == 10**9
    assert cfg.nvme.aio["block_size"] == 1048576


def test_two_engines_of_one_run_get_a_directory_each(one_process_group, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run2")
    first, second = _initialize(str(tmp_path)), _initialize(str(tmp_path))
    assert sorted(os.listdir(tmp_path / "zeroshard-run2")) == ["rank0", "rank0.1"]
    assert first.memory_stats()["disk"] == second.memory_stats()["disk"] > 0


def test_a_disk_filled_after_initialize_is_named_with_the_file(tmp_path, monkeypatch):
    """The free space is checked at initialize, but another process may take it before a file is
    made (the optimizer state's, at the first step): posix_fallocate's ENOSPC is an OSError naming
    the file and the cause, and leaves no file. Before, the file was made sparse, and a write
    through its map later killed the process with SIGBUS."""
    import errno

    from zeroshard.offload.nvme.store import DiskStore

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    store = DiskStore({"optimizer": str(tmp_path)})
    with pytest.raises(OSError, match="disk offload .nvme_path.: reserving 0.0 MiB for .*x.exp_avg: No space "
                                      "left on device: the disk filled after initialize.. checked"):
        store.new_tensor("optimizer", "x.exp_avg", 1000, torch.float32)
    assert os.listdir(tmp_path) == []
