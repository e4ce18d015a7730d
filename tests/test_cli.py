"""`zeroshard` as a user runs it: the main job on 2 ranks, help, and bad flags."""
from __future__ import annotations

import subprocess
import sys

import pytest


def zeroshard(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "zeroshard.cli", *args], capture_output=True, text=True,
                          timeout=600)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_train_on_two_ranks_reports_memory_and_traffic(tmp_path):
    out = zeroshard("train", "--steps", "6", "--size", "tiny", "--nproc", "2", "--out", str(tmp_path)).stdout
    assert "ZeRO stage 3, 2 ranks" in out
    assert "traffic per step" in out and "loss: train" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 6]
    assert len(rows) == 2  # one memory row per rank: measured states beside the paper's formula
    for row in rows:
        assert abs(float(row[4]) - float(row[5])) < 0.02


@pytest.mark.parametrize("args, message", [
    (["train", "--stage", "4"], "invalid choice"),
    (["train", "--steps", "0"], "--steps must be >= 1"),
    (["train", "--nproc", "-1"], "--nproc must be >= 1"),
    (["bogus"], "invalid choice"),
])
def test_bad_flags(args, message):
    done = zeroshard(*args, check=False)
    assert done.returncode == 2 and message in done.stderr


def test_help():
    assert "--stage" in zeroshard("train", "--help").stdout
