"""The planner: every configuration of a model on some machines, weighed by memory and step time.

It enumerates ZeRO stages 0-3, optimizer offload (none, cpu, nvme; stage >= 1), parameter offload
(stage 3), activation checkpointing, the model-parallel degree and the micro-batch (the global
batch's per-rank share split into micro-batches and accumulation steps), predicts each one's peak
bytes by place (plan_memory.py) and step time (plan_time.py), and ranks those that fit, fastest
first. What does not fit says why; when nothing fits, `smallest_change` names the least change
that would fit (nvme offload, more nodes, a shorter sequence). `paper_projection` runs the same
model on the paper's hardware. Pure arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .estimate import GIB
from .plan_memory import Peak, Setup, activations, peak
from .plan_shapes import Shape, gpt2_shape
from .plan_time import Rates, StepTime, model_flops, step_time

TIE = 0.02  # step times this close (relative) rank as equal: the model's error is larger

OFFLOADS = (
    ("none", "none"),
    ("cpu", "none"),
    ("nvme", "none"),
    ("none", "cpu"),
    ("cpu", "cpu"),
    ("nvme", "nvme"),
)  # (optimizer, parameters)


@dataclass(frozen=True)
class Hardware:
    """Machines: `nodes` x `per_node` ranks. device_bytes per device; host_bytes and disk_bytes per
    node (the node's ranks share them). device "cpu": the ranks are host processes (device memory is
    host memory)."""

    nodes: int
    per_node: int
    device_bytes: float
    host_bytes: float
    disk_bytes: float
    rates: Rates
    device: str = "cuda"
    nvme: bool = True  # a disk path to offload to
    # what a rank's process holds beyond the model's bytes on a CPU group (measured: the app's
    # engine_reference): a fixed part, and a share of the predicted peak (freed memory kept)
    runtime_bytes: float = 0.0
    runtime_per_byte: float = 0.0
    # and a share of the micro-batch's activation bytes beyond one sequence of 16 tokens': what its
    # tokens leave in glibc's heap beyond the activations the model counts (a Hugging Face family's
    # more than the built-in GPT's). Per activation byte, not per token: the references that
    # measure it are one width, depth and vocabulary, and what a token leaves grows with each
    # (activation_excess)
    runtime_per_activation_byte: float = 0.0
    # on a GPU, what the device holds beyond the model's bytes (measured likewise): the math
    # libraries' workspaces, taken through the caching allocator at the first kernels
    device_runtime_bytes: float = 0.0

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class Plan:
    setup: Setup
    peak: Peak
    time: StepTime
    misfit: str  # "" when it fits
    tokens_per_s: float

    @property
    def fits(self) -> bool:
        return not self.misfit


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def misfit(p: Peak, hw: Hardware) -> str:
    """Why a rank's peak does not fit the hardware ("" when it does)."""
    why = []
    if hw.device != "cpu" and p.device > hw.device_bytes:
        why.append(f"device {p.device / GIB:.1f} > {hw.device_bytes / GIB:.1f} GiB")
    host = p.host * hw.per_node
    if host > hw.host_bytes:
        why.append(f"host {host / GIB:.1f} > {hw.host_bytes / GIB:.1f} GiB per node")
    disk = p.disk * hw.per_node
    if disk > hw.disk_bytes:
        why.append(f"disk {disk / GIB:.1f} > {hw.disk_bytes / GIB:.1f} GiB free per node")
    return "; ".join(why)


def mp_splits(shape: Shape, hw: Hardware, mp: int) -> bool:
    """Whether `mp` ranks of a node can split the model: MP stays within a node, and each rank holds
    whole heads and key/value heads."""
    return hw.per_node % mp == 0 and all(n % mp == 0 for n in shape.mp_divides)


