"""`zeroshard plan --verify`: run planned configurations here for a few steps, through the same
path as `zeroshard train` (train.launch with the plan's config), and set the measured peaks and
step time beside the predicted ones.

Measured: on a GPU the device's peak (torch.cuda.max_memory_allocated, the most over the ranks;
beside the prediction less its fragmentation allowance), what the caching allocator reserved
(max_memory_reserved, beside the prediction with the allowance), and the host's peak RSS above the
process's baseline; on a CPU group one memory, so device is None and
host is the peak RSS above the baseline (train.worker: /proc/self/status, the most over ranks).
The baseline is taken once the rank's libraries are loaded and its process group is up;
what the runtime itself then adds (the data, the libraries' workspaces) is not modelled: it is the
reference runs' measured growth against their predicted peaks (engine_reference, in the model's
own family: a fixed part, an overhead per byte and one per byte of the micro-batch's activations;
and the engine's own step costs beside plain torch's), measured once per machine and applied to
the prediction, cached beside the calibration. Step time: the median over optimizer steps (the
first left out) of the sum of their micro-batches' times."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import warnings
from dataclasses import asdict, replace
from typing import NamedTuple

from zeroshard.paper.plan import Plan
from zeroshard.paper.plan_shapes import Shape


def _quiet_run(hw, out: str, **fields):
    """TrainArgs for a run of this module's: every rank here, nothing saved, printed or sampled."""
    from .train import TrainArgs

    return TrainArgs(device=hw.device, nproc=hw.ranks, save=False, quiet=True, sample_tokens=0, out=out,
                     data=[], **fields)


def _args(cli, p: Plan, hw, out: str, config: str):
    s = p.setup
    return _quiet_run(
        hw,
        out,
        hf_config=cli.hf_config,
        size=cli.model or "small",
        layers=cli.layers,
        width=cli.width,
        stage=s.stage,
        steps=cli.verify_steps * s.accumulation,
        batch_size=s.micro_batch,
        seq_len=s.seq,
        precision=s.precision,
        config=config,  # (its offload sections as --write writes them, pin_memory included)
        tp=s.mp,
        activation_checkpointing=s.checkpointing,
        partition_activations=s.checkpointing and s.mp > 1,
    )


def _reference_args(hw, size: str, seq: int, batch: int, precision: str, out: str, hf: str | None = None):
    """A reference run (engine_reference): a built-in size (or `hf`, a config.json), stage 0, a few steps."""
    return _quiet_run(hw, out, size=size, hf_config=hf, stage=0, steps=8, batch_size=batch, seq_len=seq,
                      precision=precision)


