"""What compressed averaging sends, counted without torch: ``--compress``'s choices and their byte counts.

The simulator charges a group's averaging by these counts and the runtime reports them
(:mod:`prague.comm.compress` holds the codes themselves).
"""

from __future__ import annotations

from prague.errors import ConfigError

#: ``--compress``'s choices: full precision (a ring all-reduce of the values), or 8-bit codes.
CODECS = ("none", "int8")
#: Values per block sharing one offset and step (two float32 each): 3% of the codes' bytes.
BLOCK = 256
META_PER_BLOCK = 2  # float32 offset and step


def check_codec(codec: str) -> str:
    """``codec`` if it is one of :data:`CODECS`; ConfigError naming them otherwise."""
    if codec not in CODECS:
        raise ConfigError(f"--compress must be one of {', '.join(CODECS)}, got {codec!r}")
    return codec


def blocks(numel: int, block: int = BLOCK) -> int:
    """Blocks of ``block`` values that ``numel`` values fill (the last one may be partial)."""
    return -(-numel // block)


def payload_bytes(numel: int, codec: str, element_size: int = 4, block: int = BLOCK) -> int:
    """Bytes of one member's message for ``numel`` values: the values themselves for ``none``; for
    ``int8`` one byte per value plus the blocks' float32 offsets and steps."""
    check_codec(codec)
    if codec == "none":
        return numel * element_size
    return numel + 4 * META_PER_BLOCK * blocks(numel, block)


def member_send_bytes(numel: int, members: int, codec: str, element_size: int = 4) -> float:
    """Bytes each member sends for one group average of ``numel`` values over ``members`` members: a
    ring all-reduce's ``2 (p - 1) / p`` of the values uncompressed, a ring all-gather's ``(p - 1)``
    payloads compressed (0 for a group of one)."""
    if members <= 1:
        return 0.0
    if codec == "none":
        return 2.0 * (members - 1) / members * numel * element_size
    return float((members - 1) * payload_bytes(numel, codec, element_size))
