"""The random Group Generator: the naive baseline of Prague/Ripples (ASPLOS 2020, arXiv 1909.08029).

When worker i asks and its FIFO is empty, the GG draws one group around i: i plus S - 1 workers picked
uniformly among those that have not finished. No division, no threshold. The group goes through the same
group buffer as the smart policy (one global sequence, appended to every member's FIFO), so it cannot
deadlock; but a picked worker may already be committed to earlier groups it has not reached yet, and
the new group then waits for it. Those groups are counted as ``conflicts`` in :meth:`stats`: the cost
that the smart policy's divisions avoid.
"""

from __future__ import annotations

from prague.groups.api import GeneratorConfig, Observer
from prague.groups.base import BufferedPolicy


class RandomGenerator(BufferedPolicy):
    """One uniformly random group of S around each requester whose FIFO is empty."""

    def __init__(self, config: GeneratorConfig, *, observer: Observer | None = None) -> None:
        super().__init__(config, observer=observer)

    def _fill(self, requester: int) -> None:
        # Draw S from all active workers and drop the requester (or, if absent, the last one drawn):
        # a uniform choice of S - 1 partners in O(S), not O(nproc).
        pool = self.active()
        size = min(self.config.group_size, len(pool))
        partners = [w for w in self.rng.sample(pool, size) if w != requester][: size - 1]
        self._commit([requester, *partners], requester, "random")
