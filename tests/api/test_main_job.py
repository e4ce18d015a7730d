"""The main job as a user runs it: train on 2 ranks, resume, compare, consolidate its checkpoint,
and an architecture from a Hugging Face config.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.cli import zeroshard_here


def zeroshard(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The command as a user types it; training runs on the CPU (gloo) here, GPU or not."""
    if args[0] in ("train", "compare") and "--help" not in args:
        args = (args[0], "--device", "cpu", *args[1:])
    done = subprocess.run([sys.executable, "-m", "zeroshard", *args], capture_output=True, text=True,
                          timeout=600)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _train_losses(out: str) -> list[float]:
    from zeroshard.checkpoint import read_meta, resolve
    where = out if os.path.basename(out).startswith("checkpoints") else os.path.join(out, "checkpoints")
    meta = read_meta(resolve(where), no_dist=True)
    return meta["extra"]["client_state"]["losses"]


def test_train_resume_and_consolidate(tmp_path):
    out = str(tmp_path / "run")
    first = zeroshard("train", "--steps", "20", "--nproc", "2", "--size", "tiny", "--seed", "5",
                      "--out", out).stdout
    assert "ZeRO stage 3, 2 ranks on cpu (gloo)" in first and "sample:" in first
    assert "traffic per step" in first
    assert "inside nodes: " in first and "across nodes: 0.00 MiB" in first  # one machine: one node
    rows = [line.split() for line in first.splitlines()
            if line.strip()[:1].isdigit() and len(line.split()) == 6]
    assert len(rows) == 2  # one memory row per rank: measured model states beside the paper's formula
    assert all(abs(float(row[4]) - float(row[5])) < 0.02 for row in rows)
    assert os.path.getsize(os.path.join(out, "loss.png")) > 10_000
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "step20"
    losses = _train_losses(out)
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < losses[0] - 1.0  # it learns
    # --resume alone continues the run as it was trained (its model, stage, precision, micro-batch,
    # and the seed that draws its batches), and says so, rather than building the default model,
    # changing stage or drawing other batches unseen.
    again = zeroshard("train", "--steps", "22", "--out", out, "--resume").stdout
    assert "--resume: the run's own settings: --size tiny --seq-len 64 --stage 3 --precision fp32 " \
        "--batch-size 8 --seed 5\n" in again and "ZeRO stage 3, 2 ranks" in again, again
    # Resume on 3 ranks at stage 2, now with optimizer offload and compiled blocks: given flags win.
    second = zeroshard("train", "--steps", "25", "--nproc", "3", "--stage", "2", "--size", "tiny",
                       "--out", out, "--resume", "--offload-optimizer", "--compile").stdout
    assert "ZeRO stage 2, 3 ranks" in second and "MiB in host memory" in second
    assert "this command's settings instead of the run's: --stage 2 (the run had --stage 3); " \
        "--offload-optimizer cpu (the run had none)" in second, second
    assert "3 data-parallel ranks where the run had 2: the global batch is now 24 sequences (was 16" in second
    resumed = _train_losses(out)
    assert resumed[:20] == losses and len(resumed) == 25
    assert max(resumed[20:]) < losses[0] - 1.0  # compiled, it goes on from where it was
    consolidated = zeroshard("consolidate", out, str(tmp_path / "w.pt"))  # the run's folder: its checkpoints
    assert consolidated.stdout.startswith("wrote")


