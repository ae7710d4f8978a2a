"""The one decision of ``localsgd`` and ``diloco``, pure: which steps end a round.

Run by every real worker (:mod:`.runtime`, :mod:`prague.algorithms.diloco.runtime`) and by the simulator
(:mod:`.sim`, :mod:`prague.algorithms.diloco.sim`), so both average after the same steps.
"""

from __future__ import annotations


def ends_round(steps_in_round: int, sync_every_steps: int) -> bool:
    """Whether a worker that has taken ``steps_in_round`` local steps since the last average (this one
    included) averages now: after every ``sync_every_steps`` steps, the same steps on every rank."""
    return steps_in_round >= sync_every_steps