def reference_config(family: dict, size: str) -> dict:
    """A Hugging Face config of `family`'s architecture in a built-in size's shape (its layers,
    width and heads; the MLP's width and the key/value heads in the family's proportions) over
    bytes: a reference run in the model's own family. Its ops, not its size, are what differs
    from the built-in GPT's: a Hugging Face block's many small tensors (norms in fp32, rotary
    tables, a gated MLP) leave glibc's heap more holes per byte than the GPT's (docs/plan.md)."""
    from .sizes import SIZES

    layers, width, heads = SIZES[size]
    # each under the name the config uses (GPT-2's or the others'), as shape_from_hf reads them
    names = [gpt2 if gpt2 in family else other for gpt2, other in
             (("n_layer", "num_hidden_layers"), ("n_embd", "hidden_size"), ("n_head", "num_attention_heads"))]
    was_layers, was_width, was_heads = (family[n] for n in names)
    config = {**family, **dict(zip(names, (layers, width, heads))), "vocab_size": 256}
    for key, value in family.items():  # per-layer lists (Qwen's layer_types): the pattern, cut or repeated
        if isinstance(value, list) and len(value) == was_layers and was_layers > 0:
            config[key] = [value[i % was_layers] for i in range(layers)]
    config.pop("head_dim", None)  # (width / heads, as the built-in GPT's)
    # (in multiples of 8, as real models' are: transformers' grouped expert matmuls need rows of
    # 16-byte multiples in 16 bits)
    for key in ("n_inner", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if config.get(key):
            config[key] = max(8, 8 * round(family[key] * width / was_width / 8))
    if family.get("num_key_value_heads"):  # the same heads per key/value head, where they divide
        per_kv = max(1, was_heads // family["num_key_value_heads"])
        most = max(1, heads // per_kv)
        config["num_key_value_heads"] = max(k for k in range(1, most + 1) if heads % k == 0)
    for key in ("n_positions", "max_position_embeddings"):
        if key in config:
            config[key] = max(config[key], max(seq for _, seq, _ in REFERENCES))
    return config


def measured_worker(args) -> dict:
    """train.worker (which measures a rank's peak RSS above its resident size once its process
    group is up), with the code the run needs loaded before that baseline, as torch and zeroshard
    are: the engine's modules, imported on first use, and the model's own (a Hugging Face model's
    are about 90 MiB; the built-in GPT's first construction loads about 60 MiB of torch's), by the
    run's model built once on "meta", which allocates nothing. Code is not the model's memory, and
    every model's baseline is then taken at the same point."""
    import torch

    import zeroshard

    from .train import build_model, worker

    zeroshard.initialize  # noqa: B018 - imports the engine
    with torch.device("meta"):
        build_model(args)
    return worker(args)


# the reference runs' sizes, sequences and micro-batches: three of 16 tokens, one of 256
REFERENCES = (("tiny", 16, 1), ("medium", 16, 1), ("large", 16, 1), ("medium", 64, 4))


def engine_reference(hw, precision: str, again: bool = False, family: dict | None = None) -> dict:
    """What a CPU rank costs beyond the model's own bytes and arithmetic, from four reference runs
    (the tiny, medium and large built-in GPT, stage 0, one sequence of 16, and the medium one with
    four sequences of 64; the plan's precision; for a Hugging Face model, `family` its config.json,
    the same sizes in its own architecture: reference_config):
    - memory, through the tiny and medium runs: measured growth = fixed + (1 + per_byte) x
      predicted peak: the runtime's fixed bytes (the corpus, the libraries' workspaces, less what
      the process had already peaked at before its baseline) and the allocator's overhead per
      byte (freed memory it keeps); and, through the medium run of 4 x 64 tokens, a share per
      byte of the micro-batch's activations beyond 16 tokens' (memory_terms);
    - time, least squares through all four (no term below 0): measured step = predicted +
      step_fixed + step_per_param x Ψ + token_scale x the token work: the engine's own work (its
      hooks and bookkeeping, the gradients landing in its flat buffers, the casts around the step)
      that the calibrated rates of plain torch do not see, and what a rank's whole model takes per
      token beyond a block timed alone (the 256-token run tells it apart). The reference runs
      take one micro-batch per step, so they cannot tell a micro-batch's share from the step's:
      the fixed part is counted per micro-batch, the per-parameter part once per step.
    On a GPU the tiny and medium runs alone, for the memory: there the growth is the host's, and
    the device's peak beyond its prediction (the same in both: the math libraries' workspaces,
    taken at the first kernels) is the device's fixed part.
    Measured once per machine, precision and rank count (cached, and again when the rates are
    calibrated again); never fitted to the configurations a plan weighs or verifies."""
    from zeroshard.paper.plan import activation_excess, weigh
    from zeroshard.paper.plan_memory import Setup
    from zeroshard.paper.plan_shapes import gpt2_shape, shape_from_hf
    from zeroshard.paper.plan_time import token_time
    from .gpt import config_for
    from .plan_calibrate import least_squares
    from .plan_hw import cache_dir, calibration_path, machine_key
    from .train import launch

    name = f"engine2-{machine_key(precision, hw.ranks)}-{_model_version()}{_family_key(family)}.json"
    path = os.path.join(cache_dir(), name)
    # the residuals are against the calibrated rates: rates measured since make them stale
    rates = calibration_path(precision, hw.ranks)
    if os.path.isfile(path) and not again and not (
            os.path.isfile(rates) and os.path.getmtime(path) < os.path.getmtime(rates)):
        with open(path) as f:
            return json.load(f)
    gpu = hw.device != "cpu"

    def measure(size: str, seq: int, batch: int) -> tuple:
        with tempfile.TemporaryDirectory() as out:
            hf = None
            if family is not None:
                hf, config = os.path.join(out, "config.json"), reference_config(family, size)
                with open(hf, "w") as f:
                    json.dump(config, f)
                ref = shape_from_hf(config, size)
            else:
                cfg = config_for(size, None, None, seq)
                ref = gpt2_shape(size, cfg.layers, cfg.width, cfg.heads, cfg.vocab_size, cfg.seq_len)
            result = launch(_reference_args(hw, size, seq, batch, precision, out, hf), measured_worker)
        setup = Setup(0, precision, micro_batch=batch, seq=seq)
        p = weigh(ref, setup, hw)
        return Reference(p.peak.host, float(result["rss_growth"]), ref.psi,
                         optimizer_step_s(result["step_s_each"], 1) - p.time.total,
                         token_time(ref, setup, hw.rates),
                         float(result["gpu_peak"]) - (p.peak.device - p.peak.parts["fragmentation"]),
                         activation_excess(ref, setup), p.time.total)

    references = REFERENCES[:2] if gpu else REFERENCES  # (a GPU's need memory alone)
    points = [measure(*r) for r in references]
    consistent = gpu or steps_in_order(points, references, measure)
    predicted, grown, psis, residuals, token_work, device_residuals, excess, _ = zip(*points)
    fixed, per_byte, per_activation_byte = memory_terms(predicted, grown, excess, gpu)
    terms = [[1.0, psi, t] for psi, t in zip(psis, token_work)]
    step_fixed, per_param, token_scale = least_squares(terms, residuals) if not gpu else (0.0, 0.0, 0.0)
    # a GPU's own fixed bytes (the math libraries' workspaces) are the same in both runs: their mean
    device_fixed = max(0.0, statistics.mean(device_residuals)) if gpu else 0.0
    found = {"fixed": fixed, "per_byte": per_byte, "per_activation_byte": per_activation_byte,
             "step_fixed": step_fixed, "step_per_param": per_param, "token_scale": token_scale,
             "device_fixed": device_fixed, "references": points}
    if consistent:  # (else measured again by the next plan, on a machine that may be quieter)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(found, f)
    return found


def out_of_order(predicted: list[float], measured: list[float], slack: float = 0.1) -> int | None:
    """The run whose step time contradicts the others' (one predicted shorter measured longer by
    more than `slack`): of the runs in such pairs, the one whose measured-to-predicted ratio is
    farthest from the median ratio; None where the measured steps keep the predicted order. Each
    run's step is a median over its steps, which a load lasting the whole run still moves."""
    pairs = [(i, j) for i in range(len(predicted)) for j in range(len(predicted))
             if predicted[i] < predicted[j] and measured[i] > measured[j] * (1 + slack)]
    if not pairs:
        return None
    ratios = [m / p for m, p in zip(measured, predicted)]
    middle = statistics.median(ratios)
    return max({k for pair in pairs for k in pair}, key=lambda k: abs(math.log(ratios[k] / middle)))


class Reference(NamedTuple):
    """One reference run against its prediction (engine_reference)."""

    predicted_peak: float
    grown: float  # the measured RSS growth
    psi: int
    step_residual: float  # measured step - predicted step
    token_work: float
    device_residual: float
    activation_excess: float
    predicted_step: float

    @property
    def measured_step(self) -> float:
        return self.predicted_step + self.step_residual


def steps_in_order(points: list[Reference], references, measure, again: int = 2) -> bool:
    """Measure again (up to `again` times) a reference run whose step contradicts the others'
    (out_of_order); False, with a warning, where they still do: the step-time terms are then
    unreliable and not cached."""
    for attempt in range(again + 1):
        bad = out_of_order([p.predicted_step for p in points], [p.measured_step for p in points])
        if bad is None:
            return True
        if attempt < again:
            points[bad] = measure(*references[bad])
    size, seq, batch = references[bad]
    warnings.warn(f"the engine's reference runs timed out of order here (the {size} GPT, {batch} x {seq} "
                  f"tokens, {points[bad].measured_step:.3f} s a step, against the others' "
                  f"{', '.join(f'{p.measured_step:.3f}' for p in points if p is not points[bad])}): another "
                  f"process is likely using this machine's cores, and step times predicted now may be "
                  f"far off; run `zeroshard plan --recalibrate` when it is quiet", UserWarning, stacklevel=3)
    return False


def memory_terms(predicted, grown, excess, gpu: bool) -> tuple[float, float, float]:
    """(fixed, per_byte, per_activation_byte) of the runtime's bytes from the references'
    predicted and measured peaks and their activation bytes beyond 16 tokens' (`excess`,
    plan.activation_excess; REFERENCES' order). The line through the two smaller runs gives the
    fixed part and the share per byte (the large one's stage-0 step leaves glibc's heap holes of its
    own, about a sub-group's temporaries, counted in the prediction, that would tilt it). The medium
    run of 4 x 64 tokens differs from the medium run of 16 in its tokens alone: what it grew beyond
    the line, per byte of its activations beyond the 16 tokens' (none below 0), is the share of a
    micro-batch's activations. Per byte rather than per token, so that a model of another width,
    depth or vocabulary than the reference's takes its own share. A GPU's references are the two
    smaller runs: no share there (the host holds no activations)."""
    residuals = [g - p for p, g in zip(predicted, grown)]
    fixed, per_byte = line(predicted[:2], residuals[:2])
    if gpu:
        return fixed, per_byte, 0.0
    beyond = residuals[3] - (fixed + per_byte * predicted[3])
    return fixed, per_byte, max(0.0, beyond / excess[3])


def line(xs, ys) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points, neither below 0 (a negative
    slope is noise here: 0, and the intercept is the mean)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    spread = sum((x - mx) ** 2 for x in xs)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread) if spread else 0.0
    return max(0.0, my - slope * mx), slope


def _family_key(family: dict | None) -> str:
    """The cache name's part for a Hugging Face family: a digest of its reference configs."""
    if family is None:
        return ""
    import hashlib

    configs = json.dumps([reference_config(family, size) for size, _, _ in REFERENCES], sort_keys=True)
    return "-" + hashlib.sha256(configs.encode()).hexdigest()[:8]


def _model_version() -> str:
    """A hash of the planner's model (its weighing, shape, memory and time modules, and this one's fit): the
    reference runs' residuals are against its predictions, so a changed model measures them again."""
    import hashlib

    from zeroshard.paper import plan, plan_memory, plan_shapes, plan_time

    digest = hashlib.sha256()
    for path in (plan.__file__, plan_memory.__file__, plan_shapes.__file__, plan_time.__file__, __file__):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def optimizer_step_s(micro_batch_s: list[float], accumulation: int) -> float:
    """The median time of one optimizer step: its micro-batches' times summed, the first step
    (warm-up) left out where there are more."""
    steps = [sum(micro_batch_s[i:i + accumulation]) for i in range(0, len(micro_batch_s), accumulation)]
    return statistics.median(steps[1:] or steps)


def with_engine(hw, precision: str, again: bool = False, family: dict | None = None):
    """This machine's Hardware with what engine_reference measured: the runtime's bytes, and on a
    CPU the engine's own step costs in its rates. On a GPU the runtime's bytes are the host's (the
    CUDA libraries loaded at the first kernels, the corpus; the tiny and medium runs' host growth,
    as their stage-0 prediction holds nothing on the host) and the device's fixed part, and the
    engine's work hides under the device's queue."""
    found = engine_reference(hw, precision, again, family)
    if hw.device != "cpu":
        return replace(hw, runtime_bytes=found["fixed"], runtime_per_byte=found["per_byte"],
                       device_runtime_bytes=found["device_fixed"])
    rates = replace(hw.rates, engine_fixed=found["step_fixed"], engine_per_param=found["step_per_param"],
                    engine_token_scale=found["token_scale"])
    return replace(hw, rates=rates, runtime_bytes=found["fixed"], runtime_per_byte=found["per_byte"],
                   runtime_per_activation_byte=found["per_activation_byte"])


def verify(cli, shape: Shape, hw, plans: list[Plan], batch: int) -> list[dict]:
    """Run each plan here for cli.verify_steps optimizer steps; its predicted and measured figures."""
    from .options import ranks_report_errors
    from .plan_report import config_of
    from .train import launch

    out = []
    for p in plans:
        with tempfile.TemporaryDirectory() as folder:
            config = os.path.join(folder, "ds_config.json")
            raw = config_of(p, batch, cli.nvme_path)
            raw.pop("train_batch_size")  # (the micro-batch and accumulation say it)
            with open(config, "w") as f:
                json.dump(raw, f)
            with ranks_report_errors(argparse.ArgumentParser(prog="zeroshard plan --verify")):
                result = launch(_args(cli, p, hw, folder, config), measured_worker)
        cpu = hw.device == "cpu"
        # the device's tensors (max_memory_allocated) beside the prediction without the allocator's
        # allowance; what the allocator held (max_memory_reserved) beside the prediction with it
        predicted = {
            "device_peak_bytes": None if cpu else p.peak.device - p.peak.parts["fragmentation"],
            "device_reserved_bytes": None if cpu else p.peak.device,
            "host_peak_bytes": p.peak.host,
            "step_s": p.time.total,
        }
        measured = {
            "device_peak_bytes": None if cpu else float(result["gpu_peak"]),
            "device_reserved_bytes": None if cpu else float(result["gpu_reserved"]),
            "host_peak_bytes": float(result["rss_growth"]),
            "step_s": optimizer_step_s(result["step_s_each"], p.setup.accumulation),
        }
        out.append(
            {
                "config": {**p.setup.__dict__, "name": p.setup.name},
                "predicted": predicted,
                "measured": measured,
                "runtime_bytes": p.peak.parts.get("runtime", 0.0),
                "predicted_parts": p.peak.parts,
                "predicted_time": asdict(p.time),
                "rates": asdict(hw.rates),
                "measured_states": result.get("memory_stats", {}),
                "host_growth_phases": result.get("rss_growth_phases", {}),
            }
        )
    return out
