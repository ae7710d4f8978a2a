"""Large simulations on transparent huge pages (``prague simulate --huge-pages``).

At tens of thousands of workers a simulation holds gigabytes of small Python objects (every worker's
processes, logs, its entries in the Group Generator's tables), and each event touches a few of them,
scattered over that memory: on 4 KiB pages nearly every touch misses the processor's address cache
(TLB) as well as its data caches. CPython's allocator takes its memory in arenas of its own, which the
kernel backs with huge pages only where they are on for every process (``always``); glibc's ``malloc``
asks for them on its heap with the tunable ``glibc.malloc.hugetlb=1`` (glibc 2.35 and later), which the
kernel grants in its usual ``madvise`` mode. The allocator is chosen when the interpreter starts, so
``prague simulate`` starts itself again, once, with ``PYTHONMALLOC=malloc`` and that tunable
(:func:`restart`), when ``--huge-pages`` says so: ``auto`` (the default) from :data:`AUTO_FROM_WORKERS`
workers up, where the machine allows it. glibc's ``malloc`` is slower than CPython's own for small
objects, which is why a smaller job keeps the default. What ran is in each record (``sim.allocator``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from prague.errors import ConfigError
from prague.jobenv import variables

#: ``--huge-pages auto`` turns them on from this many simulated workers. Measured (docs/simulator.md, compiled, in
#: the engine): 19% sooner at 65,536 workers, 2% at 16,384 (within the machine's spread), none at 1,024 and 4,096,
#: where glibc's slower small allocations cancel the gain.
AUTO_FROM_WORKERS = 32768
MODES = ("auto", "on", "off")
TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def unsupported(thp_mode: Path = THP_MODE) -> str | None:
    """Why this machine cannot put the simulator's heap on huge pages, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"transparent huge pages are Linux's; this is {sys.platform}"
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""
    name, _, version = libc.partition(" ")
    parts = version.split(".")
    if name != "glibc" or len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        return f"the C library is {libc or 'not glibc'}; huge pages for malloc need glibc 2.35 or later"
    if (int(parts[0]), int(parts[1])) < (2, 35):
        return f"this is {libc}; huge pages for malloc (glibc.malloc.hugetlb) need glibc 2.35 or later"
    try:
        mode = thp_mode.read_text()
    except OSError:
        return f"{thp_mode} cannot be read: this kernel has no transparent huge pages"
    if "[never]" in mode:
        return f"transparent huge pages are off ({thp_mode}: {mode.strip()})"
    return None


def active(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs on glibc's malloc with huge pages (as :func:`restart` starts it)."""
    env = variables() if env is None else env
    return env.get("PYTHONMALLOC") == "malloc" and TUNABLE in env.get("GLIBC_TUNABLES", "").split(":")


def allocator(env: Mapping[str, str] | None = None) -> str:
    """What allocates this process's objects, for the records."""
    env = variables() if env is None else env
    if active(env):
        return "glibc malloc on transparent huge pages"
    return env.get("PYTHONMALLOC") or "pymalloc"


def wanted(mode: str, nproc: int, reason: str | None) -> bool:
    """Whether a simulation of ``nproc`` workers runs on huge pages under ``--huge-pages mode``, on a machine
    that cannot (``reason``) or can (None). ConfigError for ``on`` where it cannot, and for an unknown mode."""
    if mode not in MODES:
        raise ConfigError(f"--huge-pages {mode!r}: use one of {', '.join(MODES)}")
    if mode == "off":
        return False
    if mode == "on" and reason is not None:
        raise ConfigError(f"--huge-pages on: {reason}; run with --huge-pages off (or auto, which then stays off)")
    return reason is None and (mode == "on" or nproc >= AUTO_FROM_WORKERS)


def environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with glibc's malloc on huge pages: ``PYTHONMALLOC=malloc`` and the tunable added to the others."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")]
    return {**env, "PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": ":".join([*tunables, TUNABLE])}


def restart(mode: str, nproc: int) -> None:
    """Start this command again in place (``os.execve``, the same interpreter and arguments) on huge pages when
    :func:`wanted` says so and the process does not run on them yet; otherwise return. Only the ``prague``
    command itself calls this (a call from inside another program would replace that program)."""
    if active() or not wanted(mode, nproc, unsupported()):
        return
    argv = list(getattr(sys, "orig_argv", [])) or [sys.executable, *sys.argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, environment(variables()))