def test_train_takes_the_config_unless_a_flag_is_given(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                  "train_micro_batch_size_per_gpu": 4}))
    common = ("--steps", "2", "--size", "tiny", "--config", str(config))
    out = zeroshard("train", *common, "--out", str(tmp_path / "a")).stdout
    # K: the fp32 master alone
    assert "ZeRO stage 1, 2 ranks on cpu (gloo), bf16 SGD (2+2+4 bytes/param)" in out, out
    rows = [line.split() for line in out.splitlines()
            if line.strip()[:1].isdigit() and len(line.split()) == 6]
    assert len(rows) == 2 and all(abs(float(row[4]) - float(row[5])) < 0.02 for row in rows), out
    out = zeroshard("train", *common, "--stage", "2", "--precision", "fp32",
                    "--out", str(tmp_path / "b")).stdout
    assert "ZeRO stage 2, 2 ranks on cpu (gloo), fp32 SGD" in out, out
    # --resume alone keeps both: the run's config, and the flags it gave beside it
    out = zeroshard("train", "--steps", "4", "--resume", "--out", str(tmp_path / "b")).stdout
    assert f"--config {config} --stage 2 --precision fp32" in out and \
        "ZeRO stage 2, 2 ranks on cpu (gloo), fp32 SGD" in out, out
    # The run's own config file edited since (another learning rate): refused by name, not trained
    # on unseen; given again with --config, it is the user's choice and trains on.
    trained = config.read_text()
    config.write_text(trained.replace('"lr": 0.1', '"lr": 0.2'))
    resumed = ("--steps", "6", "--resume", "--out", str(tmp_path / "b"))
    done = zeroshard_here("train", "--device", "cpu", *resumed)
    assert done.returncode == 2 and f"the run's --config {config} was edited since the run trained with " \
        "it (optimizer.params.lr: 0.1 -> 0.2)" in done.stderr, done.stderr
    zeroshard("train", *resumed, "--config", str(config))
    assert open(tmp_path / "b" / "checkpoints" / "latest").read() == "step6"
    config.write_text(trained)
    # The same command again (no --resume): a new run, the earlier run's checkpoints kept aside.
    earlier = _train_losses(str(tmp_path / "a"))
    out = zeroshard("train", *common, "--out", str(tmp_path / "a")).stdout
    kept = [name for name in os.listdir(tmp_path / "a") if name.startswith("checkpoints-")]
    assert len(kept) == 1 and f"earlier run's checkpoints: moved to {tmp_path / 'a' / kept[0]}" in out, out
    assert _train_losses(str(tmp_path / "a" / kept[0])) == earlier
    assert open(tmp_path / "a" / "checkpoints" / "latest").read() == "step2"
    done = zeroshard_here("train", "--device", "cpu", *common, "--resume", "--out", str(tmp_path / "a"))
    assert done.returncode == 2 and "at step 2 and --steps is 2 in total, so there is nothing to train" \
        in done.stderr, done.stderr
    # A resume whose accumulation would put every later checkpoint inside a cycle: refused up front.
    accumulating = tmp_path / "accumulating.json"
    accumulating.write_text(json.dumps({**json.loads(config.read_text()), "gradient_accumulation_steps": 4}))
    done = zeroshard_here("train", "--device", "cpu", *common[:-1], str(accumulating), "--steps", "8",
                          "--resume", "--out", str(tmp_path / "a"))
    assert done.returncode == 2 and "is at step 2, which does not end a cycle of " \
        "gradient_accumulation_steps 4" in done.stderr, done.stderr
    # Flags that build another model than the run's are named before any rank starts.
    done = zeroshard_here("train", "--device", "cpu", *common, "--width", "32", "--steps", "4", "--resume",
                          "--out", str(tmp_path / "a"))
    assert done.returncode == 2 and "started with --size tiny --seq-len 64, and this command's flags " \
        "(--size tiny --width 32 --seq-len 64) build another model" in done.stderr, done.stderr
    # A rank's error on bad input ends the command with that one line, not every rank's traceback.
    adamw = tmp_path / "adamw.json"
    adamw.write_text(config.read_text().replace('"SGD"', '"AdamW"'))
    done = zeroshard("train", "--steps", "4", "--size", "tiny", "--config", str(adamw), "--resume",
                     "--out", str(tmp_path / "a"), check=False)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "zeroshard: error: CheckpointError: the checkpoint holds SGD's state, but this engine's optimizer "
        "is AdamW: that state would be misread or ignored. Resume with SGD, or load the weights alone: "
        "engine.load_checkpoint(path, load_optimizer_states=False)"], done.stderr
    done = zeroshard_here("train", "--device", "cpu", *common, "--batch-size", "8")
    assert done.returncode == 2 and "--batch-size 8 but the config's batch sizes give a micro-batch of 4" \
        in done.stderr, done.stderr
    # --lr wins over the learning rate a resumed optimizer brings back: at 0, the resumed steps leave
    # the weights where the checkpoint had them.
    checkpoints = str(tmp_path / "a" / "checkpoints")
    zeroshard_here("consolidate", checkpoints, str(tmp_path / "at2.pt"))
    out = zeroshard("train", *common, "--steps", "4", "--resume", "--lr", "0",
                    "--out", str(tmp_path / "a")).stdout
    assert "--lr 0 replaces the learning rate the checkpoint's optimizer was saved with (0.1)" in out, out
    zeroshard_here("consolidate", checkpoints, str(tmp_path / "at4.pt"))
    before, after = (torch.load(tmp_path / name) for name in ("at2.pt", "at4.pt"))
    assert len(_train_losses(str(tmp_path / "a"))) == 4 and before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_an_out_that_cannot_be_written_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    done = zeroshard_here("train", "--device", "cpu", "--size", "tiny", "--steps", "2",
                          "--out", str(tmp_path / "file" / "run"))
    assert done.returncode == 2 and f"--out {tmp_path / 'file' / 'run'} cannot be written" in done.stderr, \
        done.stderr


