"""A rank's collective history, one Fingerprint per call, and the words of a divergence diagnosis:
from the ranks' histories (gathered by watch.py), the first call at which they differ and the
likely cause, in the user's terms (which API call to make on every rank, and how)."""
from __future__ import annotations

from dataclasses import astuple, dataclass


@dataclass(frozen=True)
class Fingerprint:
    """One collective as this rank issued it; `seq` numbers the engine's collectives from 0."""

    seq: int
    kind: str
    label: str
    bucket: int
    numel: int
    dtype: str
    step: int
    micro: int
    phase: str
    backwards: int

    def same_call(self, other: "Fingerprint | None") -> bool:
        return other is not None and astuple(self)[1:] == astuple(other)[1:]

    def describe(self) -> str:
        if self.kind == "gate":
            return f"entered {self.label} (collective) at step {self.step}, micro-step {self.micro}"
        what = f"{self.label}, bucket {self.bucket}" if self.label else "engine"
        return (f"{self.kind}({what}, {self.numel} x {self.dtype}) in {self.phase} of step {self.step}, "
                f"micro-step {self.micro}")


@dataclass
class Clock:
    """Where the engine is, as its API calls say (the same on every rank unless they diverge)."""

    step: int = 0
    micro: int = 0
    phase: str = "set-up"
    backwards: int = 0


_HOW = {"full_state_dict()": " (full_state_dict(rank0_only=True) keeps the weights on rank 0 alone)",
        "gathered_parameters()": " (inside the block: a forward there issues no collective, so rank 0 may "
                                 "generate alone)"}


def explain(histories: dict[int, tuple[list[Fingerprint], Clock]], world_size: int) -> str:
    """The first collective call at which the ranks' histories differ, and the likely cause."""
    silent = sorted(set(range(world_size)) - set(histories))
    note = (f" Ranks {silent} did not answer (exited, killed, or stuck outside zeroshard: in a torch."
            f"distributed call such as dist.barrier() while this rank ran a forward or an evaluation "
            f"alone)." if silent else "")
    by_seq = {r: {fp.seq: fp for fp in recent} for r, (recent, _) in histories.items()}
    start = max((min(s) for s in by_seq.values() if s), default=0)
    end = max((max(s) + 1 for s in by_seq.values() if s), default=0)
    for seq in range(start, end):
        calls = {r: s.get(seq) for r, s in by_seq.items()}
        first = next(iter(calls.values()))
        if all(fp is not None and fp.same_call(first) for fp in calls.values()):
            continue
        lines = [f"  rank {r}: " + (fp.describe() if fp else f"nothing (its last call was #{seq - 1}; "
                                    f"now in {histories[r][1].phase} of step {histories[r][1].step})")
                 for r, fp in sorted(calls.items())]
        return (f"collectives diverged at call #{seq}:\n" + "\n".join(lines) + "\n" +
                likely_cause(calls, {r: c for r, (_, c) in histories.items()}) + note)
    clocks = {r: (c.phase, c.step, c.micro, c.backwards) for r, (_, c) in histories.items()}
    return f"the answering ranks issued the same collectives; their clocks: {clocks}.{note}"


# The gate step() passes on a rank that wrote parameters in place since the engine's last write: every
# rank makes the same write (each loads the same state_dict), or the ranks would train different models.
WRITE_GATE = "step() after an in-place write to the parameters"


def likely_cause(calls: dict[int, "Fingerprint | None"], clocks: dict[int, Clock]) -> str:
    """A guess from where each rank stood at the first difference (phase, API calls made so far)."""
    seen = {r: fp or clocks[r] for r, fp in calls.items()}
    tally = "; ".join(f"rank {r} in {c.phase}, after {c.backwards} backward() and {c.micro} step() calls"
                      for r, c in sorted(clocks.items()))
    entered = sorted({fp.label for fp in calls.values() if fp is not None and fp.kind == "gate"})
    if WRITE_GATE in entered:
        return ("Likely cause: parameters written in place on some ranks only (engine.module.load_state_dict"
                "(), p.copy_() or nn.init under `if rank == 0:`): the ranks would train different models. "
                "Make the write on every rank, or inside `with engine.gathered_parameters(modifier_rank=0):` "
                "(that rank's values go to every rank), or before zeroshard.initialize(); a change on one "
                "rank for a while (an EMA swap to evaluate) belongs inside `with engine.gathered_"
                "parameters():`, which undoes it.")
    if entered:
        return (f"Likely cause: {' and '.join(entered)} called on some ranks only ({tally}). It is "
                f"collective: call it on every rank, and put under `if rank == 0:` only what uses its "
                f"result" + "".join(_HOW[c] for c in entered if c in _HOW) + ".")
    phases = {r: s.phase for r, s in seen.items()}
    if len(set(phases.values())) > 1:
        where = ", ".join(f"rank {r} in {p}" for r, p in sorted(phases.items()))
        return (f"Likely cause: the ranks are in different calls ({where}): a step() on some ranks only, "
                f"a different number of backward() calls per step ({tally}), or a forward (an "
                f"evaluation, a generate()) run on some ranks only.")
    if len({s.backwards for s in seen.values()}) > 1 or len({s.micro for s in seen.values()}) > 1:
        return f"Likely cause: a different number of backward() or step() calls ({tally})."
    kinds = {fp.kind for fp in calls.values() if fp is not None}
    if "all_gather" in kinds and len(kinds) > 1 and all(s.phase == "forward" for s in seen.values()):
        return ("Likely cause: a forward run on some ranks only (an evaluation on rank 0 alone, or ranks "
                "given different numbers of evaluation batches) while the others went on: at stage 3 "
                "every forward gathers, so every rank must run as many. Give every rank the same number "
                "of batches, or enter `with engine.gathered_parameters():` on every rank and run the "
                "forward on rank 0 alone inside it.")
    if len({fp.label for fp in calls.values() if fp is not None}) > 1:
        return ("Likely cause: a unit run on some ranks only (a data-dependent branch in forward that skips "
                "or repeats a block). At stage 3 every rank must run the same units; keep the branch "
                "identical on all ranks or move it outside the sharded units.")
    if "all_gather" in kinds and len(kinds) > 1 and all(s.phase == "backward" for s in seen.values()):
        return ("Likely cause: a unit whose output reaches the loss on some ranks only (an auxiliary head, "
                "a loss term added when the batch has its labels): at stage 3 a unit is gathered for "
                "backward where its output gets a gradient. Let it reach the loss on every rank, e.g. "
                "loss = loss + 0.0 * aux.sum() where the term is absent.")
    return "Likely cause: ranks built different models or configs (same call, different size or dtype)."
