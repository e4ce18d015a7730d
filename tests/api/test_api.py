"""The public API as users drive it: launchers, evaluation, exports, and backward variations."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import zeroshard
from helpers.spawn import free_port, spawn
from helpers.models import TinyGPT, loss_fn, rank_batch

from helpers import TESTS

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(args: list[str]) -> str:
    # gloo chosen explicitly, so a GPU machine runs these ranks on the CPU too.
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "ZEROSHARD_BACKEND": "gloo"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_torchrun_launch_starts_the_process_group():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                f"--master_port={free_port()}", os.path.join(HERE, "torchrun_script.py"), "3"])
    assert "rank 0/2 backend gloo" in out and "rank 1/2 backend gloo" in out


def test_plain_single_process_is_world_size_one():
    out = _run([sys.executable, os.path.join(HERE, "torchrun_script.py"), "2"])
    assert "rank 0/1 backend gloo" in out


def _api(rank: int, world_size: int) -> None:
    x, y = rank_batch(rank, world_size, per_rank=4)
    torch.manual_seed(0)
    plain = TinyGPT()
    for stage in range(4):
        torch.manual_seed(0)
        engine = zeroshard.initialize(TinyGPT(), lambda p: torch.optim.SGD(p, lr=0.1),
                                      {"zero_optimization": {"stage": stage}})
        # Evaluation under no_grad gives the plain model's output and leaves nothing gathered.
        with torch.no_grad():
            torch.testing.assert_close(engine(x), plain(x))
        assert engine.memory_stats()["temporary"] == 0
        if stage == 3:  # at rest, stage-3 parameters are empty: stray use fails instead of reading junk
            assert engine.module.blocks[0].up.weight.numel() == 0
        # full_state_dict: every name (both tied ones), buffers, loadable into a plain model.
        state = engine.full_state_dict()
        assert "tok.weight" in state and "head.weight" in state and "scale" in state
        fresh = TinyGPT()
        fresh.load_state_dict(state)
        torch.testing.assert_close(fresh(x), plain(x))
        # rank0_only: the same on rank 0, nothing kept elsewhere (the others only join the gathers).
        only = engine.full_state_dict(rank0_only=True)
        if rank == 0:
            assert list(only) == list(state) and all(torch.equal(only[k], state[k]) for k in state)
        else:
            assert only == {}
        # Two half-batch backwards then one step == one full-batch backward then one step.
        split = zeroshard.initialize(_copy(plain), lambda p: torch.optim.SGD(p, lr=0.1),
                                     {"zero_optimization": {"stage": stage}})
        for half in (slice(0, 2), slice(2, 4)):
            split.backward(loss_fn(split(x[half]), y[half]) / 2)
        split.step()
        # The same with overlap_comm: the first backward reduces during backward, the second is
        # reduced at its end and added (stages 0-1 keep their full gradient between them).
        eager = zeroshard.initialize(_copy(plain), lambda p: torch.optim.SGD(p, lr=0.1),
                                     {"zero_optimization": {"stage": stage, "overlap_comm": True}})
        for half in (slice(0, 2), slice(2, 4)):
            eager.backward(loss_fn(eager(x[half]), y[half]) / 2)
        eager.step()
        # The same with the first backward inside no_sync(): nothing is communicated until the second.
        quiet = zeroshard.initialize(_copy(plain), lambda p: torch.optim.SGD(p, lr=0.1),
                                     {"zero_optimization": {"stage": stage}})
        with quiet.no_sync():
            quiet.backward(loss_fn(quiet(x[:2]), y[:2]) / 2)
        reductions = [c.calls for k, c in quiet.comm.window.items()
                      if k.value in ("all_reduce", "reduce_scatter")]
        assert reductions == [0, 0]  # no gradient was communicated inside no_sync()
        quiet.backward(loss_fn(quiet(x[2:]), y[2:]) / 2)
        quiet.step()
        # Every backward of the cycle inside no_sync(), then step(): stages 0-1 reduce at the step;
        # stages 2-3 reduce during backward only, so each rank would update with its own gradient.
        local = zeroshard.initialize(_copy(plain), lambda p: torch.optim.SGD(p, lr=0.1),
                                     {"zero_optimization": {"stage": stage}})
        with local.no_sync():
            for half in (slice(0, 2), slice(2, 4)):
                local.backward(loss_fn(local(x[half]), y[half]) / 2)
            if stage >= 2:
                with pytest.raises(RuntimeError, match="backwards that all ran inside no_sync"):
                    local.step()
            else:
                local.step()
        # The user may call loss.backward() directly; step() finishes the reduction.
        loss_fn(engine(x), y).backward()
        engine.step()
        a, b = engine.full_state_dict(), split.full_state_dict()
        c, d = quiet.full_state_dict(), eager.full_state_dict()
        e = local.full_state_dict() if stage < 2 else a
        for name in a:
            for other in (a, c, d, e):
                torch.testing.assert_close(other[name], b[name], rtol=1e-5, atol=1e-6)


def _copy(model: TinyGPT) -> TinyGPT:
    clone = TinyGPT()
    clone.load_state_dict(model.state_dict())
    return clone


@pytest.mark.parametrize("world_size", [2])
def test_eval_exports_and_backward_variants(world_size):
    spawn(_api, world_size)


def test_helpers_before_the_process_group_starts():
    """A script shards its data before initialize(): the rank and world size come from torchrun's
    variables; alone, the collectives' helpers need no group; among several, they say what to call."""
    script = ("import torch, zeroshard\n"
              "from torch import nn\n"
              "print(zeroshard.rank_and_world_size(), zeroshard.mean_over_ranks(torch.tensor(2.5)),\n"
              "      zeroshard.gather_objects('x'))\n"
              "with zeroshard.init():\n"
              "    deferred = nn.Linear(2, 2)\n"
              "print(zeroshard.is_deferred(deferred), zeroshard.is_deferred(nn.Linear(2, 2)))\n"
              "import os\n"
              "os.environ.update(RANK='1', WORLD_SIZE='3')\n"
              "print(zeroshard.rank_and_world_size())\n"
              "zeroshard.mean_over_ranks(1.0)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.stdout.splitlines() == ["(0, 1) 2.5 ['x']", "True False", "(1, 3)"], done.stdout + done.stderr
    assert "mean_over_ranks() before the process group started: call zeroshard.initialize() or " \
           "zeroshard.ensure_process_group() first" in done.stderr, done.stderr


def test_steps_per_print_prints_without_a_logging_setup(one_process_group, capsys, caplog):
    """DeepSpeed's key prints its line where logging would not show it, and logs it where it would."""
    engine = zeroshard.initialize(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1),
                                  {"steps_per_print": 2})
    for _ in range(4):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[zeroshard] step")]
    assert [line.split(":")[0] for line in printed] == ["[zeroshard] step 2", "[zeroshard] step 4"], printed
    assert "lr [0.1], grad norm" in printed[0] and "model states" in printed[0]
    with caplog.at_level("INFO", logger="zeroshard"):
        for _ in range(2):
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
    assert "step 6: lr [0.1]" in caplog.text and "[zeroshard] step" not in capsys.readouterr().out
