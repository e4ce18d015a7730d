"""The planner's step-time model: one optimizer step of one rank, from a machine's rates.

A step is `accumulation` micro-batches of forward and backward, then the optimizer step:
- compute: matrix flops (6Ψ per token for forward and backward over the rank's MP slice, plus
  attention's 12·s·d per token and layer, halved by the causal mask) at the matrix rate; where
  calibrated, the activations' elementwise work, the per-parameter work and each layer's dispatch
  cost at their fitted rates (else the saved activations moved a few times at the device's memory
  rate). Checkpointing makes each block's work (not the head's) larger by its recompute: the share
  a checkpointed block measured on this machine adds (else a third: the forward's flops; on a CPU
  in bf16 the backward's kernels are slower than the forward's, and the share is smaller);
- communication: the paper's volumes per rank (2Ψ for stages 0-2: reduce-scatter and all-gather;
  3Ψ for stage 3, whose gathers repeat every micro-batch) in the compute dtype, at each
  collective's measured rate where calibrated (gloo), else each element crossing the link
  (N-1)/N times in a ring; a latency per unit and collective; Megatron's four all-reduces of the
  block's activations per layer with MP. Gradients reduce per micro-batch at stages 2-3, once
  per step at 0-1. With overlap (a GPU) communication hides under compute, the longer of the two
  counting; on a CPU group the collectives take the same cores, so they add;
- the optimizer step: Adam over the rank's owned elements at the device's measured (else
  memory-bound) or the host Adam rate; with offload, the gradient's copy down and the update's
  copy up over the host link, one after the other (stage 3's pipelined update, core/pipeline.py,
  may overlap them with the next forward; on one H200 its measured step matched their sum, not the
  overlap: docs/plan.md); with disk offload, the optimizer's files read and written each step
  (overlapped with the host step: the longer counts), and stage-3 parameter shards read from
  disk at each gather beyond what the host cache holds.
Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .formulas import BYTES_PER_PARAM
from .plan_memory import Setup, activations, shards
from .plan_shapes import Shape


@dataclass(frozen=True)
class Rates:
    """A machine's rates, per rank. Bytes and flops per second; `adam` in elements per second. The
    fields after `overlap` are calibrated on this machine (app/plan_calibrate); 0 means not
    measured, and the simpler model beside each is used."""

    matmul: float  # sustained matrix flops/s of one device, in the run's precision
    memory: float  # the device's memory bandwidth (elementwise work, device Adam), bytes/s
    host_adam: float  # host Adam (torch's fused CPU AdamW), elements/s for one rank
    host_link: float  # host <-> device copies, bytes/s (0: one memory, no copies)
    collective: float  # data-parallel collective bandwidth per rank (bytes/s of the link)
    mp_collective: float  # model-parallel (within a node) collective bandwidth per rank, bytes/s
    disk_read: float  # bytes/s for one rank (a node's disks are shared by its ranks)
    disk_write: float  # bytes/s
    overlap: bool = True  # communication overlaps compute (a GPU's streams; not a CPU group)
    layer_fixed: float = 0.0  # s per layer and micro-batch: dispatch (0: the kernels' launch ignored)
    elementwise: float = 0.0  # activation elements/s (0: the saved bytes moved at `memory`)
    weights: float = 0.0  # parameters/s: per-parameter work of a forward and backward (0: none)
    device_adam: float = 0.0  # the device optimizer, elements/s (0: memory-bound at `memory`)
    all_reduce: float = 0.0  # full-size bytes/s among the data-parallel ranks (0: a ring at `collective`)
    reduce_scatter: float = 0.0
    all_gather: float = 0.0
    latency: float = 0.0  # s per collective
    engine_fixed: float = 0.0  # the engine's own work per micro-batch, s (app/plan_verify.engine_reference)
    engine_per_param: float = 0.0  # ... and per step and parameter of the rank's model slice, s
    engine_token_scale: float = 0.0  # ... and the token work's share beyond the calibrated rates
    recompute: float = 0.0  # what checkpointing adds to a block's forward and backward (0: a third)


@dataclass(frozen=True)
class StepTime:
    compute: float
    comm: float
    optimizer: float
    total: float


def step_flops(shape: Shape, setup: Setup) -> float:
    """Matrix flops of one micro-batch on one rank (with recompute when checkpointing)."""
    tokens = setup.micro_batch * setup.seq
    # every parameter is a matmul's but the embedding lookups' (the tied head's matrix is one) and
    # the experts a token is not routed to
    lookups = shape.positions * shape.width + (0 if shape.tied else shape.vocab * shape.width)
    dense = 2 * (shape.psi - shape.idle - lookups)
    attention = 2 * 2 * setup.seq * shape.width * shape.layers / 2  # QK^T and AV, causal: half
    forward = tokens * (dense + attention) / setup.mp
    return forward * (4 if setup.checkpointing else 3)


def model_flops(shape: Shape, setup: Setup) -> float:
    """The useful flops of one micro-batch (forward and backward, no recompute), for throughput."""
    return step_flops(shape, replace(setup, checkpointing=False))


def recompute_factor(s: Setup, rates: Rates) -> float:
    """A checkpointed block's work over a plain one's: 1 + the recompute's measured share (a third,
    the forward's flops, where not calibrated); 1 without checkpointing."""
    return 1 + (rates.recompute or 1 / 3) if s.checkpointing else 1.0


