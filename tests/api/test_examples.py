"""The scripts in examples/ run as a user runs them (torchrun, 2 gloo ranks), on tiny settings,
and do what their docstrings say."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import torch
from safetensors.torch import load_file

from helpers import ROOT


def torchrun(script: str, *args: str) -> str:
    env = {**os.environ, "ZEROSHARD_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               os.path.join(ROOT, "examples", script), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def losses(output: str) -> list[float]:
    return [float(v) for v in re.findall(r"step \d+: loss ([\d.]+)", output)]


def test_train_loop_with_a_deepspeed_json():
    out = torchrun("train_loop.py", "--config", os.path.join(ROOT, "examples", "ds_config.json"),
                   "--steps", "30", "--width", "64", "--layers", "2")
    found = losses(out)
    assert len(found) == 2 and found[-1] < 0.8 * found[0], out
    assert "at stage 3 on 2 ranks" in out


def test_offload_example_trains_saves_and_exports(tmp_path):
    out = torchrun("offload_stage3.py", "--steps", "11", "--layers", "2", "--width", "64",
                   "--out", str(tmp_path))
    found = losses(out)
    assert len(found) == 3 and found[-1] < found[0], out
    assert re.search(r"MiB on the device, [\d.]+ MiB on the host", out), out
    weights = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert sorted(weights) == sorted(["out.weight", "out.bias"] + [
        f"blocks.{i}.{j}.{k}" for i in range(2) for j in (0, 1, 3) for k in ("weight", "bias")])
    assert weights["blocks.0.1.weight"].shape == (256, 64) and weights["out.weight"].dtype == torch.float32
