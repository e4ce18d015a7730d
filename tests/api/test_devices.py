"""Devices: the process group decides where tensors live; a model it cannot use is refused before
any collective, by name; the launcher refuses more ranks than GPUs. Runs without a GPU: a tensor that
only *claims* to be on a GPU stands in for one (it has no memory and refuses every operation)."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.comm import devices
from zeroshard.app import cli, options
from zeroshard.engine.checks import check_model


class Elsewhere(torch.Tensor):
    """A tensor that reports `device` and holds nothing; any use but detach() raises."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], device: torch.device) -> "Elsewhere":
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # nn.Parameter(...) detaches
            return Elsewhere(args[0].shape, args[0].device)
        raise AssertionError(f"{func} ran on a tensor the process group cannot use")


def _on(device: str, buffer: bool = False) -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    if buffer:
        model[1].register_buffer("stat", Elsewhere((2,), torch.device(device)))
    else:
        model[1].weight = nn.Parameter(Elsewhere((2, 4), torch.device(device)))
    return model


@pytest.mark.parametrize("buffer", [False, True])
def test_a_gpu_model_under_gloo_is_refused_before_any_collective(one_process_group, buffer, monkeypatch):
    import torch.distributed as dist
    called = []
    for name in ("broadcast", "all_gather_into_tensor", "all_gather_single", "all_reduce"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, lambda *a, name=name, **k: called.append(name))
    model = _on("cuda:1", buffer)
    with pytest.raises(ValueError) as err:
        zeroshard.initialize(model, lambda p: torch.optim.SGD(p, lr=0.1), {"zero_optimization": {"stage": 3}})
    text = str(err.value)
    what = "buffer '1.stat'" if buffer else "parameter '1.weight'"
    assert f"{what} is on cuda:1" in text and "works on cpu (gloo)" in text
    assert "backend='nccl'" in text and "model.cpu()" in text  # both fixes
    assert called == []
    assert not getattr(model, "_zeroshard_wrapped", False)


def test_a_model_on_another_gpu_is_moved_and_another_kind_refused():
    # Another GPU, or the CPU: moved to this rank's (every rank decides alike, so none waits alone).
    devices.check_placement(nn.Linear(2, 2), torch.device("cuda", 0))
    devices.check_placement(_on("cuda:1"), torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"'1.weight' is on xpu:0, but this rank's process group works "
                                         r"on cuda:0\. Build the model on the CPU"):
        devices.check_placement(_on("xpu:0"), torch.device("cuda", 0))


def test_cpu_parameters_may_mix_with_one_gpu_not_with_two():
    # Tensor parallelism on CUDA moves the split parameters to the GPU and leaves the replicated
    # ones (embeddings, norms) on the CPU: initialize() moves those, so the mix is accepted.
    config = zeroshard.Config.load({"zero_optimization": {"stage": 3}})
    check_model(_on("cuda:0"), config)
    split = _on("cuda:0")
    split[0].weight = nn.Parameter(Elsewhere((4, 4), torch.device("cuda:1")))
    with pytest.raises(ValueError, match=r"one device \(or the CPU\), got \['cuda:0', 'cuda:1'\]"):
        check_model(split, config)


@pytest.mark.parametrize("backend, cuda, expected", [
    ("nccl", True, "cuda:0"), ("cpu:gloo,cuda:nccl", True, "cuda:0"), ("gloo", True, "cpu"),
    ("undefined", True, "cuda:0"),  # init_process_group() with no backend (init_device_mesh("cuda"))
    ("undefined", False, "cpu")])
