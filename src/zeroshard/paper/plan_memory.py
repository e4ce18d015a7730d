"""The planner's memory model: a rank's bytes by place (device, host, disk) for one configuration.

Model states follow the paper's formulas (estimate.model_states) per flat buffer, plus what the
engine adds to them: each unit's buffer padded to a multiple of the data-parallel degree N, one fp32
Adam step counter per buffer, the fp32 master kept apart from the parameters wherever it is not
their own storage (16 bits, or any offload), no 16-bit shard beside a stage-3 master on the device,
disk offload's streaming buffers (buffer_count x the largest sub-group's files) and its parameter
cache. With mp = 1 these are exactly the engine's memory_stats() on a CPU group; with mp > 1 each
buffer is taken as split evenly over the MP ranks (the paper's assumption).

Beside them, per rank: activations (what a transformer block saves for backward, ZeRO-R's
checkpoints instead with activation checkpointing), the step's temporaries (a gathered unit and its
prefetched neighbour, a full-size unit gradient, the fp32 gradient copy of one sub-group where one
is made, the optimizer's per-element temporaries) and a fragmentation allowance. Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from .formulas import BYTES_PER_PARAM
from .plan_shapes import Shape
from .zero_r import ACTIVATION_BYTES

ADAM_STATES = 2  # exp_avg, exp_avg_sq: fp32 each
STEP_COUNTER = 4  # torch's Adam keeps `step` as an fp32 scalar tensor per parameter
SUB_GROUP_SIZE = 100_000_000  # config.zero.sub_group_size's default (elements)
NVME_BUFFER_COUNT = 4  # offload_optimizer.buffer_count's default
MAX_IN_CPU = 1_000_000_000  # offload_param.max_in_cpu's default (elements)
ALIGN = 64  # disk offload's stream aligns each tensor's view to 64 bytes
FRAGMENTATION = {"cuda": 0.05, "cpu": 0.0}  # of the device's peak: the caching allocator's rounding


@dataclass(frozen=True)
class Setup:
    """One configuration the planner weighs (per rank: micro_batch sequences of seq tokens)."""

    stage: int
    precision: str = "bf16"
    offload_optimizer: str = "none"  # none, cpu, nvme
    offload_param: str = "none"  # stage 3: none, cpu, nvme
    checkpointing: bool = False  # ZeRO-R activation checkpointing
    mp: int = 1
    micro_batch: int = 1
    accumulation: int = 1
    seq: int = 1024
    mics: int = 0  # MiCS: states sharded over groups of this many ranks, replicated across (0: off)
    hpz: int = 0  # ZeRO++ hpZ (stage 3): a secondary partition over this many ranks (0: off)

    def shard_degree(self, nproc: int) -> int:
        """Over how many ranks the model states are sharded: the MiCS group, else the dp ranks."""
        return self.mics or nproc // self.mp

    @property
    def name(self) -> str:
        parts = [f"stage {self.stage}", self.precision]
        if self.offload_optimizer != "none":
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"param->{self.offload_param}")
        if self.checkpointing:
            parts.append("ckpt")
        if self.mp > 1:
            parts.append(f"mp {self.mp}")
        if self.mics:
            parts.append(f"MiCS {self.mics}")
        if self.hpz:
            parts.append(f"hpZ {self.hpz}")
        return ", ".join(parts) + f", mb {self.micro_batch} x {self.accumulation}"


@dataclass(frozen=True)
class States:
    """A rank's model states as memory_stats() names them (grads: in the step, `grads_in_step`), and
    by place. device + host + disk == params + grads + optimizer + transfer."""

    params: int
    grads: int
    optimizer: int
    transfer: int
    device: int
    host: int
    disk: int

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer


def _pad(n: int, ranks: int) -> int:
    return -(-n // ranks) * ranks


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def shards(shape: Shape, mp: int, dp: int) -> list[tuple[int, int]]:
    """(padded elements, shard elements) of each flat buffer on one rank."""
    out = []
    for n in shape.units:
        padded = _pad(-(-n // mp), dp)
        out.append((padded, padded // dp))
    return out


def disk_sub_groups(shape: Shape, s: Setup, dp: int) -> tuple[int, int]:
    """Disk offload's sub-groups (buffers of up to SUB_GROUP_SIZE elements, in order): how many,
    and the bytes of the largest's files (master, exp_avg, exp_avg_sq, each aligned)."""
    count = group = largest = elements = 0
    for padded, shard in shards(shape, s.mp, dp):
        owned = shard if s.stage >= 1 else padded
        if not elements or elements + owned > SUB_GROUP_SIZE:
            count, group, elements = count + 1, 0, 0
        group += (ADAM_STATES + 1) * _align(4 * owned)
        elements += owned
        largest = max(largest, group)
    return count, largest


