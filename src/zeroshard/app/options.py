"""The command line's options resolved before any rank starts: the device and rank count, the
values a --config supplies where no flag was given, and a --resume that would train nothing. Each
problem is a parser error naming the option and the fix, in one process, not a traceback per rank."""
from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

from .sizes import SIZES

# What a rank raises for bad input (a config, a model, a checkpoint): one line says it all.
_USER_ERRORS = ("CheckpointError", "ConfigError", "ModelMismatchError", "NonFiniteError", "DivergenceError")


def check_steps_beyond_checkpoint(parser: argparse.ArgumentParser, args, accumulation: int = 1) -> None:
    """An --out holding an earlier run's checkpoints: a new run moves them aside (keep_aside) and says
    where; --resume continues from them, and with --steps at or below their step would train
    nothing: say so. Its step must end an accumulation cycle of this run's config, or every later
    checkpoint would fall inside one."""
    from .restart import LATEST, checkpoints_of
    checkpoints = checkpoints_of(args.out)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out} is a file; give a directory (created if missing)")
    _check_writable(parser, args.out)
    if not os.path.isfile(os.path.join(checkpoints, LATEST)):
        if args.resume and not os.path.exists(checkpoints):
            parser.error(f"--resume: nothing to resume in --out {args.out} (no checkpoints there); drop "
                         f"--resume to start a new run, or give the --out of the run to continue")
        return
    if not args.resume:  # a new run keeps the earlier run's checkpoints, apart from its own
        print(f"--out {args.out} held an earlier run's checkpoints: moved to {keep_aside(checkpoints)} "
              f"(pass --resume to continue a run instead)")
        return
    client_state = _saved_run(checkpoints)
    losses = (client_state or {}).get("losses", [])
    if client_state is None or not isinstance(losses, list):
        return  # the ranks report an unreadable checkpoint, by name
    done = len(losses)
    _check_model_flags(parser, args, client_state.get("args") or {})
    if done >= args.steps:
        parser.error(f"--resume: the checkpoint in {args.out} is at step {done} and --steps is "
                     f"{args.steps} in total, so there is nothing to train; give --steps above {done}")
    if done % accumulation:
        parser.error(f"--resume: the checkpoint in {args.out} is at step {done}, which does not end a cycle "
                     f"of gradient_accumulation_steps {accumulation}: the steps after it would not end "
                     f"with a checkpoint. Resume with an accumulation that divides {done} (the run's own "
                     f"does), or start a new run")


# What --resume takes from the run it continues where this command gives no value (the flags'
# defaults are None or empty): its model, data, config, stage, precision, micro-batch and offloads,
# its activation checkpointing and its seed (which draws the batches). Not --nproc, --device or
# --tp (a run resumes on other ranks), nor --lr (the optimizer's state brings its own back).
_RESUMED = ("size", "layers", "width", "hf_config", "seq_len", "data", "config", "stage", "precision",
            "batch_size", "offload_optimizer", "offload_param", "nvme_path", "activation_checkpointing",
            "partition_activations", "cpu_checkpointing", "seed")
_DECIDED_BY_CONFIG = ("stage", "precision", "batch_size")  # a --config given now decides these


