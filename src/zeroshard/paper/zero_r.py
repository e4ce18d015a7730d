"""ZeRO-R's activation-checkpoint model and the paper's configurations C1-C5 (Table III).

With one checkpoint per transformer block, a rank keeps each block's input: batch x seq x hidden
values per block, in the activation dtype. Model parallelism replicates that input on all MP
ranks; P_a partitions it (1/MP each), P_a+cpu moves the partitions to host memory. The paper's
100B example (125 layers, hidden 8192, MP 16, 16 sequences of 1024 per GPU) gives ~33 GB of
checkpoints per GPU, ~2 GB with P_a, ~0 on the device with P_a+cpu.
"""
from __future__ import annotations

from dataclasses import dataclass

from .estimate import GB, model_states

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Configuration:
    """A row of Table III: the ZeRO-DP stage and which ZeRO-R activation options are on."""

    name: str
    stage: int
    partition: bool   # P_a
    cpu: bool         # P_a+cpu


CONFIGURATIONS = (Configuration("C1", 1, False, False), Configuration("C2", 1, True, False),
                  Configuration("C3", 2, False, False), Configuration("C4", 2, True, False),
                  Configuration("C5", 2, True, True))


def checkpoint_bytes(layers: int, hidden: int, batch: int, seq: int, precision: str, mp: int,
                     partition: bool, cpu: bool) -> tuple[float, float]:
    """(device, host) bytes of one rank's activation checkpoints: one block input per layer."""
    kept = layers * batch * seq * hidden * ACTIVATION_BYTES[precision] / (mp if partition else 1)
    return (0.0, kept) if cpu else (kept, 0.0)


def configurations_text(psi: float, layers: int, hidden: int, nproc: int, mp: int, batch: int, seq: int,
                        precision: str = "bf16") -> str:
    """C1-C5 per rank: model states, activation checkpoints on the device and on the host (GB)."""
    lines = [f"Ψ = {psi:,.0f} parameters, {layers} layers of hidden {hidden}, {nproc} GPUs (DP {nproc // mp} "
             f"x MP {mp}), {batch} x {seq} tokens per GPU, {precision}; GB per rank",
             f"{'config':<7} {'ZeRO':<15} {'model states':>13} {'ckpt device':>12} {'ckpt host':>10} "
             f"{'device total':>13}"]
    for c in CONFIGURATIONS:
        states = model_states(psi, nproc, c.stage, precision, mp=mp).total
        device, host = checkpoint_bytes(layers, hidden, batch, seq, precision, mp, c.partition, c.cpu)
        zero = ("P_os" if c.stage == 1 else "P_os+g") + ("+P_a" if c.partition else "")
        zero += "+cpu" if c.cpu else ""
        lines.append(f"{c.name:<7} {zero:<15} {states / GB:>13.2f} {device / GB:>12.2f} {host / GB:>10.2f} "
                     f"{(states + device) / GB:>13.2f}")
    return "\n".join(lines)
