"""ZeRO++'s collectives over a Comm (zeropp.py says what each option does and why): hpZ's gather
from the secondary shards inside a node, qwZ's int8 gather, qgZ's hierarchical int4 reduce-scatter.
Each moves a buffer whole and synchronously, through the Comm's counted collectives."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .quantize import dequantize, quantize
from .zeropp import Group, ZeroPP

if TYPE_CHECKING:
    from .collectives import Comm


# ---- hpZ ------------------------------------------------------------------------------------------
def secondary_range(pp: ZeroPP, numel: int) -> tuple[int, int]:
    """This rank's slice of a gathered buffer of `numel` (padded to N, so to k) elements."""
    part = numel // pp.secondary.size
    return pp.secondary.rank * part, (pp.secondary.rank + 1) * part


def gather_secondary(comm: Comm, full: torch.Tensor, secondary: torch.Tensor) -> None:
    """full = every secondary shard of the partition, gathered inside the node."""
    comm.all_gather_over(comm.zeropp.secondary, full, secondary)


# ---- qwZ ------------------------------------------------------------------------------------------
def gather_quantized(comm: Comm, full: torch.Tensor, shard: torch.Tensor) -> None:
    """full = every rank's shard, sent as int8 blocks and decoded into full's dtype (own shard too)."""
    pp, n, size = comm.zeropp, comm.world_size, shard.numel()
    payload = quantize(shard, pp.weight_bits, pp.block, refuse_nonfinite=False)
    received = torch.empty(n * payload.numel(), dtype=torch.uint8, device=full.device)
    comm.staged(received)
    comm.all_gather(received, payload)
    for r, part in enumerate(received.view(n, -1)):
        full[r * size:(r + 1) * size].copy_(dequantize(part, size, pp.weight_bits, pp.block, full.dtype))


# ---- qgZ ------------------------------------------------------------------------------------------
def _exchange(comm: Comm, group: Group, parts: list[torch.Tensor], bits: int, block: int) -> torch.Tensor:
    """Send parts[i] to the group's rank i as quantized blocks; the fp32 sum of what arrives."""
    numel = parts[0].numel()
    send = torch.cat([quantize(p.reshape(-1), bits, block, refuse_nonfinite=False) for p in parts])
    received = torch.empty_like(send)
    comm.staged(send)
    comm.all_to_all_over(group, received, send)
    size = send.numel() // len(parts)
    total = torch.zeros(numel, dtype=torch.float32, device=send.device)
    for i in range(len(parts)):
        total += dequantize(received[i * size:(i + 1) * size], numel, bits, block)
    return total


def reduce_scatter_quantized(comm: Comm, out: torch.Tensor, full: torch.Tensor, accumulate: bool) -> None:
    """out (+)= this rank's shard of the mean over ranks of `full`, reduced through quantized blocks,
    summed in fp32: inside the node first, then across nodes (one row per node)."""
    pp, n = comm.zeropp, comm.world_size
    per_node, nodes = pp.node.size, pp.cross.size
    rows = full.view(nodes, per_node, -1)  # row (m, l): the shard of rank m * per_node + l
    if per_node > 1:  # peer l gets its column of every node's rows, summed over this node
        parts = [rows[:, peer] for peer in range(per_node)]
        partial = _exchange(comm, pp.node, parts, pp.grad_bits, pp.block)
    else:
        partial = rows[:, 0].float().reshape(-1)
    partial = partial.view(nodes, -1)
    if nodes > 1:  # node m gets its row, summed over the nodes
        total = _exchange(comm, pp.cross, [partial[m] for m in range(nodes)], pp.grad_bits, pp.block)
    else:
        total = partial[0]
    total.div_(n)
    out.add_(total) if accumulate else out.copy_(total)
