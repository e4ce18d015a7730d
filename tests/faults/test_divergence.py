"""Drills: ranks that stop issuing the same collectives end with a DivergenceError naming the
ranks and the collectives, within seconds, instead of hanging (zeroshard.check_collectives on and a
short zeroshard.collective_timeout, as the docs suggest for such drills).

Each rank runs in its own process and reports what it raised through a file; a rank whose group
is left with a collective in flight cannot tear it down cleanly, so the workers end with os._exit.
"""
from __future__ import annotations

import atexit
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from helpers.models import Block, loss_fn
from helpers import TESTS
from helpers.spawn import free_port

TIMEOUT = 2.0  # zeroshard.collective_timeout in most drills (seconds)
PATIENT = 45.0  # ... and in those that must find the divergence before a long timeout runs out


class Stack(nn.Module):
    """Equal blocks (so a skipped unit's all-gather pairs silently with the next one's)."""

    def __init__(self, d: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(37, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 37)

    def forward(self, idx: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        return self.head(self.features(idx, skip))

    def features(self, idx: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        x = self.tok(idx)
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = block(x)
        return x


class Blocks(nn.Module):
    """Equal blocks and nothing else: no root unit gathered after them, so a rank that skipped one
    reaches backward()'s check while its peer stalls in forward's last gather."""

    def __init__(self, d: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.d = d

    def forward(self, idx: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        x = torch.nn.functional.one_hot(idx % self.d, self.d).float()
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = torch.relu(block(x))
        return x


class AuxStack(Stack):
    """With an auxiliary head, a unit of its own, run on every rank."""

    def __init__(self, d: int = 16) -> None:
        super().__init__(d)
        self.aux = nn.ModuleList([nn.Linear(d, 37)])

    def forward(self, idx: torch.Tensor, skip: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.features(idx, skip)
        return self.head(x), self.aux[0](x)


def _train(engine, rank: int, fault: str, steps: int = 4, directory: str = "") -> None:
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randint(0, 37, (2, 8), generator=g)
        faulty = rank == 1 and step == 2
        if fault.startswith("skip_step_save") and step == 2:  # a rank skips a step; then all save
            if rank != int(fault[-1]):
                engine.backward(loss_fn(engine(x), x))
                engine.step()
            engine.save_checkpoint(os.path.join(directory, "ckpt"))
            continue
        if fault == "generate_alone":  # its first collective is transformers' synced_gpus all-reduce
            if rank == 0 and step == 2:
                with torch.no_grad():
                    engine.module.generate(x[:1], max_new_tokens=2, do_sample=False)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
            continue
        if fault.startswith("eval_uneven") and step == 2:  # rank 0 has one more evaluation batch
            with torch.no_grad():
                for _ in range(3 if rank == 0 else 2):
                    engine(x)
            if fault == "eval_uneven_barrier":
                dist.barrier()  # a torch call: the stalled rank 0 finds no mark of rank 1's
            else:
                zeroshard.mean_over_ranks(torch.ones(()))
        if fault.startswith("write_") and step == 2 and (rank == 0 or fault == "write_everywhere"):
            engine.module.load_state_dict(engine.module.state_dict())  # DDP's habit: rank 0 loads
        skip = 1 if fault.startswith("skip_unit") and faulty else None
        if fault == "aux_alone":  # every rank runs the auxiliary head; its loss counts on rank 0 only
            out, aux = engine(x)
            engine.backward(loss_fn(out, x) + (loss_fn(aux, x) if rank == 0 else 0.0))
            engine.step()
            continue
        out = engine(x, skip=skip)
        engine.backward(out.square().mean() if fault == "skip_unit_blocks" else loss_fn(out, x))
        if fault == "backward_twice" and faulty:
            engine.backward(loss_fn(engine(x), x))
        if fault == "step_alone" and rank == 1 and step == 2:
            continue  # rank 0 steps alone
        engine.step()
        if fault == "export_alone" and rank == 0 and step == 2:
            engine.full_state_dict()
        if fault == "gathered_alone" and rank == 0 and step == 2:
            with engine.gathered_parameters():  # a read: no collective below stage 3
                pass
        if fault == "save_alone":  # DDP's habit: rank 0 saves, then every rank logs the mean loss
            if rank == 0 and step == 2:
                engine.save_checkpoint(os.path.join(directory, "ckpt"))
            zeroshard.mean_over_ranks(loss_fn(engine(x), x).detach())
        if fault == "load_alone":  # every rank saves; rank 0 alone loads it back
            if step == 1:
                engine.save_checkpoint(os.path.join(directory, "ckpt"))
            if rank == 0 and step == 2:
                engine.load_checkpoint(os.path.join(directory, "ckpt"))
    if fault == "export_at_end" and rank == 0:  # the habit `if rank == 0: save` at a script's end,
        engine.full_state_dict()                 # while rank 1's script ends
    if fault == "save_16bit_at_end" and rank == 0:  # DeepSpeed's export, as habit has it
        engine.save_16bit_model(directory)
    if fault == "forward_at_end" and rank == 0:
        with torch.no_grad():
            engine(x)


def _llama() -> nn.Module:
    import transformers
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, bos_token_id=0, eos_token_id=36, pad_token_id=36))


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def _worker(rank: int, world_size: int, port: int, stage: int, fault: str, out: str, timeout: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    config = {"zero_optimization": {"stage": stage},
              "zeroshard": {"check_collectives": True, "collective_timeout": timeout}}
    model = AuxStack() if fault == "aux_alone" else Blocks() if fault == "skip_unit_blocks" else \
        _llama() if fault == "generate_alone" else Stack()
    engine = zeroshard.initialize(model, lambda p: torch.optim.SGD(p, lr=0.1), config)
    warned: list[str] = []
    logging.getLogger("zeroshard").addHandler(_Collect(warned))
    start = time.monotonic()
    result = {"error": None, "message": "", "seconds": 0.0}
    try:
        _train(engine, rank, fault, directory=out)
        result["store"] = engine.comm_stats()["store"]
    except Exception as e:  # noqa: BLE001 - reported to the test, which judges the type
        result = {"error": type(e).__name__, "message": str(e) or traceback.format_exc()}
    result["warnings"] = warned
    result["seconds"] = time.monotonic() - start
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    if fault.endswith("_at_end"):
        atexit._run_exitfuncs()  # a script's end: its exit hooks run
    os._exit(0)  # a collective may still be in flight: no orderly teardown of the group


def _drill(stage: int, fault: str, directory: str, world_size: int = 2,
           timeout: float = TIMEOUT) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, stage, fault, directory, timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{fault} at stage {stage}: ranks still running after 90 s (a hang)"
    results = []
    for r in range(world_size):
        path = os.path.join(directory, f"{r}.json")
        assert os.path.exists(path), f"{fault} at stage {stage}: rank {r} died without a report"
        with open(path) as f:
            results.append(json.load(f))
    return results


@pytest.mark.parametrize("stage,fault", [(3, "skip_unit"), (2, "backward_twice"), (3, "backward_twice"),
                                         (2, "step_alone"), (3, "step_alone")])
def test_divergence_is_named(tmp_path, stage: int, fault: str) -> None:
    results = _drill(stage, fault, str(tmp_path))
    for rank, result in enumerate(results):
        what = f"{fault}, stage {stage}, rank {rank}: {result}"
        assert result["error"] == "DivergenceError", what
        assert result["seconds"] < 60, what
        message = result["message"]
        assert "collectives diverged at call #" in message and "rank 0:" in message and "rank 1:" in message
        assert "Likely cause" in message, what
    if fault == "skip_unit":  # the message names each rank's call where they part: forward pairs
        # the skipped unit's prefetched gather with the next one's silently; backward then differs
        message = results[0]["message"]
        assert "rank 0: reduce_scatter(unit 3 (blocks.2)" in message, message
        assert "rank 1: all_gather(unit 3 (blocks.2)" in message, message


def test_an_output_in_the_loss_of_some_ranks_only_is_named_with_the_fix(tmp_path) -> None:
    """Stage 3 gathers a unit for backward where its output gets a gradient; stages 0-2 train."""
    for rank, result in enumerate(_drill(3, "aux_alone", str(tmp_path))):
        assert result["error"] == "DivergenceError", result
        assert "Likely cause: a unit whose output reaches the loss on some ranks only" in result["message"]
        assert "loss = loss + 0.0 * aux.sum()" in result["message"], result
    assert _drill(2, "aux_alone", str(tmp_path))[0]["error"] is None


def test_a_unit_skipped_at_stage_2_is_no_divergence(tmp_path) -> None:
    """Below stage 3 a unit skipped on one rank issues no different collective: reductions run in
    one fixed order, with zeros for a gradient that never came (as DDP's find_unused_parameters)."""
    results = _drill(2, "skip_unit", str(tmp_path))
    assert all(r["error"] is None for r in results), results
    # the checks' store traffic is counted apart from the collectives': one write (rank 0) or read
    # (rank 1) per check, at each of the 4 steps' backward() and step()
    assert [r["store"]["calls"] for r in results] == [8, 8], results
    assert all(r["store"]["bytes"] > 0 for r in results), results


@pytest.mark.parametrize("stage,fault", [(3, "skip_unit"), (3, "skip_unit_blocks"), (3, "step_alone"),
                                         (2, "save_alone"), (3, "skip_step_save_1"),
                                         (3, "skip_step_save_0")])
def test_divergence_is_found_before_the_timeout(tmp_path, stage: int, fault: str) -> None:
    """Stalled ranks compare how far they got through the store: a unit skipped in forward at stage 3
    (no check runs there; or the skipping rank reaches backward()'s check while its peer stalls in
    forward), a save on rank 0 alone while the other logs through
    zeroshard.mean_over_ranks (which the engine's watch covers), or a step skipped on one rank that
    then saves while its peer stalls in the step's forward, is named in seconds, not after
    collective_timeout."""
    results = _drill(stage, fault, str(tmp_path), timeout=PATIENT)
    for rank, result in enumerate(results):
        assert result["error"] == "DivergenceError", result
        assert result["seconds"] < PATIENT / 2, f"rank {rank} waited for the timeout: {result}"
        assert "collectives diverged at call #" in result["message"], result


@pytest.mark.parametrize("fault,call", [("export_alone", "full_state_dict()"),
                                        ("gathered_alone", "gathered_parameters()"),
                                        ("load_alone", "load_checkpoint()"),
                                        ("generate_alone", "generate()")])
def test_a_collective_call_on_rank_0_alone_is_named_not_aborted(tmp_path, fault: str, call: str) -> None:
    """At stage 3 these gather every unit: entered on rank 0 alone, its gathers would pair with the
    other rank's next forward, and gloo aborts the process on the size mismatch (no diagnosis). The
    ranks first meet at a gate in the store, so the stalled peer is found in seconds and named.
    (A Hugging Face model's generate() would first wait in transformers' own all-reduce, unwatched.)"""
    results = _drill(3, fault, str(tmp_path), timeout=PATIENT)
    for rank, result in enumerate(results):
        assert result["error"] == "DivergenceError", result
        assert result["seconds"] < PATIENT / 2, f"rank {rank} waited for the timeout: {result}"
        steps = 2 if call == "generate()" else 3  # step() calls before: generate() comes before the 3rd
        assert f"rank 0: entered {call} (collective) at step {steps}" in result["message"], result
        assert f"Likely cause: {call} called on some ranks only" in result["message"], result
    if fault == "gathered_alone":  # below stage 3 a read issues no collective: rank 0 may, alone
        assert all(r["error"] is None for r in _drill(2, fault, str(tmp_path))), "stage 2"


def test_an_evaluation_forward_on_some_ranks_is_named(tmp_path) -> None:
    """Uneven evaluation batches at stage 3: rank 0's extra forward gathers while rank 1 has gone on.
    Into a zeroshard collective (mean_over_ranks): named in seconds, as a forward on some ranks
    only. Into a torch call (dist.barrier) that marks nothing: rank 0 warns at 10 s of what is
    likely, and its error at the timeout says where the silent rank may be."""
    for rank, result in enumerate(_drill(3, "eval_uneven", str(tmp_path), timeout=PATIENT)):
        assert result["error"] == "DivergenceError" and result["seconds"] < PATIENT / 2, (rank, result)
        assert "Likely cause: a forward run on some ranks only" in result["message"], result
    first = _drill(3, "eval_uneven_barrier", str(tmp_path), timeout=12.0)[0]
    assert first["error"] == "DivergenceError", first
    assert any("or in a call the others are not in (a torch.distributed one such as dist.barrier()" in w
               for w in first["warnings"]), first
    assert "Ranks [1] did not answer" in first["message"] and "dist.barrier()" in first["message"], first


def test_parameters_written_on_rank_0_alone_are_named(tmp_path) -> None:
    """Below stage 3 the parameters are the full values on every rank: a load_state_dict() (or any
    in-place write) on rank 0 alone would leave the ranks training different models (stage 0) or a
    mix of shards (1-2), silently. step() after a write meets the other ranks at a gate: named in
    seconds; the same write on every rank trains on."""
    for stage in (0, 1):
        results = _drill(stage, "write_alone", str(tmp_path), timeout=PATIENT)
        for rank, result in enumerate(results):
            assert result["error"] == "DivergenceError", (stage, result)
            assert result["seconds"] < PATIENT / 2, f"rank {rank} waited for the timeout: {result}"
            assert "Likely cause: parameters written in place on some ranks only" in result["message"], result
    assert all(r["error"] is None for r in _drill(1, "write_everywhere", str(tmp_path))), "every rank"


@pytest.mark.parametrize("fault,where", [("export_at_end", "full_state_dict() is collective"),
                                         ("save_16bit_at_end", "save_16bit_model() is collective"),
                                         ("forward_at_end", "rank 0: ")])
def test_a_peer_that_exited_is_named_at_once(tmp_path, fault: str, where: str) -> None:
    """Rank 0 alone calls a collective at the script's end, and rank 1's script ends: its exit hook
    marks it exited in the store. At a gate (full_state_dict) rank 0 is told so in seconds, not at
    collective_timeout; in a collective gloo fails on the closed connection, and the diagnosis does
    not wait the grace period (30 s) for the exited rank's history."""
    first, second = _drill(3, fault, str(tmp_path), timeout=PATIENT)
    assert second["error"] is None, second
    assert first["error"] == "DivergenceError", first
    assert first["seconds"] < PATIENT / 2, f"rank 0 waited for the timeout: {first}"
    assert where in first["message"] and "[1]" in first["message"] and "exited" in first["message"], first


def test_a_diverged_torchrun_job_exits(tmp_path) -> None:
    """Under torchrun, processes run zeroshard's exit hook (the drills above end with os._exit). A
    group left with a collective in flight blocks its own teardown until the collective times out
    (600 s here): the hook gives up after devices.RELEASE_WAIT_S, so the job ends with its error."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "uneven_script.py")
    env = {**os.environ, "ZEROSHARD_BACKEND": "gloo",
           "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", script, "2"],
                          capture_output=True, text=True, env=env, timeout=300)
    seconds = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "DivergenceError" in out and "exported" not in out, out[-3000:]
    assert seconds < 120, f"the job took {seconds:.0f} s to end after diverging"
