"""Group Generator policies (pure) and their registry.

The policies decide who averages with whom; they never touch the network. The gRPC service that runs
one policy for a whole job lives in :mod:`prague.groups.service` and its client in
:mod:`prague.groups.client` (imported explicitly: they pull in grpc).
"""

from __future__ import annotations

from prague.errors import unknown_choice
from prague.groups.api import (
    Answer,
    Formation,
    GeneratorConfig,
    Group,
    GroupPolicy,
    Observer,
    Topology,
)
from prague.groups.base import BufferedPolicy, PolicyBase
from prague.groups.random_gen import RandomGenerator
from prague.groups.ready import ReadyGenerator
from prague.groups.smart import SmartGenerator, divide
from prague.groups.static import StaticGenerator, static_group, static_schedule

GENERATORS: dict[str, type[PolicyBase]] = {
    "static": StaticGenerator,
    "smart": SmartGenerator,
    "random": RandomGenerator,
    "ready": ReadyGenerator,
}


def make_generator(name: str, config: GeneratorConfig, *, observer: Observer | None = None) -> GroupPolicy:
    """Build the policy registered as ``name``; an unknown name raises ConfigError listing the valid ones."""
    try:
        cls = GENERATORS[name]
    except (KeyError, TypeError):
        raise unknown_choice("group generator", name, GENERATORS) from None
    return cls(config, observer=observer)


__all__ = [
    "GENERATORS",
    "Answer",
    "BufferedPolicy",
    "Formation",
    "GeneratorConfig",
    "Group",
    "GroupPolicy",
    "Observer",
    "PolicyBase",
    "RandomGenerator",
    "ReadyGenerator",
    "SmartGenerator",
    "StaticGenerator",
    "Topology",
    "divide",
    "make_generator",
    "static_group",
    "static_schedule",
]