def token_time(shape: Shape, s: Setup, rates: Rates) -> float:
    """The work of one micro-batch that grows with its tokens, at the calibrated rates: matrix
    flops and, where calibrated, the activations' elementwise work (else the saved activations
    moved a few times at the device's memory rate); the blocks' share larger by the recompute
    where checkpointing (the head is not checkpointed)."""
    tokens = s.micro_batch * s.seq
    head_flops = 3 * 2 * tokens * shape.vocab * shape.width / s.mp  # the output projection's matmul
    block_flops = model_flops(shape, s) - head_flops
    if rates.elementwise:  # calibrated: the block's elements as the calibration counts them
        per_layer = tokens * (9 * shape.width + shape.mlp_wide * shape.ffn) / s.mp
        blocks = block_flops / rates.matmul + shape.layers * per_layer / rates.elementwise
        head = head_flops / rates.matmul + 2 * tokens * shape.vocab / s.mp / rates.elementwise
    else:
        kept, _ = activations(shape, replace(s, checkpointing=False))
        # each saved byte written, read, and its gradient likewise
        blocks = block_flops / rates.matmul + 6 * kept / rates.memory
        head = head_flops / rates.matmul
    return blocks * recompute_factor(s, rates) + head


def compute_time(shape: Shape, s: Setup, rates: Rates) -> float:
    """Forward and backward of one micro-batch: the token work (scaled by what the engine's
    reference runs measured beyond it), the per-parameter work and each layer's dispatch cost
    (a checkpointed block's larger by its recompute), and the engine's own fixed work per
    micro-batch."""
    weights = shape.psi / s.mp / rates.weights if rates.weights else 0.0
    dispatch = (shape.layers * recompute_factor(s, rates) + 1) * rates.layer_fixed
    tokens = token_time(shape, s, rates) * (1 + rates.engine_token_scale)
    return tokens + weights + dispatch + rates.engine_fixed


def collective_time(kind: str, full_bytes: float, dp: int, rates: Rates) -> float:
    """One collective of `full_bytes` (the unsharded size) among dp ranks: at the measured rate for
    its kind, else each element crossing the link (dp - 1) / dp times in a ring (twice for an
    all-reduce)."""
    measured = getattr(rates, kind)
    if measured:
        return full_bytes / measured
    return full_bytes * (dp - 1) / dp * (2 if kind == "all_reduce" else 1) / rates.collective