def resume_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--resume continues the run as it was trained: each of its settings this command does not give
    is the run's own (saved with its checkpoint); given ones win. Both are printed, so a resumed run
    never changes stage or precision unseen."""
    from .restart import LATEST, checkpoints_of, refuse_edited_config
    checkpoints = checkpoints_of(args.out)
    if not (args.resume and os.path.isfile(os.path.join(checkpoints, LATEST))):
        return  # (check_steps_beyond_checkpoint names a --resume with nothing to resume)
    client_state = _saved_run(checkpoints)
    if client_state is None:
        return  # the ranks report an unreadable checkpoint, by name
    saved = client_state.get("args")
    saved, taken, kept = saved if isinstance(saved, dict) else {}, [], []
    config_now = args.config is not None  # (before the run's own --config is taken below)
    for name in _RESUMED:
        value, mine = saved.get(name), getattr(args, name, None)
        if name in _DECIDED_BY_CONFIG and config_now:
            continue
        if _unset(mine):
            if not _unset(value):
                setattr(args, name, value)
                taken.append(name)
        elif mine != value:
            had = "none" if _unset(value) else _flag(name, value)
            kept.append(f"{_flag(name, mine)} (the run had {had})")
    if "config" in taken and not os.path.isfile(args.config):
        parser.error(f"--resume: the run in --out {args.out} was configured by --config {args.config}, "
                     f"which is not there now: give its config again with --config")
    if "config" in taken:
        refuse_edited_config(parser, args.config, saved.get("config_contents"))
    if taken:
        print(f"--resume: the run's own settings: {' '.join(_flag(n, getattr(args, n)) for n in taken)}")
    if kept:
        print(f"--resume: this command's settings instead of the run's: {'; '.join(kept)}")
    _say_global_batch(saved, args)


def _say_global_batch(saved: dict, args: argparse.Namespace) -> None:
    """A resume on another number of data-parallel ranks changes the global batch (--batch-size is
    per rank): said, with the flag that keeps it, not left to be found in the loss curve."""
    def dp(run) -> int:
        return (run.get("nproc") or 0) // max(1, run.get("tp") or 1)
    was, now, batch = dp(saved), dp(vars(args)), getattr(args, "batch_size", None)
    if was and now and batch and was != now:
        keep = was * batch / now
        hint = f"--batch-size {int(keep)} keeps it" if keep == int(keep) else "no per-rank size keeps it"
        print(f"--resume: {now} data-parallel rank{'s' * (now > 1)} where the run had {was}: the global "
              f"batch is now {now * batch} sequences (was {was * batch}; --batch-size is per rank, {hint})")


def _saved_run(checkpoints: str) -> dict | None:
    """The client state `zeroshard train` saved with the latest checkpoint in `checkpoints` (its
    losses and arguments), {} where another program saved it, None where it cannot be read."""
    import zeroshard
    try:
        client_state = zeroshard.checkpoint_info(checkpoints).get("client_state") or {}
    except (zeroshard.CheckpointError, AttributeError):
        return None
    return client_state if isinstance(client_state, dict) else None


def _unset(value) -> bool:
    """A flag not given (its default), or a saved setting the run did not have. (0 is a value: a seed.)"""
    return value is None or value is False or value == []


def _flag(name: str, value) -> str:
    flag = "--" + name.replace("_", "-")
    if value is True:
        return flag
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


@contextmanager
def hold_out(parser: argparse.ArgumentParser, out: str) -> Iterator[None]:
    """One `zeroshard train` writes to an --out at a time: a second one would move the first's
    checkpoints aside or save its own steps over them. An exclusive lock on OUT/.zeroshard.lock,
    held while the block runs (the run), refuses the second by name, before it touches anything.
    Where there is no lock to take (not POSIX, an unwritable --out that _check_writable names, a
    filesystem without flock), the run goes on without one."""
    lock = _lock_file(out)
    if lock is None:
        yield
        return
    with lock:
        import fcntl
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "running"
            parser.error(f"--out {out} is in use by another zeroshard train ({holder}): it would move that "
                         f"run's checkpoints aside or save over them; give another --out, or wait for "
                         f"that run to end")
        except OSError as e:  # (Lustre without flock, NFS without lockd)
            held = False
            print(f"--out {out}: no lock ({e.strerror or e}), so a second run into it would not be refused")
        if held:
            lock.seek(0)
            lock.truncate()
            lock.write(f"pid {os.getpid()}")
            lock.flush()
        yield  # (the lock goes with the file's closing)


def _lock_file(out: str):
    try:
        import fcntl  # noqa: F401 - POSIX only
        os.makedirs(out, exist_ok=True)
        return open(os.path.join(out, ".zeroshard.lock"), "a+")
    except (ImportError, OSError):
        return None


def _check_writable(parser: argparse.ArgumentParser, out: str) -> None:
    """--out is created (as the run would) and written to now, not found unwritable when the run
    ends and its checkpoint cannot be saved."""
    import tempfile
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        parser.error(f"--out {out} cannot be written ({e.strerror or e}): give a directory this user "
                     f"can create and write")


def keep_aside(checkpoints: str) -> str:
    """Move an earlier run's checkpoint folder beside it, named by when its latest was written
    (checkpoints-YYYYmmdd-HHMMSS, numbered where taken); returns the new path."""
    import time
    with open(os.path.join(checkpoints, "latest")) as f:
        latest = os.path.join(checkpoints, f.read().strip())
    when = os.path.getmtime(latest if os.path.exists(latest) else checkpoints)
    base = f"{checkpoints}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(when))}"
    target, n = base, 1
    while os.path.exists(target):
        n += 1
        target = f"{base}-{n}"
    os.rename(checkpoints, target)
    return target


def check_nvme_path(nvme_path: str | None, engine_config: dict) -> None:
    """--nvme-path is where nvme offload writes: given with nothing offloaded there, missing where
    something is, or not a directory, say so by the flag's name, before any rank starts."""
    zero = engine_config.get("zero_optimization", {})
    on_disk = [key for key in ("offload_optimizer", "offload_param")
               if isinstance(zero.get(key), dict) and zero[key].get("device") == "nvme"]
    if nvme_path is not None and not on_disk:
        raise ValueError(f"--nvme-path {nvme_path}: nothing is offloaded to nvme; add --offload-optimizer "
                         f"nvme and/or --offload-param nvme, or drop --nvme-path")
    for key in on_disk:
        path = zero[key].get("nvme_path")
        if path is None:
            raise ValueError(f"--{key.replace('_', '-')} nvme needs --nvme-path DIR, the directory for its "
                             f"files (or nvme_path in the config's zero_optimization.{key})")
        if isinstance(path, str) and not os.path.isdir(path):  # (another type: Config.load names it)
            given = f"--nvme-path {path}" if path == nvme_path else f"the config's nvme_path {path!r}"
            raise ValueError(f"{given} is not a directory: create it, or give a directory on the disk to use")


