"""Which transport P-Reduce uses (:mod:`prague.comm.preduce`): pure, so that option parsing and
``prague --help`` need no torch."""

from __future__ import annotations

from prague.errors import ConfigError

TRANSPORTS = ("auto", "groups", "world")


def pick_transport(transport: str, backend: str) -> str:
    """``groups`` or ``world`` for ``transport`` (``auto``: world on NCCL, groups otherwise); see
    :mod:`prague.comm.preduce`."""
    if transport not in TRANSPORTS:
        raise ConfigError(f"unknown P-Reduce transport {transport!r}; valid choices: {', '.join(TRANSPORTS)}")
    if transport == "auto":
        return "world" if backend == "nccl" else "groups"
    return transport
