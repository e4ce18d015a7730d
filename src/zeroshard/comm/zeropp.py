"""ZeRO++ (Wang et al., 2023): stage 3 with less traffic across nodes.

- hpZ (`zero_hpz_partition_size: k`): when a unit's forward ends, each rank keeps 1/k of its
  gathered parameters (a *secondary* shard) beside its primary 1/N, partitioned over k consecutive
  ranks of its node; the unit's backward all-gathers from those k ranks, inside the node, instead
  of from all N. The secondary shard holds exactly what forward gathered, so backward computes with
  the same values (bit for bit). It is dropped when the parameters change (the step, a checkpoint
  load): an extra Ψ/k per rank from a forward to the next step.
- qwZ (`zero_quantized_weights`): forward's all-gathers send each shard as int8 codes with one fp32
  scale per block of BLOCK elements (quantize.py), and every rank decodes every shard, its own too,
  so all ranks compute with the same weights. Backward's gathers stay exact (or come from hpZ's
  secondary shard, which holds forward's decoded values). The master weights are never quantized.
- qgZ (`zero_quantized_gradients`): the gradient reduce-scatter becomes two all-to-alls of int4 (or
  int8) blocks, hierarchical as ZeRO++'s: inside each node every rank sends each peer the rows the
  peer's column of nodes owns, decodes what it receives and sums it in fp32 (the node's partial
  sums, 1/L of the gradient per rank); then across nodes, among the ranks of the same local index,
  each sends every other node its row, decodes and sums in fp32. Quantized twice, sent once across.

Cross-node bytes per step in Ψ x 2 bytes (bf16), at N ranks in nodes of L: stage 3 sends 3; hpZ 2
(forward's gather, the reduce-scatter); + qwZ 1.5 (forward's gather at 1 byte an element, plus
scales); + qgZ (int4) 0.5 + 1/(4L) plus scales. Buffers travel whole (no bucketing) on these paths.

Here: the options and their groups, made once, by every rank in the same order (dist.new_group),
after the checks that can refuse, which run alike on every rank. The collectives over them:
quantized.py.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch.distributed as dist

from ..config import ConfigError
from .quantize import BLOCK
from .topology import Topology


@dataclass
class Group:
    """One of this rank's ZeRO++ process groups, and whether it spans nodes (for the counts)."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    inter: bool


@dataclass
class ZeroPP:
    """The ZeRO++ options in force and the groups they use."""

    secondary: Group | None   # hpZ: the k ranks a unit's secondary shard is partitioned over
    node: Group | None        # qgZ: the ranks of this rank's node
    cross: Group | None       # qgZ: the ranks of this rank's local index, one per node
    weight_bits: int | None   # qwZ: 8
    grad_bits: int | None     # qgZ: 4 or 8
    block: int = BLOCK

    @property
    def changes_gathers(self) -> bool:
        return self.secondary is not None or self.weight_bits is not None


def check_zeropp(hpz: int, topology: Topology, world_size: int) -> None:
    """hpZ's partition lies within a node: its size divides the ranks of one (local, before any group)."""
    per_node = topology.ranks_per_node
    if hpz > 1 and per_node % hpz:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size {hpz} does not divide the {per_node} "
                          f"ranks of a node: hpZ's secondary shard is partitioned inside one node; choose a "
                          f"divisor of {per_node} (zeroshard.ranks_per_node, or torchrun's --nproc-per-node)")


def _groups(blocks: list[list[int]], rank: int, topology: Topology) -> Group:
    """new_group for every block (every rank makes all of them, in order); this rank's."""
    mine = None
    for ranks in blocks:
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            inter = len({topology.node_of(r) for r in ranks}) > 1
            mine = Group(group, len(ranks), ranks.index(rank), inter)
    return mine


def build_zeropp(zero, grad_bits: int, topology: Topology, rank: int, world_size: int) -> ZeroPP | None:
    """The groups the config's ZeRO++ options need (None without any), over the whole world. The
    layout was checked before any collective (check_zeropp, from engine/checks.py)."""
    hpz = zero.zero_hpz_partition_size
    if hpz <= 1 and not zero.zero_quantized_weights and not zero.zero_quantized_gradients:
        return None
    per_node, nodes = topology.ranks_per_node, world_size // topology.ranks_per_node
    secondary = node = cross = None
    if hpz > 1:
        secondary = _groups([list(range(a, a + hpz)) for a in range(0, world_size, hpz)], rank, topology)
    if zero.zero_quantized_gradients:
        node = _groups([list(range(m * per_node, (m + 1) * per_node)) for m in range(nodes)], rank, topology)
        cross = _groups([list(range(i, world_size, per_node)) for i in range(per_node)], rank, topology)
    return ZeroPP(secondary, node, cross, 8 if zero.zero_quantized_weights else None,
                  grad_bits if zero.zero_quantized_gradients else None)