def _grad_bytes(s: Setup) -> int:
    """A gradient element's bytes: stages 2-3 accumulating over micro-batches keep the reduced shard
    in fp32 (core/precision.py)."""
    return 4 if s.stage >= 2 and s.accumulation > 1 else BYTES_PER_PARAM[s.precision][1]


def _transfer_buffers(s: Setup) -> tuple[int, int]:
    """Bytes per owned element of optimizer offload's two host buffers on a GPU: the reduced
    gradient's copy down, and the update's 16-bit staging on its way up (none where the update goes
    up as the fp32 master, or parameter shards are written on the host)."""
    pb = BYTES_PER_PARAM[s.precision][0]
    off_par = s.offload_param != "none" and s.stage == 3
    return _grad_bytes(s), 0 if off_par or pb == 4 else pb


def states(shape: Shape, setup: Setup, nproc: int, one_memory: bool = True) -> States:
    """A rank's model states for `setup` on `nproc` ranks. `one_memory`: a CPU group, where the
    offload's host copies are the device's own tensors (no transfer buffers)."""
    s, dp = setup, setup.shard_degree(nproc)
    pb = BYTES_PER_PARAM[s.precision][0]
    off_opt, off_par = (
        s.offload_optimizer != "none" and s.stage >= 1,
        s.offload_param != "none" and s.stage == 3,
    )
    separate = pb != 4 or off_opt or off_par
    grad_bytes = _grad_bytes(s)
    params = grads = optimizer = disk = transfer = 0
    cached = 0
    for padded, shard in shards(shape, s.mp, dp):
        p = (
            0
            if s.stage == 3 and pb == 2 and not (off_opt or off_par)
            else pb * (shard if s.stage == 3 else padded)
        )
        owned = shard if s.stage >= 1 else padded
        opt = ADAM_STATES * 4 * owned + STEP_COUNTER + (4 * owned if separate else 0)
        params, grads = params + p, grads + grad_bytes * (shard if s.stage >= 2 else padded)
        optimizer += opt
        if off_opt and s.offload_optimizer == "nvme":
            disk += (ADAM_STATES + 1) * 4 * owned
        if off_par and s.offload_param == "nvme":
            disk += p
            if shard <= MAX_IN_CPU - cached:
                cached += shard
                transfer += p
        if off_opt and not one_memory:  # the reduced gradient's host copy, and the update's way up
            transfer += owned * sum(_transfer_buffers(s))
    if off_opt and s.offload_optimizer == "nvme":
        transfer += NVME_BUFFER_COUNT * disk_sub_groups(shape, s, dp)[1]
    offloaded = optimizer if off_opt else 0
    on_host = params if off_par else 0
    host = offloaded + on_host + transfer - disk
    device = params + grads + optimizer - offloaded - on_host
    return States(params, grads, optimizer, transfer, device, host, disk)


def master_pinned(precision: str, offload_param: str) -> bool:
    """Whether a pinned optimizer offload pins the fp32 master: only where the update goes up as
    the master itself (fp32, no parameter shard written on the host). Otherwise nothing copies it,
    and pinning it would only cost host memory (the rounding below). The engine's own rule is
    offload.host.master_goes_up, on torch dtypes; this one is on the plan's names and, as a plan
    never sets `offload_casts`, leaves casts on the device out."""
    return BYTES_PER_PARAM[precision][0] == 4 and offload_param == "none"


def _rounding(size: int) -> int:
    """What torch's caching host allocator adds to a pinned block: it rounds up to a power of two."""
    return (1 << (size - 1).bit_length()) - size if size else 0


