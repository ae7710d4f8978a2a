"""The one asyncio event loop of this process that runs its ``grpc.aio`` objects (the Group Generator's
server and the clients' streams), on a :class:`~prague.runtime.background.FunctionWork` of one thread.

gRPC's asyncio layer polls one completion queue per process and hands each event to the loop its call
was made on, so a loop that closes while gRPC still knows about it breaks later events ("Event loop is
closed"). One loop per process, started on first use and never closed, avoids that and costs one thread
however many servers and clients a process holds (a test, a benchmark). A forked child starts afresh.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from typing import Any

from prague.runtime.background import FunctionWork

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def shared_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for gRPC, running in the thread ``gg-aio`` (started on first call; it
    runs as long as the process)."""
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            loop.set_exception_handler(_quiet_after_close)
            FunctionWork("gRPC event loop", "gg-aio", lambda _: loop.run_forever(),
                         wake=lambda: loop.call_soon_threadsafe(loop.stop))
            _loop = loop
        return _loop


def _quiet_after_close(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: gRPC's poller reading its completion queue once the process has
    closed it (a channel or server shut down while an event was due: ``OSError: [Errno 9] Bad file
    descriptor`` in ``PollerCompletionQueue._handle_events``, at exit) is nothing to report; anything
    else goes to asyncio's own handler."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and exc.errno == errno.EBADF:
        return
    loop.default_exception_handler(context)


def _forget_after_fork() -> None:
    global _lock, _loop
    _lock = threading.Lock()
    _loop = None


os.register_at_fork(after_in_child=_forget_after_fork)
