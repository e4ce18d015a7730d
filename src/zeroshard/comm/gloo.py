"""gloo's reduce-scatter, done as an all-to-all plus a local sum.

Why: gloo's reduce_scatter is slower than its all_to_all (benchmarks/gloo_collectives.py times both) and
ignores wait()'s timeout, which the divergence diagnosis needs. The all-to-all sends each rank its
slice of every rank's buffer, the same (N-1)/N of the buffer per rank a ring reduce-scatter sends;
the first wait() sums the N received slices, in rank order, into the output. NCCL keeps its own
reduce_scatter_tensor (collectives.py decides).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class SumOnArrival:
    """A reduce-scatter done as an all-to-all plus a local sum, behind dist.Work's interface (see
    the module notes)."""

    def __init__(self, work: dist.Work, received: torch.Tensor, output: torch.Tensor, ranks: int) -> None:
        self.work, self.received, self.output, self.ranks = work, received, output, ranks

    def wait(self, timeout=None) -> bool:
        if self.work is not None:
            if timeout is None:
                self.work.wait()
            else:
                self.work.wait(timeout=timeout)
            rows = self.received.view(self.ranks, -1)
            if self.ranks == 2:  # one addition, the same bits as the sum, at half its cost here
                torch.add(rows[0], rows[1], out=self.output)
            else:
                torch.sum(rows, dim=0, out=self.output)
            self.work = self.received = None  # the receive buffer is freed as soon as it is summed
        return True

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    @property
    def staging_bytes(self) -> int:
        """The receive buffer, while it lives (memory_stats counts it as a temporary)."""
        return 0 if self.received is None else self.received.numel() * self.received.element_size()


def all_to_all_reduce_scatter(output: torch.Tensor, full: torch.Tensor, group, ranks: int,
                               async_op: bool) -> SumOnArrival | None:
    received = torch.empty_like(full)
    work = SumOnArrival(dist.all_to_all_single(received, full, group=group, async_op=True), received,
                         output, ranks)
    if async_op:
        return work
    work.wait()
    return None