def test_a_second_run_into_a_busy_out_is_refused_and_touches_nothing(tmp_path):
    import fcntl
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step10")  # the running one's
    with open(out / ".zeroshard.lock", "w") as held:  # as the running `zeroshard train` holds it
        held.write("pid 123")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = zeroshard_here("train", "--device", "cpu", "--size", "tiny", "--steps", "2", "--out", str(out))
    assert done.returncode == 2 and f"--out {out} is in use by another zeroshard train (pid 123)" \
        in done.stderr, done.stderr
    assert os.listdir(out / "checkpoints") == ["latest"] and sorted(os.listdir(out)) == [
        ".zeroshard.lock", "checkpoints"]  # nothing moved aside


def test_a_stopped_run_says_how_it_continues(tmp_path):
    """SIGTERM (a scheduler's stop; Ctrl-C alike): one line with the last checkpoint and the command,
    not the launcher's traceback."""
    import signal
    import time
    out = tmp_path / "run"
    run = subprocess.Popen([sys.executable, "-m", "zeroshard", "train", "--device", "cpu", "--size", "tiny",
                            "--seq-len", "16", "--steps", "100000", "--save-every", "5", "--out", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "latest").exists() and time.monotonic() < deadline and \
            run.poll() is None:
        time.sleep(0.2)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "zeroshard: stopped by SIGTERM: its last checkpoint is step" in err, err[-3000:]
    assert f"continue with `zeroshard train --resume --out {out} --steps 100000 --save-every 5`" in err, err
    assert "Traceback" not in err, err[-3000:]
    # A rank killed (the OOM killer's SIGKILL; here the drill's) without --max-restarts: one line
    # naming it, the checkpoint and how to continue or survive the next one.
    killed = subprocess.run([sys.executable, "-m", "zeroshard", "train", "--device", "cpu", "--size", "tiny",
                             "--seq-len", "16", "--steps", "6", "--save-every", "2",
                             "--out", str(tmp_path / "k")], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "ZEROSHARD_DRILL_KILL": "1:4"})
    said = "zeroshard: error: rank 1 was killed (SIGKILL; out of memory?): its last checkpoint is step4; " \
        "continue with `zeroshard train --resume"
    assert killed.returncode == 1 and said in killed.stderr, killed.stderr[-3000:]
    assert "Traceback" not in killed.stderr and "--max-restarts K restarts the ranks" in killed.stderr


def test_the_report_counts_skipped_steps(tmp_path):
    """fp16 whose every step overflows (a scale of 2^32) says so at the end, not only step by step."""
    config = tmp_path / "fp16.json"
    config.write_text(json.dumps({"fp16": {"enabled": True, "initial_scale_power": 32},
                                  "zero_optimization": {"stage": 2}}))
    out = zeroshard("train", "--steps", "3", "--size", "tiny", "--seq-len", "16", "--config", str(config),
                    "--out", str(tmp_path / "run")).stdout
    assert "; 3 optimizer steps skipped (fp16 overflow or non-finite gradients)" in out, out


def test_lr_beside_a_scheduler_is_refused(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}}))
    for command in ("train", "compare"):
        done = zeroshard_here(command, "--device", "cpu", "--config", str(config), "--lr", "0.01")
        assert done.returncode == 2 and "--lr 0.01: the config's \"scheduler\" section (WarmupLR) sets the " \
            "learning rate at every step, so --lr would be ignored" in done.stderr, done.stderr


