"""Straggler report: every N steps the ranks compare their recent step times; slow ranks are named.

In synchronous training the slowest rank sets everyone's pace, so one bad host (thermal throttling, a
noisy neighbour, a slow disk) slows the whole job. Each rank's own step time still shows it: the fast
ranks spend their wait inside a collective, but only after their own work, and the slow rank's work
alone takes longer. Comparing the per-rank means over the last N steps names the culprit.
"""

from __future__ import annotations

import socket
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optimus.parallel.collectives import all_gather_single


@dataclass
class Straggler:
    rank: int
    host: str
    step_time_s: float  # mean over the last `every` steps
    median_s: float  # the ranks' median step time over the same steps

    def as_record(self) -> dict:
        return {"rank": self.rank, "host": self.host, "step_time_s": self.step_time_s, "median_s": self.median_s}


def find_stragglers(step_times: list[float], hosts: list[str], factor: float) -> list[Straggler]:
    """Ranks whose step time exceeds `factor` x the median of all ranks' step times.

    The lower median: with two ranks it is the faster one, so the slower one can be reported at all.
    """
    median = statistics.median_low(step_times)
    return [Straggler(rank, hosts[rank], seconds, median)
            for rank, seconds in enumerate(step_times) if seconds > factor * median]


class StragglerMonitor:
    """Times this rank's steps; every `every` steps all ranks share their mean and slow ones are reported.

    Construct it on every rank of the default process group (it gathers the host names once);
    `check(step)` is collective at every `every`-th step and must be called on every rank.
    """

    def __init__(self, every: int, factor: float, device: torch.device):
        self.every, self.factor, self.device = every, factor, device
        self.world_size = dist.get_world_size()
        self.hosts: list[str] = [""] * self.world_size
        dist.all_gather_object(self.hosts, socket.gethostname())
        self._times: list[float] = []

    @contextmanager
    def timed_step(self):
        """Time the enclosed step on this rank (perf_counter; the loss's .item() has synced the device)."""
        start = time.perf_counter()
        yield
        self._times.append(time.perf_counter() - start)

    def check(self, step: int) -> list[Straggler] | None:
        """At every `every`-th step: the ranks slower than factor x median (on every rank), else None.

        The trainer puts them into that step's metrics; the console prints one line naming them.
        """
        if step % self.every or not self._times:
            return None
        mine = torch.tensor([sum(self._times) / len(self._times)], dtype=torch.float32, device=self.device)
        self._times.clear()
        gathered = torch.empty(self.world_size, dtype=torch.float32, device=self.device)
        all_gather_single(gathered, mine)
        return find_stragglers(gathered.tolist(), self.hosts, self.factor)
