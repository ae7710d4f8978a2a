"""The one asyncio event loop of this process that runs its ``grpc.aio`` objects (the Group Generator's
server and the clients' streams), on a :class:`~prague.runtime.background.FunctionWork` of one thread.

gRPC's asyncio layer polls one completion queue per process and hands each event to the loop its call
was made on, so a loop that closes while gRPC still knows about it breaks later events ("Event loop is
closed"). One loop per process, started on first use and never closed, avoids that and costs one thread
however many servers and clients a process holds (a test, a benchmark); ``prague.shutdown()`` stops that
thread once the method has closed its channels and servers (:func:`pause_shared_loop`), and the next use
starts it again. A forked child starts afresh.
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
_work: FunctionWork | None = None  # the thread running _loop, while it runs


def shared_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for gRPC, running in the thread ``gg-aio`` (started on first call, and
    again after :func:`pause_shared_loop`)."""
    global _loop, _work
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            _loop.set_exception_handler(_quiet_after_close)
        if _work is None or not _work.alive:
            loop = _loop

            def stop() -> None:
                loop.call_soon_threadsafe(loop.stop)

            _work = FunctionWork("gRPC event loop", "gg-aio", lambda _: loop.run_forever(), wake=stop)
        return _loop


def pause_shared_loop(timeout_s: float = 5.0) -> None:
    """Stop the loop's thread once nothing of gRPC runs on it any more (``prague.shutdown()``, after the
    method closed its channels and servers). The loop itself stays open, so that gRPC, which knows it,
    never meets a closed loop; :func:`shared_loop` runs it again on a new thread when it is needed."""
    global _work
    with _lock:
        work, _work = _work, None
    if work is not None and work.alive:
        work.shutdown(failed=False, timeout_s=timeout_s)


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
    global _lock, _loop, _work
    _lock = threading.Lock()
    _loop = None
    _work = None


os.register_at_fork(after_in_child=_forget_after_fork)