@pytest.mark.parametrize("keys, cli_stage, stage", [
    ({"zeroshard": {"defer_param_gather": True}}, 2, 2),  # a stage-1/2 key and no stage in the file
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, None, 3),  # no stage: the CLI's 3
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, None, 1),
])
def test_a_config_is_judged_at_the_stage_the_command_runs(tmp_path, keys, cli_stage, stage):
    """A file without a stage runs at --stage (or 3), so it is validated there, not at DeepSpeed's 0."""
    import argparse

    import zeroshard
    from zeroshard.app.options import defaults_from_config
    from zeroshard.app.train import TrainArgs
    (tmp_path / "ds.json").write_text(json.dumps(keys))
    args = argparse.Namespace(config=str(tmp_path / "ds.json"), stage=cli_stage, precision=None, nproc=2,
                              tp=1, batch_size=None)
    defaults_from_config(args)
    assert args.stage == stage
    raw = TrainArgs(config=args.config, stage=args.stage, nproc=2).engine_config()
    assert zeroshard.Config.load(raw).stage == stage


def test_compare_judges_the_config_at_every_stage_first(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"offload_param": {"device": "cpu"}}}))
    done = zeroshard_here("compare", "--device", "cpu", "--config", str(tmp_path / "ds.json"))
    assert done.returncode == 2 and "--config at stage 0 (of --stages): zero_optimization.offload_param " \
        "needs zero_optimization.stage 3" in done.stderr and "leave stage 0 out of --stages" in done.stderr, \
        done.stderr


def test_compare_reports_every_stage_against_ddp(tmp_path):
    # The DDP baseline follows the config's recipe too: schedule, clipping, accumulation; the offload
    # is the ZeRO runs' alone (plain torch has none).
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
                                  "gradient_clipping": 0.5, "gradient_accumulation_steps": 2,
                                  "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    out = zeroshard("compare", "--steps", "4", "--size", "tiny", "--stages", "1", "3", "--rounds", "2",
                    "--config", str(config), "--out", str(tmp_path / "out")).stdout
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert rounds == [f"round {i}/2: ddp, stage 1, stage 3, side by side ..." for i in (1, 2)]
    alone = [line for line in out.splitlines() if line.startswith("alone: ")]
    assert alone == [f"alone: {name} (memory, loss) ..." for name in ("ddp", "stage 1", "stage 3")]
    rows = {line.split()[0] + (line.split()[1] if line.startswith("stage") else ""): line.split()
            for line in out.splitlines() if line.startswith(("ddp", "stage "))}
    assert set(rows) == {"ddp", "stage1", "stage3"}
    assert rows["ddp"][2] == "1.00" and "in each of 2 round(s), side by side" in out
    each = {r.split()[0]: [float(t) for t in r.split()[1].split("/")]
            for r in out.split("side by side: ")[1].splitlines()[0].split("; ") if r.startswith("ddp")}
    assert float(rows["ddp"][1]) == pytest.approx(sorted(each["ddp"])[0] / 2 + sorted(each["ddp"])[1] / 2,
                                                  abs=0.06)  # the median over rounds
    assert os.listdir(tmp_path / "out") == ["compare.png"]  # it writes only what it reports
    assert os.path.getsize(tmp_path / "out" / "compare.png") > 10_000
    ddp_loss, stage3_loss = float(rows["ddp"][-2]), float(rows["stage3"][-2])
    assert abs(ddp_loss - stage3_loss) < 1e-3  # same model, data and recipe: the same training
    states = {k: float(v[-5]) for k, v in rows.items()}
    assert states["stage3"] < states["stage1"] < states["ddp"]
    # beside the paper's formula with offload's K: the fp32 master kept apart from the parameters
    assert all(abs(float(v[-5]) - float(v[-4])) < 0.02 for v in rows.values()), rows


