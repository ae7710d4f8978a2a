"""The interface of a simulated method, and how its options are read.

A simulated method mirrors one runtime method (:mod:`prague.algorithms`) in simulated time: one process
per worker on the world's engine, each iteration ``compute -> the method's synchronisation -> record``,
with the time split into compute, communication and waiting the way the runtime method reports it. The
decisions come from the runtime's own code (group generator policies, the DS-Sync shuffle, the
scenario); only the passage of time is modelled here.

Options are the runtime method's own ``Options`` dataclass (same names, same validation, same
defaults), read from the same flags; a method the runtime has not registered yet falls back to the
``Options`` its simulated class declares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from prague.algorithms.registry import ALGORITHMS
from prague.sim.engine import Process
from prague.sim.world import World


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """Options of a method that has none."""


class SimMethod:
    """Base class: ``start`` spawns :meth:`worker` for every rank; subclasses write :meth:`worker`."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions  # used only when the runtime has no method of this name
    variant_field: ClassVar[str | None] = None

    def __init__(self, world: World, options: Any) -> None:
        self.world = world
        self.options = options

    @classmethod
    def runtime_class(cls) -> Any:
        return ALGORITHMS.get(cls.name)

    @classmethod
    def options_type(cls) -> type:
        runtime = cls.runtime_class()
        return runtime.Options if runtime is not None else cls.Options

    @classmethod
    def variant_name(cls) -> str | None:
        runtime = cls.runtime_class()
        return runtime.variant_field if runtime is not None else cls.variant_field

    @classmethod
    def options_from(cls, values: Mapping[str, Any], variant: str | None = None) -> Any:
        """The method's options from ``values`` (fields it does not declare are ignored), ``variant`` set."""
        options_type = cls.options_type()
        names = {f.name for f in dataclasses.fields(options_type)}
        kwargs = {k: v for k, v in values.items() if k in names and v is not None}
        field = cls.variant_name()
        if variant is not None and field is not None:
            kwargs[field] = variant
        return options_type(**kwargs)

    @property
    def variant(self) -> str | None:
        field = self.variant_name()
        return None if field is None else str(getattr(self.options, field))

    def start(self) -> None:
        for w in range(self.world.n):
            self.world.engine.process(self.worker(w))

    def worker(self, w: int) -> Process:
        raise NotImplementedError

    def check_done(self) -> None:
        """Raise if the run ended with work left (a deadlock in the simulated method)."""
        world = self.world
        short = [w for w in range(world.n) if len(world.end_s[w]) != world.steps]
        if short or world.open_meetings:
            raise RuntimeError(
                f"simulated {self.name} stopped early: workers {short[:8]} did not finish all "
                f"{world.steps} steps, {world.open_meetings} groups still wait for members"
            )

    def stats(self) -> dict[str, Any]:
        return {}