def setups(
    shape: Shape,
    hw: Hardware,
    global_batch: int,
    seq: int,
    precision: str,
    mps: list[int] | None = None,
    stages: list[int] | None = None,
) -> list[Setup]:
    """Every configuration to weigh. MP degrees: those given, else powers of 2 within a node that
    divide the heads and key/value heads and leave a data-parallel degree that divides the global
    batch. Across nodes, MiCS and hpZ too."""
    out = []
    if mps is None:
        mps = [m for m in (1, 2, 4, 8, 16, 32, 64) if mp_splits(shape, hw, m)]
    for mp in mps:
        if hw.ranks % mp:
            continue
        dp = hw.ranks // mp
        if global_batch % dp:
            continue
        per_rank = global_batch // dp
        for micro in _divisors(per_rank):
            for stage in stages if stages is not None else (0, 1, 2, 3):
                for opt, par in OFFLOADS:
                    if (opt != "none" and stage == 0) or (par != "none" and stage != 3):
                        continue
                    if "nvme" in (opt, par) and not hw.nvme:
                        continue
                    for ckpt in (False, True):
                        setup = Setup(stage, precision, opt, par, ckpt, mp, micro, per_rank // micro, seq)
                        out += [setup] + _within_nodes(setup, hw)
    return out


def _within_nodes(s: Setup, hw: Hardware) -> list[Setup]:
    """Across nodes (mp 1, no offload): MiCS sharding within a node (stages 1-3) and ZeRO++'s hpZ
    partition within a node (stage 3), each keeping most of the traffic off the slower link. With
    one GPU a node there is nothing within it: a group of one is a full copy per rank (DDP)."""
    if hw.nodes == 1 or hw.per_node == 1 or s.mp != 1 or s.offload_optimizer != "none" or \
            s.offload_param != "none":
        return []
    out = [replace(s, mics=hw.per_node)] if s.stage >= 1 else []
    return out + ([replace(s, hpz=hw.per_node)] if s.stage == 3 else [])


def activation_excess(shape: Shape, setup: Setup) -> float:
    """A micro-batch's activation bytes (kept and transient) beyond one sequence of 16 tokens':
    what Hardware.runtime_per_activation_byte applies to (the references' line holds 16 tokens).
    Counted as without checkpointing: a recompute allocates the same tensors again, block by block,
    and what they leave in the heap is what the share measures, not what stays alive."""
    plain = replace(setup, checkpointing=False)
    one = replace(plain, micro_batch=1, seq=16)
    return max(0.0, sum(activations(shape, plain)) - sum(activations(shape, one)))


def weigh(shape: Shape, setup: Setup, hw: Hardware) -> Plan:
    p = peak(shape, setup, hw.ranks, hw.device)
    if hw.runtime_bytes or hw.runtime_per_byte or hw.runtime_per_activation_byte:
        runtime = max(0.0, hw.runtime_bytes + hw.runtime_per_byte * p.host
                      + hw.runtime_per_activation_byte * activation_excess(shape, setup))
        p = replace(p, host=p.host + runtime, parts={**p.parts, "runtime": runtime})
    if hw.device_runtime_bytes:
        on_device = hw.device_runtime_bytes
        p = replace(p, device=p.device + on_device, parts={**p.parts, "device_runtime": on_device})
    t = step_time(shape, setup, hw.ranks, hw.rates)
    tokens = setup.micro_batch * setup.accumulation * setup.seq * hw.ranks / setup.mp
    return Plan(setup, p, t, misfit(p, hw), tokens / t.total)


def plan(
    shape: Shape,
    hw: Hardware,
    global_batch: int,
    seq: int,
    precision: str = "bf16",
    mps: list[int] | None = None,
    stages: list[int] | None = None,
) -> list[Plan]:
    """Every configuration weighed: those that fit first, fastest first; then those that do not,
    nearest to fitting first. Times within TIE of each other are ties (the model cannot tell them
    apart), broken by what it under-counts: fewer micro-batches a step (each has its kernel launches
    and, at stage 3, its gathers; where uncalibrated, as for another machine, the token work is the
    same at any micro-batch), then less communication (on a GPU it is hidden under compute, which
    real overlap only approaches), then the least device memory, then host."""
    plans = [weigh(shape, s, hw) for s in setups(shape, hw, global_batch, seq, precision, mps, stages)]
    fit = sorted((p for p in plans if p.fits),
                 key=lambda p: (round(math.log(p.time.total) / math.log1p(TIE)), p.setup.accumulation,
                                p.time.comm, p.peak.device, p.peak.host))
    over = sorted(
        (p for p in plans if not p.fits),
        key=lambda p: max(
            p.peak.device / hw.device_bytes if hw.device != "cpu" else 0,
            p.peak.host * hw.per_node / hw.host_bytes,
        ),
    )
    return fit + over


def smallest_change(
    shape: Shape,
    hw: Hardware,
    global_batch: int,
    seq: int,
    precision: str = "bf16",
    mps: list[int] | None = None,
    machine_flags: str | None = "",
) -> list[str]:
    """When nothing fits: the least changes that make something fit, each alone. `machine_flags`
    follow a suggested --nodes (this machine's figures, where the plan is for this machine); None:
    no flags describe it (a CPU group), so more nodes are said in machines like this one."""
    changes = []

    def fits(h: Hardware, b: int, s: int) -> bool:
        return any(p.fits for p in plan(shape, h, b, s, precision, mps))

    if not hw.nvme:  # a disk of any size: the suggestion says how much it needs
        roomy = replace(hw, nvme=True, disk_bytes=hw.disk_bytes or math.inf)
        fitting = [p for p in plan(shape, roomy, global_batch, seq, precision, mps) if p.fits]
        if fitting:
            need = min(p.peak.disk for p in fitting) * hw.per_node
            changes.append(f"nvme offload (give --nvme-path, a directory on a fast local disk with "
                           f"{need / GIB:.1f} GiB free)")
    for factor in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        bigger = replace(hw, nodes=hw.nodes * factor)
        batch = (
            global_batch
            if global_batch % bigger.ranks == 0
            else bigger.ranks * -(-global_batch // bigger.ranks)
        )
        if fits(bigger, batch, seq):
            more = f" and --global-batch {batch}" if batch != global_batch else ""
            changes.append(f"more machines like this one: {bigger.nodes} ({bigger.ranks} ranks){more}"
                           if machine_flags is None else
                           f"more nodes: --nodes {bigger.nodes}{machine_flags} ({bigger.ranks} devices)"
                           f"{more}")
            break
    shorter = seq // 2
    while shorter >= 16:
        if fits(hw, global_batch, shorter):
            changes.append(f"a shorter sequence: --seq-len {shorter}")
            break
        shorter //= 2
    if global_batch > hw.ranks and fits(hw, hw.ranks, seq):
        changes.append(f"a smaller global batch: --global-batch {hw.ranks}")
    return changes


# ---- the paper's scale ----------------------------------------------------------------------------
# The hardware by its public specifications, nothing fitted to the answer: V100 SXM3 32 GB, 125 TFLOP/s
# fp16 tensor-core peak, 900 GB/s HBM2; DGX-2: 16 GPUs on NVSwitch (NVLink 2: 6 x 25 GB/s each way),
# 8 x 100 Gb/s InfiniBand per node (6.25 GB/s per GPU), PCIe 3 x16 (16 GB/s) to the host, 1.5 TB
# of host memory, 30 TB of NVMe. The matrix rate a transformer sustains on one V100 is the figure
# Megatron-LM published for its 1.2B model on a single V100 (39 TFLOP/s, 30% of peak; Shoeybi et al.
# 2019): a measurement of the device, like this machine's calibration, not of ZeRO's runs.
V100_PEAK = 125e12
V100 = Rates(
    matmul=39e12,
    memory=900e9,
    host_adam=1e9,
    host_link=16e9,
    collective=6.25e9,
    mp_collective=150e9,
    disk_read=2e9,
    disk_write=2e9,
    overlap=True,
)
DGX2 = dict(
    per_node=16,
    device_bytes=32510 * 2**20,  # (the 32 GB V100 as nvidia-smi reports it)
    host_bytes=1.5e12,
    disk_bytes=30e12,
    rates=V100,
)


@dataclass(frozen=True)
class PaperCase:
    """A run the paper reports, with the figure it gives (TFLOP/s per GPU)."""

    label: str
    shape: Shape
    gpus: int
    mp: int
    stage: int
    batch_per_gpu: int
    accumulation: int
    reported_tflops: float
    reported_note: str


PAPER_CASES = (
    # 100B: 125 layers of hidden 8192 (zero_r.py's example), MP 16 within a DGX-2, 25-way DP, P_os+g.
    PaperCase(
        "100B, 400 V100s, MP 16",
        gpt2_shape("100B", 125, 8192, 64, 50257, 1024),
        400,
        16,
        2,
        16,
        1,
        38.0,
        "~38 TFLOP/s per GPU, 15 PFLOP/s in all",
    ),
    # 13B without model parallelism: 40 layers of hidden 5120, P_os+g on 128 GPUs, 8 sequences per GPU
    # in micro-batches of 2.
    PaperCase(
        "13B, 128 V100s, no MP",
        gpt2_shape("13B", 40, 5120, 40, 50257, 1024),
        128,
        1,
        2,
        2,
        4,
        40.0,
        "> 40 TFLOP/s per GPU",
    ),
)


def paper_projection() -> list[dict]:
    """Each paper case weighed on the paper's hardware: predicted TFLOP/s per GPU beside the
    reported figure, the error, and whether the configuration fits 32 GB."""
    rows = []
    for case in PAPER_CASES:
        hw = Hardware(nodes=-(-case.gpus // 16), **DGX2)
        hw = replace(hw, per_node=case.gpus // hw.nodes)
        dp = case.gpus // case.mp
        setup = Setup(
            case.stage,
            "fp16",
            checkpointing=True,
            mp=case.mp,
            micro_batch=case.batch_per_gpu,
            accumulation=case.accumulation,
            seq=1024,
        )
        plan_ = weigh(case.shape, setup, hw)
        per_gpu = (
            case.accumulation * model_flops(case.shape, setup) * 4 / 3 / plan_.time.total / 1e12
        )  # recompute counted
        rows.append(
            {
                "case": case.label,
                "psi": case.shape.psi,
                "gpus": case.gpus,
                "mp": case.mp,
                "dp": dp,
                "stage": case.stage,
                "predicted_tflops_per_gpu": per_gpu,
                "predicted_pflops": per_gpu * case.gpus / 1e3,
                "reported_tflops_per_gpu": case.reported_tflops,
                "reported": case.reported_note,
                "error": per_gpu / case.reported_tflops - 1,
                "fits": plan_.fits,
                "device_peak_gb": plan_.peak.device / 1e9,
                "step_s": plan_.time.total,
            }
        )
    return rows