def test_hugging_face_architecture_from_a_local_config(tmp_path):
    """An HF architecture from scratch, split by its own tensor-parallel plan: ZeRO-DP x TP on local
    ranks (dp 2 x tp 2), stage 3, block inputs split over tp and kept on the host; then consolidated."""
    pytest.importorskip("transformers")
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = zeroshard("train", "--steps", "3", "--hf-config", str(tmp_path / "config.json"), "--seq-len", "32",
                    "--nproc", "4", "--tp", "2", "--partition-activations", "--cpu-checkpointing",
                    "--out", str(tmp_path / "run")).stdout
    assert "model: LlamaForCausalLM" in out
    assert "(this rank's tp part; tp 2 x dp 2); ZeRO stage 3, 4 ranks" in out
    rows = [row.split() for row in out.splitlines() if row.strip()[:1].isdigit() and len(row.split()) == 6]
    assert len(rows) == 4 and all(abs(float(row[4]) - float(row[5])) < 0.02 for row in rows)
    weights = zeroshard("consolidate", str(tmp_path / "run" / "checkpoints"), str(tmp_path / "w.pt"))
    assert weights.stdout.startswith("wrote")


@pytest.mark.parametrize("args, message", [
    (["train", "--data", "/no/such/file"], "neither a file nor a directory"),
    (["train", "--data", __file__, "--seq-len", "100000"], "the train split has"),
    (["train", "--config", "/no/such.json"], "does not exist"),
    (["train", "--hf-config", "/no/such/config.json"], "does not exist"),
    (["train", "--seq-len", "0"], "--seq-len must be >= 1"),
    (["train", "--lr", "-1"], "--lr must be >= 0, got -1.0"),
    (["compare", "--lr", "nan"], "--lr must be >= 0, got nan"),
    (["train", "--out", "/etc/passwd"], "--out /etc/passwd is a file; give a directory"),
    (["train", "--resume", "--out", "/no/such/run"], "--resume: nothing to resume in --out /no/such/run"),
    (["compare", "--stages", "5"], "invalid choice"),
    (["compare", "--stages", "3", "2", "2"], "--stages 3 2 2: a stage given twice"),
    (["estimate", "--params", "1e9", "--stage", "0", "--offload-optimizer"],
     "--offload-optimizer at stage 0"),
    (["estimate", "--params", "1e9", "--stage", "2", "--offload-param"], "--offload-param at stage 2"),
    (["estimate", "--params", "1.5"], "a whole number (1.5e9 for 1.5B), got 1.5"),
    (["train", "--stage", "4"], "invalid choice"),
    (["train", "--steps", "0"], "--steps must be >= 1"),
    (["train", "--nproc", "-1"], "--nproc must be >= 1"),
    (["train", "--stage", "2", "--offload-param"], "offload_param needs zero_optimization.stage 3"),
    (["train", "--offload-optimizer", "disk"], "invalid choice"),
    (["train", "--offload-optimizer", "nvme"], "--offload-optimizer nvme needs --nvme-path DIR"),
    (["train", "--offload-param", "nvme", "--nvme-path", "/no/such/dir"],
     "--nvme-path /no/such/dir is not a directory"),
    (["train", "--nvme-path", "/tmp"], "--nvme-path /tmp: nothing is offloaded to nvme"),
    (["train", "--nproc", "4", "--tp", "3"], "--tp 3 must be >= 1 and divide --nproc 4"),
    (["train", "--nproc", "4", "--tp", "4", "--size", "tiny"], "tp = 4 does not divide the model's heads"),
    (["bogus"], "invalid choice"),
    (["consolidate", "/no/such/dir", "out.safetensors"], "does not exist"),
    (["consolidate", "/tmp", "out.bin"], "must end in .safetensors or .pt"),
    (["consolidate", "/tmp", "/no/such/dir/w.pt"], "'/no/such/dir' is not a writable directory"),
])
def test_user_errors(args, message):
    if args[0] in ("train", "compare"):
        args = [args[0], "--device", "cpu", *args[1:]]
    done = zeroshard_here(*args)  # refused before any rank starts: no subprocess needed
    assert done.returncode == 2 and message in done.stderr, done.stderr
    checkpoints_fault = args[0] == "consolidate" and message == "does not exist"  # (no usage line)
    assert ("usage: zeroshard" in done.stderr) != checkpoints_fault, done.stderr


@pytest.mark.parametrize("command", ["train", "compare", "estimate", "consolidate"])
def test_every_command_has_help(command):
    assert "usage: zeroshard " + command in zeroshard_here(command, "--help").stdout


