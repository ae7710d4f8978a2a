"""File output that never leaves a half-written file (or a half-written line) behind."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename.

    Readers see either the old file or the complete new one, never a partial write. The file gets the
    permissions a plain ``open(path, "wb")`` would give it (an existing file's own, else ``0o666`` less
    the umask), not the temporary file's private ``0o600``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask, read where Linux shows it (setting it to read it back would race with threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def atomic_write_text(path: Path, text: str) -> None:
    """Atomically write UTF-8 text (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


class JsonLines:
    """A file of JSON objects, one per line, written by one owner as it goes (logs and traces).

    Each object goes out in one ``write`` of the whole line on a descriptor opened with ``O_APPEND`` and
    no user-space buffer: a line is in the file as soon as :meth:`write` returns, lines written from
    several threads never interleave, and a process killed at any moment leaves only whole lines
    behind. Opening truncates the file (``append=False``) or adds to it. Not for many writers in
    different processes to one file: give each its own.
    """

    def __init__(self, path: Path, *, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        self._fd: int | None = os.open(self.path, flags, 0o644)

    def write(self, obj: Any) -> None:
        """Append ``obj`` as one compact JSON line."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode("utf-8")
        while data:  # a regular file takes it whole unless the disk is full; then the next write raises
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        """Close the file; a second call does nothing."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> JsonLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_json_lines(path: Path) -> list[Any]:
    """Every object of a file :class:`JsonLines` wrote, in order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