def pinned_rounding(shape: Shape, setup: Setup, nproc: int) -> int:
    """Host bytes that pinned memory takes beyond its tensors (a GPU's), as each pinned block is
    rounded up to a power of two. Pinned, per flat buffer: optimizer offload's gradient buffer and
    (where the update goes up in 16 bits) staging buffer, the master where master_pinned says so,
    and cpu parameter offload's shard at rest (copied up at every use); with nvme optimizer offload
    also its streaming buffers. A plan's config pins both offloads, as `zeroshard train
    --offload-*` does. (nvme parameter offload's host cache is not counted here.)"""
    s, dp = setup, setup.shard_degree(nproc)
    per_element: list[int] = []  # bytes per shard element of each pinned buffer of a flat buffer
    if s.offload_optimizer != "none" and s.stage >= 1:
        per_element += [b for b in _transfer_buffers(s) if b]
        on_host = s.offload_optimizer == "cpu"  # (an nvme master is a file)
        per_element += [4] if on_host and master_pinned(s.precision, s.offload_param) else []
    if s.offload_param == "cpu" and s.stage == 3:
        per_element.append(BYTES_PER_PARAM[s.precision][0])
    waste = sum(_rounding(shard * b) for _, shard in shards(shape, s.mp, dp) for b in per_element)
    if s.offload_optimizer == "nvme" and s.stage >= 1:
        waste += NVME_BUFFER_COUNT * _rounding(disk_sub_groups(shape, s, dp)[1])
    return waste


@dataclass(frozen=True)
class Peak:
    """Predicted peak bytes of one rank by place, and what makes them up."""

    device: float
    host: float
    disk: float
    parts: dict

    @property
    def total(self) -> float:
        return self.device + self.host


def activations(shape: Shape, setup: Setup) -> tuple[float, float]:
    """(kept for backward, transient at backward's start) bytes of one micro-batch on one rank.

    A block saves per token: its input and the two norms' outputs, q, k, v and the attention output
    (and its reshaped copy), the MLP's hidden twice (before and after the activation) - 9d + 2f
    elements (d width, f ffn; the gated MLP keeps three f-wide tensors), plus fp32 norm statistics and
    the attention's log-sum-exp; and what a Hugging Face block saves beyond that (Shape.mlp_saved
    and the fields below it). MP splits the d- and f-wide ones. Checkpointing keeps the block's
    input alone, and recomputes one block at a time. The loss (vocab-wide, split over MP as
    Megatron's vocab-parallel loss is) keeps its fp32 log-softmax alone: the logits and their fp32
    copy are its inputs only, freed once it is computed (a loop that keeps the logits, as a Hugging
    Face output holding them does, keeps more). Backward's first moment holds beside it the
    log-softmax's gradient and the logits' in fp32, more than the forward's end (logits, copy and
    log-softmax) holds: the transient counts 8 bytes an element."""
    a, tokens = ACTIVATION_BYTES[setup.precision], setup.micro_batch * setup.seq
    d, f, mp = shape.width, shape.ffn, setup.mp
    block = tokens * (a * (3 * d + (6 * d + shape.mlp_wide * f) / mp) + 4 * (4 + shape.heads / mp))
    block += tokens * d * (2 * 4 * shape.norm_fp32 * (a < 4) + 2 * a * shape.dropout)
    experts, routed = shape.experts
    if experts:  # each routed copy of a token: its input gathered and its expert's output (d-wide),
        # and the router's fp32 logits and probabilities over the experts
        block += tokens * (2 * routed * a * d / mp + 2 * 4 * experts)
    if shape.attention_dropout:  # the math path: six fp32 copies of the scores, not flash's q, k, v
        block += setup.micro_batch * 6 * 4 * shape.heads / mp * setup.seq**2 - tokens * 3 * a * d / mp
    logits = tokens * shape.vocab * 4 / mp  # (vocab-parallel with MP, as Megatron's loss)
    if setup.checkpointing:
        kept = shape.layers * tokens * d * a / mp + block
    else:
        kept = shape.layers * block
    embed = tokens * d * (a * (2 + shape.dropout) + 4 * shape.norm_fp32 * (a < 4))  # (and the final norm's)
    # backward's first moments: the log-softmax's and the logits' fp32 gradients, one block's gradients
    transient = tokens * shape.vocab * 8 / mp + tokens * a * (2 * d + f / mp)
    return kept + logits + embed, transient


