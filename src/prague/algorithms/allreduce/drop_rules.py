"""``allreduce:drop``'s decision, pure: which ranks leave the job.

What an operator does by hand with a persistently slow worker: watch the step times for a while, then
restart the job without it. Every ``--drop-window`` steps each rank's median compute time over the window
is shared; a rank above ``--drop-factor`` times the median of those medians is slow in that window, and a
rank slow in :data:`WINDOWS` windows in a row leaves. A slowdown shorter than that (a transient straggler)
never removes anyone. Run by every real worker (:mod:`.drop`, on the same gathered medians, so every rank
decides alike) and by the simulator (:mod:`.drop_sim`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

#: Windows in a row a rank must be slow in before it leaves.
WINDOWS = 2


def slow_ranks(medians: Mapping[int, float], factor: float) -> set[int]:
    """The ranks whose median compute time is above ``factor`` times the median of all ranks' medians."""
    if not medians:
        return set()
    reference = statistics.median(medians.values())
    return {rank for rank, m in medians.items() if m > factor * reference}


class DropWatch:
    """The ranks slow window after window; :meth:`observe` says who leaves."""

    def __init__(self, factor: float, windows: int = WINDOWS) -> None:
        self.factor, self.windows = factor, windows
        self.streak: dict[int, int] = {}

    def observe(self, medians: Mapping[int, float]) -> tuple[int, ...]:
        """One window's medians (rank -> seconds, the ranks still in the job); the ranks that leave now,
        sorted. Never more than the smaller half of the ranks: the median rank always stays."""
        slow = slow_ranks(medians, self.factor)
        self.streak = {rank: self.streak.get(rank, 0) + 1 if rank in slow else 0 for rank in medians}
        leaving = sorted(rank for rank, n in self.streak.items() if n >= self.windows)
        if len(leaving) > (len(medians) - 1) // 2:
            return ()
        for rank in leaving:
            del self.streak[rank]
        return tuple(leaving)
