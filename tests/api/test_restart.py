"""Elastic restart of `zeroshard train`: a rank killed with SIGKILL mid-run, the group restarted by
torch's elastic agent, ends bit-identical to an uninterrupted run, having lost at most --save-every
steps; and a fresh run never resumes from the checkpoints an earlier run left in its --out.

Runs are launched in-process (the elastic agent runs in pytest's main thread; the ranks are spawned
processes, as under the CLI). The smallest model of test_main_job, 3 ranks, 60 steps."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

import zeroshard
from zeroshard.app.cli import main
from zeroshard.app.restart import DRILL_ENV
from zeroshard.app.train import TrainArgs, launch

STEPS, EVERY = 60, 10
SMALL = dict(device="cpu", nproc=3, size="tiny", steps=STEPS, save_every=EVERY, max_restarts=2,
             sample_tokens=0, quiet=True)


def train(out, monkeypatch, stage: int, kill: tuple[int, int] | None = None) -> dict:
    """One `zeroshard train` run; kill=(rank, step): that rank dies at that step on the first attempt."""
    if kill:
        monkeypatch.setenv(DRILL_ENV, f"{kill[0]}:{kill[1]}")
    else:
        monkeypatch.delenv(DRILL_ENV, raising=False)
    return launch(TrainArgs(stage=stage, out=str(out), **SMALL))


def final(out) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The final checkpoint's full weights and loss history."""
    checkpoints = os.path.join(out, "checkpoints")
    losses = zeroshard.checkpoint_info(checkpoints)["client_state"]["losses"]
    return zeroshard.consolidate(checkpoints), losses


def assert_identical(out, reference) -> None:
    (weights, losses), (expected, expected_losses) = final(out), final(reference)
    assert losses == expected_losses and len(losses) == STEPS
    assert weights.keys() == expected.keys()
    for name in weights:
        assert torch.equal(weights[name], expected[name]), name  # bit-identical


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, str]:
    """Uninterrupted runs, by stage (made on first use)."""
    return {"root": str(tmp_path_factory.mktemp("reference"))}


def reference(references, monkeypatch, stage: int) -> str:
    if stage not in references:
        out = os.path.join(references["root"], f"stage{stage}")
        result = train(out, monkeypatch, stage)
        assert result["restarts"] == 0 and result["resumed_from"] == 0 and result["steps_lost"] is None
        references[stage] = out
    return references[stage]


def stale_copy(source: str, out, tag: str) -> None:
    """Leave an earlier run's checkpoints in `out`, `latest` naming `tag`."""
    shutil.copytree(os.path.join(source, "checkpoints"), os.path.join(out, "checkpoints"))
    with open(os.path.join(out, "checkpoints", "latest"), "w") as f:
        f.write(tag)


@pytest.mark.parametrize("stage", [1, 3])
def test_killed_rank_restarts_and_ends_bit_identical(stage, references, monkeypatch, tmp_path, capfd):
    expected = reference(references, monkeypatch, stage)
    rng = random.Random(f"fault-{stage}")  # stage 1: rank 2 at step 41; 3: rank 0 (the store's host) at 31
    rank, step = rng.randrange(3), rng.randrange(EVERY + 1, STEPS)
    stale_copy(expected, tmp_path, "step50")  # an earlier run's: ignored, this run saves its own
    result = train(tmp_path, monkeypatch, stage, kill=(rank, step))
    saved = step // EVERY * EVERY
    assert (result["restarts"], result["resumed_from"], result["steps_lost"]) == (1, saved, step - saved)
    assert result["steps_lost"] <= EVERY and 0 < result["restart_s"] < 120
    assert result["resumed_path"] == os.path.join(tmp_path, "checkpoints", f"step{saved}")
    assert f"restart 1: resuming from step {saved} " in capfd.readouterr().out
    assert_identical(tmp_path, expected)
    print(f"\nstage {stage}: rank {rank} killed at step {step}; resumed from {saved}, "
          f"{result['steps_lost']} steps lost, restart {result['restart_s']:.1f} s")


def test_fresh_run_killed_before_its_first_save_starts_over(references, monkeypatch, tmp_path):
    """The directory holds an earlier run's step-30 checkpoint (stage 1), `latest` naming it; this
    stage-3 run dies before it saves anything: the restart begins at step 0, not at 30."""
    stale_copy(reference(references, monkeypatch, 1), tmp_path, "step30")
    result = train(tmp_path, monkeypatch, 3, kill=(1, 7))
    assert (result["restarts"], result["resumed_from"], result["steps_lost"]) == (1, 0, 7)
    assert result["resumed_path"] is None
    assert_identical(tmp_path, reference(references, monkeypatch, 3))
    with open(os.path.join(tmp_path, ".zeroshard-progress.json")) as f:
        progress = json.load(f)
    assert (progress["run_id"], progress["step"]) == (result["run_id"], STEPS)


@pytest.mark.parametrize("argv, message", [
    (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
    (["--save-every", "-2"], "--save-every must be >= 0"),
    (["--save-every", "3", "--config", "GAS2"], "must be a multiple of gradient_accumulation_steps (2)"),
    (["--steps", "5", "--config", "GAS2"], "--steps 5 must be a multiple of gradient_accumulation_steps (2)"),
])
def test_restart_options_are_checked(argv, message, tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"gradient_accumulation_steps": 2}))
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--device", "cpu", *[str(config) if a == "GAS2" else a for a in argv]])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_drill_variable_is_checked(monkeypatch):
    monkeypatch.setenv(DRILL_ENV, "rank1-step5")
    with pytest.raises(ValueError, match="expected RANK:STEP"):
        launch(TrainArgs(device="cpu", nproc=1, steps=1))