def peak(shape: Shape, setup: Setup, nproc: int, device: str = "cuda") -> Peak:
    """A rank's predicted peak by place: model states, activations, the step's temporaries and (on
    a GPU) a fragmentation allowance. On a CPU group, device and host are one memory: `host`
    holds everything and `device` is 0."""
    st = states(shape, setup, nproc, one_memory=device == "cpu")
    pb, gb, _ = BYTES_PER_PARAM[setup.precision]
    dp = setup.shard_degree(nproc)
    sh = shards(shape, setup.mp, dp)
    kept, transient = activations(shape, setup)
    largest_padded = max(p for p, _ in sh)
    temp = 0.0
    if setup.stage == 3:  # the gathered unit and the one prefetched beside it; the root stays gathered
        temp += pb * (sh[0][0] + 2 * max((p for p, _ in sh[1:]), default=0))
    # A unit's full-size gradient until its reduce-scatter is done (stages 2-3; at most two in flight,
    # core/reduce.py), and on a CPU group gloo's reduce-scatter, an all-to-all that receives a
    # full-size buffer, freed once summed (comm/gloo.py, stages 1-3). On a CPU glibc reuses a freed
    # buffer for the next unit's where nothing else large is allocated between (stages 1-2 without
    # checkpointing: two in flight, the reductions overlapping backward); where each unit's backward
    # allocates first (stage 3's gather, a recompute) every unit's stays a hole in the heap until the
    # step ends (core/heap.py), which the references' stage-0 runs do not see.
    reused = setup.stage in (1, 2) and not setup.checkpointing
    holes = 2 * largest_padded if reused else sum(p for p, _ in sh)
    if setup.stage >= 2:
        temp += gb * (largest_padded if device != "cpu" else holes)
    if setup.stage >= 1 and device == "cpu":
        temp += gb * holes
    if setup.stage >= 2 and setup.accumulation > 1:  # a reduction adding to the held fp32 shard
        # receives into a shard-size buffer of its own first (comm/buckets.py): two in flight
        temp += gb * 2 * max(part for _, part in sh)
    owned = sum(s if setup.stage >= 1 else p for p, s in sh)
    step_group = min(owned, SUB_GROUP_SIZE)
    off_opt = setup.offload_optimizer != "none" and setup.stage >= 1
    # the step: the fp32 gradient of one sub-group (none where the reduced gradient is fp32 already:
    # the optimizer steps on it as it is, flat_grad.set_step_grad), and the optimizer's per-element
    # temporaries. On a CPU torch's default Adam steps one tensor at a time (two fp32 temporaries of
    # one buffer), but its first step creates each tensor's state between that tensor's temporaries,
    # and glibc does not get the holes back: about a sub-group's worth stays resident (measured with
    # mallinfo2)
    copy = 4 * step_group if _grad_bytes(setup) != 4 and not off_opt else 0
    step = 4 * step_group + copy
    # hpZ: from a unit's forward to its backward, its secondary shard (over hpz ranks) stays
    secondary = pb * sum(part for _, part in shards(shape, setup.mp, setup.hpz)) if setup.hpz else 0
    freed, on_step = transient + temp, step if not off_opt else 0
    if device == "cpu":
        # glibc keeps what backward frees (buffers of up to 32 MiB stay in its heap) and the step's
        # fp32 temporaries do not fit those holes: the two add rather than overlap
        on_device = st.device + kept + secondary + freed + on_step
    else:
        # A GPU's caching allocator reuses what it frees: the peak is the larger of two moments.
        # Backward's start holds every activation; at stages 2-3 with one micro-batch no gradient
        # yet (they are freed after each step and grow as backward frees activations). The step
        # holds the gradients and its temporaries, the activations gone.
        grads_on_device = st.grads if setup.stage >= 2 and setup.accumulation == 1 else 0
        backward_start = st.device - grads_on_device + kept + secondary + freed
        on_device = max(backward_start, st.device + on_step)
    rounding = pinned_rounding(shape, setup, nproc) if device != "cpu" else 0
    host_extra = (step if off_opt else 0) + rounding
    frag = FRAGMENTATION["cpu" if device == "cpu" else "cuda"] * on_device
    parts = {"model_states": st.model_states, "activations": kept, "secondary": secondary,
             "transient": transient + temp, "step": step, "fragmentation": frag, "transfer": st.transfer,
             "pinned_rounding": rounding}
    if device == "cpu":  # disk offload's buffers are plain memory here, resident only where used:
        # a step takes one per sub-group in turn, so fewer sub-groups than buffers leave some untouched
        if off_opt and setup.offload_optimizer == "nvme":
            count, largest = disk_sub_groups(shape, setup, dp)
            host_extra -= max(0, NVME_BUFFER_COUNT - count) * largest
        return Peak(0.0, on_device + frag + st.host + host_extra, st.disk, parts)
    return Peak(on_device + frag, st.host + host_extra, st.disk, parts)
