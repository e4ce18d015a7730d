"""On one GPU, skipped without CUDA: the path most users meet ZeRO by, Hugging Face's Trainer with a
DeepSpeed config on a single GPU (stage 3 + offload_optimizer: cpu, the config as written).

ZeroTrainer against the standard Trainer, each in a fresh process of one rank (benchmarks/
seed_replication.py's runs, a small BERT classifier built from config), fp32 on the GPU. The
offloaded optimizer steps on the host while Trainer's steps on the GPU: the same AdamW, but other
kernels, so the last bits differ (on the CPU, where both step on the host, the losses differed by at
most 2.4e-7). A lost update, a gradient not copied down or parameters not copied up moves a loss by
far more than LOSS_RTOL. Memory: the optimizer state (8Ψ of Adam moments) is on the host, so the
GPU's peak must be below the standard Trainer's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT
from helpers.margins import close

pytestmark = pytest.mark.cuda
SCRIPT = os.path.join(ROOT, "benchmarks", "seed_replication.py")
LOSS_RTOL = 1e-4


def seed_run(kind: str, device: str, scratch: str) -> dict:
    """One of seed_replication.py's runs (`kind`: standard or zeroshard) in a fresh process."""
    command = [sys.executable, SCRIPT, "--one", kind, "--device", device, "--size", "small", "--batch", "8",
               "--train", "64", "--eval", "16", "--eval-every", "4", "--threads", "4", "--scratch", scratch]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29400 + os.getpid() % 500),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"{kind} on {device}: " + done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_trainer_with_the_seed_config_on_one_gpu(tmp_path):
    standard = seed_run("standard", "cuda", str(tmp_path))
    zero = seed_run("zeroshard", "cuda", str(tmp_path))
    assert len(zero["losses"]) == len(standard["losses"]) == 8 and len(zero["eval_losses"]) == 2
    close(zero["losses"], standard["losses"], rtol=LOSS_RTOL, what="ZeroTrainer's training losses on cuda")
    close(zero["eval_losses"], standard["eval_losses"], rtol=LOSS_RTOL, what="its evaluation losses")
    assert 0 < zero["peak_mib"] < standard["peak_mib"], (zero["peak_mib"], standard["peak_mib"])  # GPU bytes