def _model_shape(a: dict) -> dict:
    """What the built-in GPT's shapes come from, as train.build_model resolves the flags; for an
    --hf-config run only that one was given (its file may have moved: the checkpoint judges it)."""
    if a.get("hf_config"):
        return {"hf_config": True}
    layers, width, _ = SIZES.get(a.get("size"), (None, None, None))
    return {"layers": a.get("layers") or layers, "width": a.get("width") or width,
            "seq_len": a.get("seq_len")}


def _flags(a: dict) -> str:
    names = ["hf_config"] if a.get("hf_config") else ["size", "layers", "width"]
    return " ".join(f"--{n.replace('_', '-')} {a[n]}" for n in names + ["seq_len"] if a.get(n) is not None)


def _check_model_flags(parser: argparse.ArgumentParser, args, saved: dict) -> None:
    """--resume builds the model from this command's flags: ones that make another model than the
    run was started with would be refused by the checkpoint's missing keys or shapes; name the
    flags instead."""
    if not saved or not all(k in saved for k in ("size", "layers", "width", "hf_config", "seq_len")):
        return  # (not saved by `zeroshard train`: the checkpoint's own check names what differs)
    mine = asdict(args)  # (a TrainArgs)
    if _model_shape(saved) != _model_shape(mine):
        parser.error(f"--resume: the run in --out {args.out} was started with {_flags(saved)}, and this "
                     f"command's flags ({_flags(mine)}) build another model: give the run's model flags "
                     f"again ({_flags(saved)})")


def defaults_from_config(args: argparse.Namespace) -> None:
    """Options not given on the command line take the config's values, then the usual defaults; a
    --batch-size that contradicts the config's batch sizes is an error naming both."""
    import zeroshard
    raw = getattr(args, "config_contents", None)  # (as the command read it)
    if raw is None:
        raw = zeroshard.Config.read(args.config) if args.config else {}
    zero = raw.get("zero_optimization", {})  # not a dict: Config.load below names the error
    if getattr(args, "stage", 0) is None:
        args.stage = zero.get("stage", 3) if isinstance(zero, dict) else 3  # validated just below
    for stage in getattr(args, "stages", []):  # compare: judged at every stage it will run
        try:
            zeroshard.Config.load(_at_stage(raw, stage))
        except zeroshard.ConfigError as e:
            raise ValueError(f"--config at stage {stage} (of --stages): {e}; leave stage {stage} out of "
                             f"--stages, or change the config") from None
    # as train runs it (compare: each of its stages was judged just above)
    config = zeroshard.Config.load(_at_stage(raw, args.stage if hasattr(args, "stage") else max(args.stages)))
    if getattr(args, "lr", None) is not None and config.scheduler is not None:
        raise ValueError(f"--lr {args.lr}: the config's \"scheduler\" section ({config.scheduler.type}) sets "
                         f"the learning rate at every step, so --lr would be ignored; set the peak in that "
                         f"section (e.g. warmup_max_lr), or drop --lr")
    if args.precision is None:
        args.precision = config.precision  # fp32 unless a bf16 or fp16 section enables it
    dp = args.nproc // getattr(args, "tp", 1)
    micro = config.train_micro_batch_size_per_gpu
    config.check_batch_sizes(dp)  # and, from both batch sizes alone, the accumulation steps
    if micro is None and config.train_batch_size is not None:
        micro = config.train_batch_size // (config.gradient_accumulation_steps * dp)
    if args.batch_size is not None and micro is not None and args.batch_size != micro:
        raise ValueError(f"--batch-size {args.batch_size} but the config's batch sizes give a micro-batch "
                         f"of {micro} per rank ({dp} data-parallel ranks): drop one of them")
    if args.batch_size is None:
        device = "cpu" if getattr(args, "compare", False) else getattr(args, "device", "cpu")
        args.batch_size = micro or DEFAULT_RUN[device]["batch_size"]