def dp_comm_time(shape: Shape, s: Setup, nproc: int, rates: Rates) -> float:
    """The data-parallel collectives of one step: the paper's volumes (stage 0: an all-reduce of the
    gradients; 1: their reduce-scatter and the parameters' all-gather; 2: the reduce-scatter every
    micro-batch; 3: two gathers and a reduce-scatter every micro-batch), plus each collective's
    latency, one per unit. MiCS runs them inside its shard group (within a node: `mp_collective`)
    and adds the gradient shard's all-reduce across the replicas once a step; hpZ's backward gather
    stays within its partition (a node)."""
    dp, shard = nproc // s.mp, s.shard_degree(nproc)
    if dp == 1:
        return 0.0
    pb, gb, _ = BYTES_PER_PARAM[s.precision]
    params, grads = shape.psi / s.mp * pb, shape.psi / s.mp * gb
    calls = {
        0: [("all_reduce", grads, 1)],
        1: [("reduce_scatter", grads, 1), ("all_gather", params, 1)],
        2: [("reduce_scatter", grads, s.accumulation), ("all_gather", params, 1)],
        3: [("reduce_scatter", grads, s.accumulation), ("all_gather", params, 2 * s.accumulation)],
    }[s.stage]
    latency = len(shape.units) * rates.latency
    # within a node: the ring at the node's bandwidth (the measured rates are the data-parallel group's)
    inside = replace(rates, collective=rates.mp_collective, all_reduce=0.0, reduce_scatter=0.0,
                     all_gather=0.0)
    if s.mics:  # every collective above inside a node, then the shard's all-reduce over dp / mics
        across = collective_time("all_reduce", grads / shard, dp // shard, rates)
        return across + sum(n * (collective_time(k, b, shard, inside) + latency) for k, b, n in calls)
    total = sum(n * (collective_time(kind, size, dp, rates) + latency) for kind, size, n in calls)
    if s.hpz and s.stage == 3:  # backward's gather from the secondary partition, within a node
        backward = s.accumulation * collective_time("all_gather", params, dp, rates)
        total += s.accumulation * collective_time("all_gather", params, s.hpz, inside) - backward
    return total


def step_time(shape: Shape, setup: Setup, nproc: int, rates: Rates) -> StepTime:
    s = setup
    pb, gb, _ = BYTES_PER_PARAM[s.precision]
    # the engine's per-parameter work (casts, gradient bookkeeping) counted once per step
    compute = s.accumulation * compute_time(shape, s, rates) + rates.engine_per_param * shape.psi / s.mp
    dp_comm = dp_comm_time(shape, s, nproc, rates)
    tokens = s.micro_batch * s.seq
    # Megatron's four all-reduces of a layer's activations per micro-batch (the recomputed forward
    # repeats its two), each at the measured rate where the collectives were measured (gloo on a
    # CPU group: MP's ranks are its ranks), else in a ring within the node, and each with its latency
    # (small, many and in series: on gloo, most of their time)
    mp_calls = 0.0 if s.mp == 1 else s.accumulation * shape.layers * 4 * (1.5 if s.checkpointing else 1)
    within = rates if rates.all_reduce else replace(rates, collective=rates.mp_collective)
    activation = tokens * shape.width * pb
    mp_comm = mp_calls * (collective_time("all_reduce", activation, s.mp, within) + rates.latency)
    comm = dp_comm + mp_comm
    owned = sum(sh if s.stage >= 1 else p for p, sh in shards(shape, s.mp, s.shard_degree(nproc)))
    off_opt = s.offload_optimizer != "none" and s.stage >= 1
    if off_opt:
        link = owned * (gb + pb) / rates.host_link if rates.host_link else 0.0
        adam = owned / rates.host_adam
        disk = (
            owned * 12 * (1 / rates.disk_read + 1 / rates.disk_write)
            if s.offload_optimizer == "nvme"
            else 0.0
        )
        optimizer = max(adam, disk) + link
    else:
        optimizer = (
            owned / rates.device_adam
            if rates.device_adam
            else owned * (4 * 4 + 2 * 4) / rates.memory  # read p, g, m, v; write p, m, v (fp32)
        )
    if s.stage == 3 and s.offload_param != "none":
        params_bytes = owned * pb
        reads = 2 * s.accumulation * params_bytes
        optimizer += reads / rates.host_link if rates.host_link else 0.0
        if s.offload_param == "nvme":
            optimizer += params_bytes * (1 / rates.disk_write)  # (the host cache spares the reads)
    # Megatron's all-reduces sit between a layer's matmuls (on the critical path); the data-parallel
    # collectives overlap compute where the device has streams for them
    busy = (max(compute, dp_comm) if rates.overlap else compute + dp_comm) + mp_comm
    return StepTime(compute, comm, optimizer, busy + optimizer)
