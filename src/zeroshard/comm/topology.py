"""Which node each rank runs on, and the MiCS layout of shard groups and replicas over them.

Traffic that crosses nodes is what a multi-node job pays for: comm_stats() splits every
collective's bytes into intra-node and inter-node. The split is counted from the group's
membership, as the paper counts volume: a collective over a group whose ranks sit on more than one
node moves its bytes across nodes; within one node, they stay there.

The topology comes from torchrun (LOCAL_WORLD_SIZE ranks per node, GROUP_RANK the node's index: its
ranks are consecutive) or, to test a multi-node layout on one machine, from the config key
"zeroshard": {"ranks_per_node": k}; without either, all ranks are one node. Every check here is
local and runs before the first collective, so a bad layout fails alike on every rank.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from ..config import ConfigError


@dataclass(frozen=True)
class Topology:
    """Nodes of `ranks_per_node` consecutive global ranks."""

    ranks_per_node: int

    def node_of(self, global_rank: int) -> int:
        return global_rank // self.ranks_per_node

    def spans_nodes(self, group: dist.ProcessGroup | None) -> bool:
        """Do the ranks of `group` (None: the world) sit on more than one node?"""
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        return len({self.node_of(r) for r in ranks}) > 1


def read_topology(ranks_per_node: int | None, rank: int, world_size: int,
                  env: dict[str, str] | None = None) -> Topology:
    """The topology from the config's ranks_per_node or torchrun's variables (they must agree)."""
    env = os.environ if env is None else env
    launched = env.get("LOCAL_WORLD_SIZE")
    if ranks_per_node is not None and launched is not None and int(launched) != ranks_per_node and \
            int(launched) != world_size:  # (one launcher of every rank: a test's layout, taken as given)
        raise ConfigError(f"zeroshard.ranks_per_node {ranks_per_node} but torchrun started "
                          f"{launched} ranks on this node (LOCAL_WORLD_SIZE); remove ranks_per_node "
                          f"(torchrun's is used) or make them agree")
    per_node = ranks_per_node or (int(launched) if launched is not None else world_size)
    if world_size % per_node:
        raise ConfigError(f"{per_node} ranks per node do not divide the {world_size} ranks: zeroshard "
                          f"takes nodes of equal size; fix zeroshard.ranks_per_node or the launch")
    node = env.get("GROUP_RANK")
    if ranks_per_node is None and node is not None and int(node) != rank // per_node:
        raise ConfigError(f"rank {rank} runs on node {node} (GROUP_RANK), but nodes of {per_node} "
                          f"consecutive ranks would put it on node {rank // per_node}: launch every "
                          f"node with the same --nproc-per-node")
    return Topology(per_node)


def check_mics(shard_size: int, topology: Topology, world_size: int) -> None:
    """A MiCS shard group is a block of consecutive ranks within one node, or of whole nodes."""
    if world_size % shard_size:
        raise ConfigError(f"zero_optimization.mics_shard_size {shard_size} does not divide the {world_size} "
                          f"ranks: each shard group holds one whole copy of the model states; choose a "
                          f"divisor of {world_size}")
    per_node = topology.ranks_per_node
    if per_node % shard_size and shard_size % per_node:
        raise ConfigError(f"zero_optimization.mics_shard_size {shard_size} does not fit nodes of {per_node} "
                          f"ranks: a shard group must lie within one node or span whole nodes; choose a "
                          f"divisor or a multiple of {per_node}")
