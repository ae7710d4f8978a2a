"""A child process of a job dies with the process that started it (Linux ``PR_SET_PDEATHSIG``).

Whoever starts a worker or a service (the launcher, the fork server, rank 0 under torchrun) puts its
own pid in ``$PRAGUE_LAUNCHER_PID``; the child calls :func:`set_parent_death_signal` first thing, so a
launcher killed with SIGKILL leaves nothing behind. No torch here: the services import it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from prague import jobenv

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when the process named by ``$PRAGUE_LAUNCHER_PID`` (its parent)
    dies; exit at once if it is already gone. A no-op without the variable or off Linux."""
    launcher = jobenv.current().launcher_pid
    if launcher is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # the parent died before prctl took effect
        os._exit(1)
