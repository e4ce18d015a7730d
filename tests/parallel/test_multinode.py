"""A multi-node launch as users run one, on this machine: two torchrun launchers of 2 ranks each
(`--nnodes=2 --rdzv_backend=c10d`, the command README.md quotes) train the same run as one launcher
of 4 ranks, bit for bit, at stage 3 and under MiCS; the ranks learn their nodes from torchrun, and
the bytes that crossed nodes are counted; the checkpoint resumes with one launcher of 2."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

import zeroshard
from helpers import ROOT
from helpers.spawn import free_port

SCRIPT = os.path.join(ROOT, "examples", "train_loop.py")
TINY = ["--steps", "4", "--width", "32", "--layers", "2", "--seq", "16", "--batch", "2"]


def _command(nnodes: int, node_rank: int, nproc: int, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node_rank}",
            f"--nproc-per-node={nproc}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", *args]


def _launcher(nnodes: int, node_rank: int, nproc: int, port: int, *args: str) -> subprocess.Popen:
    command = _command(nnodes, node_rank, nproc, port, SCRIPT, *args)
    env = {**os.environ, "ZEROSHARD_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(nodes: int, per_node: int, *args: str) -> str:
    """`nodes` launchers of `per_node` ranks, started together; rank 0's output."""
    port = free_port()
    launchers = [_launcher(nodes, n, per_node, port, *args) for n in range(nodes)]
    outputs = []
    for launcher in launchers:
        try:
            out, err = launcher.communicate(timeout=300)
        finally:
            launcher.kill()
        assert launcher.returncode == 0, out[-3000:] + err[-3000:]
        outputs.append(out)
    return "".join(outputs)


def across_nodes(output: str) -> float:
    return float(re.search(r"([\d.]+) MiB across nodes", output).group(1))


def _same_weights(a: str, b: str) -> None:
    first, second = zeroshard.consolidate(a), zeroshard.consolidate(b)
    assert list(first) == list(second)
    assert all(torch.equal(first[k], second[k]) for k in first), (a, b)


EXAMPLE_CONFIG = os.path.join(ROOT, "examples", "ds_config.json")


def test_the_readme_quotes_this_command():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if "--nnodes=2" in line]
    words = shlex.split(line)
    assert os.path.basename(words[0]) == "torchrun"
    ours = _command(2, 0, 2, 29500, "examples/train_loop.py", "--config", "examples/ds_config.json")
    assert words[1:] == ours[3:], (words, ours)


@pytest.mark.parametrize("mics", [False, True], ids=["stage3", "mics2"])
def test_two_launchers_train_as_one(mics, tmp_path):
    """The README's command (examples/ds_config.json: stage 3), and the same with mics_shard_size 2."""
    config = tmp_path / "ds_config.json"
    with open(EXAMPLE_CONFIG) as f:
        values = json.load(f)
    values["zero_optimization"]["mics_shard_size"] = 2 if mics else -1
    config.write_text(json.dumps(values))
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    split = run(2, 2, "--config", str(config), *TINY, "--save", two)
    whole = run(1, 4, "--config", str(config), *TINY, "--save", one)
    assert "on 4 ranks" in split and "on 4 ranks" in whole
    _same_weights(two, one)
    # One launcher is one node: nothing crosses. Two nodes: stage 3's every collective spans both;
    # MiCS 2 keeps the shard groups inside a node and sends only the replicas' all-reduce across.
    assert across_nodes(whole) == 0 and across_nodes(split) > 0
    resumed = str(tmp_path / "resumed")
    run(1, 2, "--config", str(config), *TINY[:1], "0", *TINY[2:], "--resume", two, "--save", resumed)
    _same_weights(two, resumed)