def test_the_group_device_follows_the_backend(monkeypatch, backend, cuda, expected):
    monkeypatch.setattr(devices.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert devices.group_device() == torch.device(expected)


def test_a_group_the_script_started_works_on_the_ranks_own_gpu(monkeypatch):
    """dist.init_process_group("nccl") under torchrun with no torch.cuda.set_device(): the rank's GPU
    is LOCAL_RANK's, not GPU 0 for every rank; a GPU the script chose, or bound to the group, stays."""
    chosen, current = [], [0]
    monkeypatch.setattr(devices.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(devices.dist, "group", type("G", (), {"WORLD": None}))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.group_device() == torch.device("cuda", 2) and chosen == [2]
    current[0] = 3  # the script's own choice
    assert devices.group_device() == torch.device("cuda", 3) and chosen == [2]


def test_the_process_group_keeps_a_gpu_the_user_chose(monkeypatch):
    chosen, started = [], []
    monkeypatch.setattr(devices.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(devices.dist, "init_process_group", lambda backend, **kw: started.append(backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", devices.BACKEND_ENV):
        monkeypatch.delenv(name, raising=False)
    devices.ensure_process_group()  # a plain `python train.py`: torch.cuda.set_device(...) stands
    assert started == ["nccl"] and chosen == []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    devices.ensure_process_group()  # under a launcher: the rank's own GPU
    assert chosen == [1]


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(devices.BACKEND_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.choose_backend() == "gloo" and devices.choose_backend("gloo") == "gloo"
    with pytest.raises(RuntimeError, match="nccl backend needs CUDA.*backend='gloo'"):
        devices.choose_backend("nccl")
    monkeypatch.setenv(devices.BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match="ZEROSHARD_BACKEND='mpi'"):
        devices.choose_backend()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(devices.BACKEND_ENV, "gloo")
    assert devices.choose_backend() == "gloo"  # the environment overrides the CUDA default
    monkeypatch.delenv(devices.BACKEND_ENV)
    assert devices.choose_backend() == "nccl"


@pytest.mark.parametrize("local_rank, local_world, gpus, visible, expected", [
    (1, 2, 2, None, 1), (0, 1, 1, None, 0), (1, 2, 1, "3", 0),  # the launcher narrowed each rank to one
    (1, 2, 1, None, "2 ranks on this node but 1 CUDA device"), (2, 3, 2, None, "--nproc-per-node 2")])
def test_each_rank_takes_its_own_gpu(monkeypatch, local_rank, local_world, gpus, visible, expected):
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    if isinstance(expected, int):
        assert devices.local_cuda_index() == expected
    else:
        with pytest.raises(RuntimeError, match=expected):
            devices.local_cuda_index()


def test_cli_device_and_rank_count(monkeypatch, capsys):
    def error_of(argv: list[str]) -> str:
        with pytest.raises(SystemExit):
            cli.main(argv)
        return capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device is visible; use --device cpu" in error_of(["train", "--device", "cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "--nproc 2 ranks but 1 GPU(s)" in error_of(["train", "--nproc", "2"])  # auto is cuda here
    assert "or --device cpu" in error_of(["compare", "--device", "cuda", "--nproc", "3"])
    import argparse
    for device, nproc in [("auto", 1), ("cpu", 2)]:  # --nproc defaults: every GPU on cuda, 2 on cpu
        args = argparse.Namespace(device=device, nproc=None)
        options.resolve_device(argparse.ArgumentParser(), args)
        assert (args.device, args.nproc) == ({"auto": "cuda"}.get(device, device), nproc)


@pytest.mark.skipif(devices.other_threads_running() is None, reason="needs /proc (Linux)")
def test_the_exit_waits_for_a_thread_that_is_still_running():
    """The exit hook's wait (_let_workers_finish) sees a thread running outside the GIL, as a gloo
    worker is, and returns once it has stopped: a worker left to the interpreter's teardown aborts
    the process."""
    started, stop = threading.Event(), threading.Event()
    x = torch.randn(256, 256)

    def busy() -> None:
        started.set()
        while not stop.is_set():
            torch.mm(x, x)  # (the GIL released: the thread runs beside the caller)
    worker = threading.Thread(target=busy, daemon=True)
    worker.start()
    started.wait()
    try:
        assert any(devices.other_threads_running() for _ in range(50))
        threading.Timer(0.3, stop.set).start()
        start = time.monotonic()
        devices._let_workers_finish()
        assert time.monotonic() - start >= 0.25  # (it waited for the thread, not a fixed pause)
    finally:
        stop.set()
        worker.join()
    assert not worker.is_alive()