def test_version_names_zeroshard_and_torch():
    from zeroshard import __version__
    done = zeroshard_here("--version")
    expected = f"zeroshard {__version__} (torch {torch.__version__})"
    assert done.returncode == 0 and done.stdout.strip() == expected, done.stdout + done.stderr


def test_a_width_the_heads_do_not_divide_gets_fewer_heads_and_says_so(capsys):
    from zeroshard.app.cli import _say_heads
    from zeroshard.app.gpt import config_for
    from zeroshard.app.train import TrainArgs
    assert [config_for("small", None, w, 16).heads for w in (128, 63, 62, 61)] == [4, 3, 2, 1]
    _say_heads(TrainArgs(width=63))
    assert capsys.readouterr().out == "--width 63: 3 attention heads (the small size's 4 do not divide it)\n"
    _say_heads(TrainArgs(width=64, size="tiny"))
    assert capsys.readouterr().out == ""


def test_the_installed_entry_point_refuses_bad_input_by_name():
    """`python -m zeroshard` itself (the tests above call its main() in-process)."""
    done = zeroshard("bogus", check=False)
    assert done.returncode == 2 and "invalid choice" in done.stderr, done.stderr


def test_compile_flag_compiles_every_block():
    from zeroshard.app.train import TrainArgs, build_model, compile_blocks
    model = build_model(TrainArgs(size="tiny"))
    compile_blocks(model)
    blocks = list(model.blocks)
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    assert model._compiled_call_impl is None  # the blocks, not the whole model (FSDP2's pattern)


def test_one_rank_reports_no_traffic(tmp_path):
    out = zeroshard("train", "--steps", "2", "--nproc", "1", "--size", "tiny", "--seq-len", "32",
                    "--out", str(tmp_path / "one")).stdout
    assert "traffic per step: none (one rank" in out and "inside nodes" not in out, out
    assert "loss: train" in out and "sample:" in out, out


def test_traffic_line_counts_micro_batches_where_the_stage_sends_each():
    from zeroshard.app.report import traffic_line
    mib = 2**20
    assert traffic_line(mib, mib // 2, 1, "bf16", 4).endswith("(paper: 2Ψ x 2 bytes = 2.00 MiB)")
    assert traffic_line(mib, mib // 2, 2, "bf16", 2).endswith("3Ψ x 2 bytes = 3.00 MiB, 2 micro-batches a "
                                                              "step)")
    assert traffic_line(mib, mib // 2, 3, "fp32", 2).endswith("6Ψ x 4 bytes = 12.00 MiB, 2 micro-batches a "
                                                              "step)")


def test_the_engine_config_keeps_the_accumulation_the_batch_sizes_imply():
    from zeroshard.app.train import TrainArgs
    args = TrainArgs(config={"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, nproc=2,
                     batch_size=2)
    raw = args.engine_config()
    assert raw["gradient_accumulation_steps"] == 4 and raw["train_micro_batch_size_per_gpu"] == 2


@pytest.mark.parametrize("device,offload,fused", [("cpu", None, (False, False)),
                                                  ("cpu", "cpu", (True, False)),
                                                  ("cuda", None, (True, True))])
def test_the_default_optimizer_is_fused_on_a_gpu_on_both_sides(device, offload, fused):
    """On a GPU the main job's AdamW is fused for zeroshard and the DDP baseline alike (a fair
    compare, and zeroshard decides its step there); on the CPU only over offloaded shards."""
    import zeroshard
    from zeroshard.app.train import TrainArgs, optimizer_of
    for ddp, expected in zip((False, True), fused):
        args = TrainArgs(device=device, ddp=ddp, offload_optimizer=offload)
        optimizer = optimizer_of(zeroshard.Config.load(args.engine_config()), args)([torch.zeros(2)])
        assert bool(optimizer.defaults["fused"]) == expected, (device, offload, ddp)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "llama", "hidden_size": "big", "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 64, "vocab_size": 300}, "transformers refuses"),
    ({"model_type": "no_such_arch", "hidden_size": 64}, "model_type 'no_such_arch', which transformers"),
    ({"model_type": "t5", "d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "vocab_size": 300},
     "has no causal-LM class"),
])
def test_a_hf_config_transformers_cannot_build_is_refused_by_name(tmp_path, config, message):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = zeroshard_here("train", "--device", "cpu", "--hf-config", str(path), "--steps", "1",
                          "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
