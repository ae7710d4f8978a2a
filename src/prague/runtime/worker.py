"""Entry point of one worker process: ``prague worker`` (started by ``prague run`` or by torchrun)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from prague import jobenv
from prague.errors import EXIT_USAGE, ConfigError
from prague.runtime.context import DistContext, init, report_failure, shutdown


def run_worker(body: Callable[[DistContext], Any], backend: str = "auto", timeout_s: float = 300.0,
               device: str = "auto") -> None:
    """Join the job and run ``body(ctx)``; on any exception publish the traceback for the launcher,
    print it, and exit at once (peers blocked in a collective are stopped by the launcher): with 2 for a
    :class:`~prague.errors.ConfigError` (settings that cannot work), 130 when interrupted, else 1."""
    ctx: DistContext | None = None
    try:
        ctx = init(backend=backend, timeout_s=timeout_s, device=device)
        body(ctx)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher
        report_failure(exc)
        rank = ctx.rank if ctx else _rank_label()
        sys.stderr.write(f"[rank {rank}] " + "".join(traceback.format_exception(exc)))
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(130 if isinstance(exc, KeyboardInterrupt) else EXIT_USAGE if isinstance(exc, ConfigError) else 1)
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_label() -> str:
    """This worker's rank as its environment gives it, for a failure before it joined; "?" if unknown."""
    try:
        rank = jobenv.current().rank
    except ConfigError:  # a malformed variable: the failure being reported says so
        rank = None
    return "?" if rank is None else str(rank)
