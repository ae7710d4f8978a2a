"""Name -> method class. Adding a method is one import and one line here."""

from __future__ import annotations

from prague.algorithms.adpsgd import ADPSGD
from prague.algorithms.allreduce import AllReduce
from prague.algorithms.api import Algorithm
from prague.algorithms.dssync import DSSync
from prague.algorithms.prague import Prague
from prague.algorithms.ps import ParameterServer
from prague.algorithms.ps_eager import EagerParameterServer
from prague.errors import ConfigError, unknown_choice

ALGORITHMS: dict[str, type[Algorithm]] = {
    AllReduce.name: AllReduce,
    Prague.name: Prague,
    DSSync.name: DSSync,
    ParameterServer.name: ParameterServer,
    EagerParameterServer.name: EagerParameterServer,
    ADPSGD.name: ADPSGD,
}


def get_algorithm(name: str) -> type[Algorithm]:
    """The class registered as ``name``; raises ConfigError listing the valid names."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise unknown_choice("algorithm", name, ALGORITHMS) from None


def split_variant(spec: str) -> tuple[str, str | None]:
    """``"prague:smart"`` -> ``("prague", "smart")``; validates the name and that the method has variants."""
    name, _, variant = spec.partition(":")
    cls = get_algorithm(name)
    if variant and cls.variant_field is None:
        raise ConfigError(f"algorithm {name!r} has no variants, got {spec!r}; use plain {name!r}")
    return name, (variant or None)
