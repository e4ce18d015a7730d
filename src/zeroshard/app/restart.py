"""Elastic restart for `zeroshard train`: which checkpoint a restarted group resumes from, what the
failure cost, and the fault-injection hook for drills.

Invariants:
- A run is one `launch` call; its id (made once, in the launching process) is in every checkpoint it
  saves (client_state["run_id"]) and in its progress file. A restart (TORCHELASTIC_RESTART_COUNT > 0)
  resumes only from a `latest` that carries this run's id, so checkpoints an earlier run left in the
  same --out are never picked up; none of this run's yet: it starts again from step 0. `--resume`
  resumes from `latest` whatever run wrote it (the user asked for it).
- Rank 0 decides and every rank follows: all ranks load the same checkpoint directory.
- A checkpoint carries the config's keys as the run read them: `--resume` refuses the run's own
  config file edited since (refuse_edited_config), which would change the resumed run unseen.
- Resumption is exact: the batches are a function of the step, and the checkpoint holds the weights,
  the optimizer, the loss scaler and every rank's RNG, so a resumed run ends bit-identical to an
  uninterrupted one.
- The progress file (OUT/.zeroshard-progress.json, written by rank 0 after every step when restarts
  are allowed) says how far the failed attempt got and when: steps lost = its step - the step resumed
  from; restart time = the end of the first step after resuming - the end of its last step.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import zeroshard

DRILL_ENV = "ZEROSHARD_DRILL_KILL"
PROGRESS = ".zeroshard-progress.json"
LATEST = "latest"  # the file in a checkpoint parent naming its newest complete checkpoint


def checkpoints_of(out: str) -> str:
    """Where a run with this --out saves its checkpoints (and a --resume looks for them)."""
    return os.path.join(out, "checkpoints")


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


@contextmanager
def store_per_attempt() -> Iterator[None]:
    """Around elastic_launch: every attempt gets its own rendezvous store. With the store the agent
    shares by default, a restarted group reads the previous attempt's keys and its gloo ranks wait
    forever to connect to the dead ones (pytorch#135712; seen on torch 2.13)."""
    key, before = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def restart_count() -> int:
    """0 on the first attempt; n after the elastic agent restarted the group n times."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


# ---- fault injection (drills and tests only) -----------------------------------------------------
def drill_target() -> tuple[int, int] | None:
    """(rank, step) from ZEROSHARD_DRILL_KILL="RANK:STEP", or None when it is not set."""
    spec = os.environ.get(DRILL_ENV, "").strip()
    if not spec:
        return None
    try:
        rank, step = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"{DRILL_ENV}={spec!r}: expected RANK:STEP, e.g. 1:25") from None
    return rank, step


def maybe_kill(target: tuple[int, int] | None, rank: int, step: int) -> None:
    """For fault drills: rank RANK sends itself SIGKILL before step STEP (0-based, so after STEP
    steps are done), on the first attempt only, as an OOM kill or a lost node would."""
    if target == (rank, step) and restart_count() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


# ---- progress of this run -------------------------------------------------------------------------
def write_progress(out: str, run_id: str, step: int) -> None:
    """Rank 0, after each step: `step` steps are done now. Atomic (a kill leaves the previous one)."""
    path = os.path.join(out, PROGRESS)
    with open(path + ".tmp", "w") as f:
        json.dump({"run_id": run_id, "step": step, "time": time.time()}, f)
    os.replace(path + ".tmp", path)


def read_progress(out: str, run_id: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(out, PROGRESS)) as f:
            progress = json.load(f)
    except (OSError, ValueError):
        return None
    return progress if progress.get("run_id") == run_id else None


# ---- resuming ---------------------------------------------------------------------------------------
@dataclass
class Resumed:
    """Where this attempt started. restart_s is set once the first step after a restart is done."""

    restarts: int = 0                 # restarts of the group before this attempt
    step: int = 0                     # steps already done when this attempt began (0: from scratch)
    path: str | None = None           # the checkpoint loaded, if any
    steps_lost: int | None = None     # steps the failed attempt had done beyond `step`
    failed_at: float | None = None    # wall time at the end of the failed attempt's last step
    restart_s: float | None = None    # from then to the end of the first step after resuming

    def first_step_done(self) -> None:
        if self.failed_at is not None and self.restart_s is None:
            self.restart_s = time.time() - self.failed_at

    def as_dict(self) -> dict[str, Any]:
        return {"restarts": self.restarts, "resumed_from": self.step, "resumed_path": self.path,
                "steps_lost": self.steps_lost, "restart_s": self.restart_s}


def _ours(checkpoints: str, run_id: str, any_run: bool) -> str | None:
    """The checkpoint `latest` names, if it is this run's (or any_run); None if there is none."""
    if not os.path.isfile(os.path.join(checkpoints, LATEST)):  # nothing saved, or only a torn save
        return None if not any_run else checkpoints  # --resume: the library names what is missing
    info = zeroshard.checkpoint_info(checkpoints)
    owner = (info.get("client_state") or {}).get("run_id")
    return info["path"] if any_run or owner == run_id else None


def _decide(checkpoints: str, out: str, run_id: str, explicit: bool) -> Any:
    """Collective: rank 0's (checkpoint to load, progress), or its error, on every rank."""
    mine: Any = None
    if zeroshard.rank_and_world_size()[0] == 0:
        try:
            mine = (_ours(checkpoints, run_id, explicit), read_progress(out, run_id))
        except zeroshard.CheckpointError as e:  # raised on every rank, not left to a timeout
            mine = e
    decision = zeroshard.gather_objects(mine)[0]
    if isinstance(decision, Exception):
        raise decision
    return decision


def resume(engine, checkpoints: str, out: str, run_id: str, explicit: bool,
           lr: float | None = None) -> tuple[list[float], Resumed]:
    """Collective. Load this run's latest checkpoint on a restart (any run's with --resume); returns
    the loss history so far and what was resumed. An `lr` (--lr) wins over the one the checkpoint's
    optimizer brings back, as it wins over the config's (options.py refuses it beside a scheduler)."""
    resumed = Resumed(restarts=restart_count())
    if not (explicit or resumed.restarts):
        return [], resumed
    path, progress = _decide(checkpoints, out, run_id, explicit)
    history = engine.load_checkpoint(path)[1]["losses"] if path else []
    resumed.step, resumed.path = len(history), path
    if path and lr is not None:
        _set_lr(engine, lr)
    if progress is not None and resumed.restarts:
        resumed.steps_lost, resumed.failed_at = progress["step"] - resumed.step, progress["time"]
    if zeroshard.rank_and_world_size()[0] == 0:
        print(describe(resumed, checkpoints), flush=True)
    return history, resumed


def _set_lr(engine, lr: float) -> None:
    before = {group["lr"] for group in engine.optimizer.param_groups}
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    if zeroshard.rank_and_world_size()[0] == 0 and before != {lr}:
        print(f"--lr {lr:g} replaces the learning rate the checkpoint's optimizer was saved with "
              f"({', '.join(f'{x:g}' for x in sorted(before))})", flush=True)


def describe(resumed: Resumed, checkpoints: str) -> str:
    tag = os.path.basename(resumed.path) if resumed.path else ""
    counts = "; its tag counts optimizer steps, --steps micro-batches" if tag != f"step{resumed.step}" else ""
    start = f"from step {resumed.step} ({resumed.path}{counts})" if resumed.path else \
        f"from step 0: no checkpoint of this run in {checkpoints} yet"
    head = f"restart {resumed.restarts}: resuming " if resumed.restarts else "resuming "
    lost = f"; {resumed.steps_lost} step(s) lost" if resumed.steps_lost is not None else ""
    return head + start + lost


def report_line(resumed: Resumed) -> str | None:
    """The summary's line about restarts, or None when the group never restarted."""
    if not resumed.restarts:
        return None
    lost = "unknown" if resumed.steps_lost is None else resumed.steps_lost
    took = f", {resumed.restart_s:.1f} s from the failure to the first step after resuming" \
        if resumed.restart_s is not None else ""
    return f"restarts: {resumed.restarts}; resumed from step {resumed.step}, steps lost: {lost}{took}"


def refuse_edited_config(parser: argparse.ArgumentParser, path: str, trained: dict | None) -> None:
    """The run's own config file, edited since the run trained with it, would change the resumed run
    unseen (another accumulation, learning rate or stage): refused, naming what changed. (A run
    saved before its config's keys were kept has nothing to compare.)"""
    if not isinstance(trained, dict):
        return
    try:
        now = zeroshard.Config.read(path)
    except (OSError, ValueError) as e:
        parser.error(f"--resume: the run's --config {path} cannot be read now: {e}")
    was, is_ = _flat(trained), _flat(now)
    changed = [f"{k}: {was.get(k, '(none)')} -> {is_.get(k, '(none)')}" for k in sorted(set(was) | set(is_))
               if was.get(k, _MISSING) != is_.get(k, _MISSING)]
    if changed:
        parser.error(f"--resume: the run's --config {path} was edited since the run trained with it "
                     f"({'; '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}); restore it to "
                     f"continue the run as it was trained, or give --config {path} to resume with it as "
                     f"it is now")


_MISSING = object()


def _flat(raw: dict, prefix: str = "") -> dict:
    """A config's keys as dotted paths: zero_optimization.stage, optimizer.params.lr, ..."""
    out: dict = {}
    for k, v in raw.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
