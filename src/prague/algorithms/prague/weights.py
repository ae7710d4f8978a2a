"""Averaging weighted by the work each member did since its last average (``--average-by samples``).

Under persistent heterogeneity a slow worker's values carry fewer updates than a fast one's; an equal
average pulls the fast worker back toward them. Weighted by the samples each member processed since its
own last average, the group's mean leans toward the members that did more since they last mixed
(Prague's P-Reduce is the equal mean). Every ``prague`` worker takes a batch of the loop's size each
step, so the samples since a worker's last average are its steps since then times that batch, and the
weight is the step count.

The rule is :class:`SinceAverage`, one per worker, the same for the runtime (on the averaging thread) and
the simulator (its averaging chain): a request after step k weighs ``k - k_last`` (at least 1), where
``k_last`` is the step after which the worker's latest average that did average was asked; a group of
one, or one that nobody was left to average with, does not reset it. The group's values become
``sum_j w_j x_j / sum_j w_j``; unlike the equal mean this moves the workers' mean (toward the busier).
"""

from __future__ import annotations

#: ``--average-by``'s choices.
AVERAGE_BY = ("equal", "samples")


class SinceAverage:
    """One worker's steps since its last average: the weight of its next group (see the module docstring).
    Called by whoever runs the worker's groups, in order: :meth:`weight` when a group starts, then
    :meth:`averaged` once it has averaged."""

    def __init__(self) -> None:
        self._last = -1  # the step after which the latest average that averaged was asked

    def weight(self, step: int) -> float:
        """The weight of a group asked for after ``step``: the steps since the last average, at least 1."""
        return float(max(1, step - self._last))

    def averaged(self, step: int) -> None:
        """The group asked for after ``step`` has averaged."""
        self._last = max(self._last, step)