def _at_stage(raw: dict, stage: int | None) -> dict:
    """The config with `stage` in its zero_optimization section (None, or no section to put it in:
    as it is), so a file without a stage is judged at the stage the command runs."""
    zero = raw.get("zero_optimization", {})
    return raw if stage is None or not isinstance(zero, dict) else \
        {**raw, "zero_optimization": {**zero, "stage": stage}}


# The run a bare `zeroshard train` makes, by device: on the CPU a small model for about half a
# minute; on a GPU a larger one for about a minute, long enough that its sample reads as Python.
# (`compare` keeps the CPU's shapes on a GPU, and its own 30 steps.)
DEFAULT_RUN = {"cpu": {"size": "small", "seq_len": 64, "steps": 300, "batch_size": 8},
               "cuda": {"size": "large", "seq_len": 256, "steps": 1500, "batch_size": 32}}


def default_run(args: argparse.Namespace) -> None:
    """Fill the shape options not given, from DEFAULT_RUN for the resolved device (batch_size only
    where the config gives none: defaults_from_config)."""
    comparing = getattr(args, "compare", False)
    run = DEFAULT_RUN["cpu" if comparing else args.device]
    if comparing and args.steps is None:
        args.steps = 30
    for name in ("size", "seq_len", "steps"):
        if getattr(args, name) is None:
            setattr(args, name, run[name])
    if args.seed is None:  # (None until here: --resume takes the run's)
        args.seed = 0


def resolve_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--device auto becomes cuda or cpu; --nproc defaults to the GPU count on cuda, 2 on cpu."""
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "auto":
        args.device = "cuda" if gpus else "cpu"
    if args.device == "cuda" and not gpus:
        parser.error("--device cuda: no CUDA device is visible; use --device cpu")
    if args.nproc is None:
        args.nproc = gpus if args.device == "cuda" else 2
    if args.device == "cuda" and args.nproc > gpus:
        parser.error(f"--nproc {args.nproc} ranks but {gpus} GPU(s): NCCL needs one GPU per rank; use "
                     f"--nproc {gpus} or fewer, or --device cpu to run more ranks on the CPU")


@contextmanager
def ranks_report_errors(parser: argparse.ArgumentParser, out: str | None = None,
                        again: str = "") -> Iterator[None]:
    """A rank that fails on bad input (a checkpoint of another model, say) ends the command with
    that error's one line, as a flag error does, instead of the launcher's traceback of every rank;
    so does a stop by Ctrl-C or SIGTERM, or a rank killed by a signal, naming the run's last
    checkpoint in `out` and the command that continues it (`again`). Any other failure is raised
    with its traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    # Their tracebacks of the failed ranks are in the ChildFailedError re-raised below.
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic.multiprocessing",
                                                  "torch.multiprocessing.spawn")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    except ChildFailedError as failed:
        messages = [f.message.get("message", "") if isinstance(f.message, dict) else str(f.message)
                    for f in failed.failures.values()]
        known = [m for m in messages if m.startswith(_USER_ERRORS)]
        killed = sorted((rank, f.signal_name()) for rank, f in failed.failures.items()
                        if f.exitcode is not None and f.exitcode < 0)
        if known:
            parser.exit(1, f"zeroshard: error: {known[0]}\n")
        if killed:  # (by the kernel's OOM killer, or by hand): no traceback of ours says more
            rank, signal = killed[0]
            parser.exit(1, f"zeroshard: error: rank {rank} was killed ({signal}; out of memory?)"
                           f"{_resume_hint(out, again)}. --max-restarts K restarts the ranks from the "
                           f"last checkpoint (--save-every N) when one dies\n")
        raise
    except (SignalException, KeyboardInterrupt) as stop:
        sigval = getattr(stop, "sigval", None)
        parser.exit(128 + (sigval or 2), f"zeroshard: stopped by {sigval.name if sigval else 'SIGINT'}"
                                         f"{_resume_hint(out, again)}\n")
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


def _resume_hint(out: str | None, again: str) -> str:
    """Where a stopped run's checkpoints are and the command that continues it ('' with none)."""
    from .restart import LATEST, checkpoints_of
    if out is None or not os.path.isfile(latest := os.path.join(checkpoints_of(out), LATEST)):
        return ""
    with open(latest) as f:
        tag = f.read().strip()
    return f": its last checkpoint is {tag}; continue with `{again}`"
