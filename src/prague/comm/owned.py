"""Owning a process group, and letting it go.

A gloo process group runs worker threads that live exactly as long as the group object is referenced:
``shutdown()`` (and ``destroy_process_group()`` for the groups torch keeps) does not stop them. A worker
thread that still holds a finished collective when the interpreter finalises needs the GIL to release
the collective's tensors, cannot take it, and aborts the process ("terminate called without an active
exception"). So every object of ours that keeps a group drops its reference when it is done with it,
through :class:`HoldsGroup`, and :func:`prague.shutdown` checks that no gloo worker thread is left.
"""

from __future__ import annotations

import torch.distributed as dist

from prague.errors import CommError


def shutdown_group(pg: dist.ProcessGroup) -> None:
    """Ask ``pg`` to shut down, best effort: a group whose peer is gone may fail to. A gloo group's
    connections stay open until its last reference is dropped (its ``shutdown()`` and ``abort()`` leave
    them): a caller whose peers may still wait in a collective on it must drop every reference."""
    try:
        if hasattr(pg, "shutdown"):
            pg.shutdown()
    except Exception:  # noqa: BLE001 - a broken group may fail to shut down cleanly; it is dropped anyway
        pass


class HoldsGroup:
    """Mixin for an object that communicates through one process group of its own, :attr:`pg`.

    The subclass sets ``self._pg`` in its constructor. :meth:`release_group` shuts the group down and
    drops the reference, so that its worker threads end when no one else holds it; using :attr:`pg`
    afterwards raises :class:`CommError`."""

    _pg: dist.ProcessGroup | None

    @property
    def pg(self) -> dist.ProcessGroup:
        if self._pg is None:
            raise CommError(f"{type(self).__name__}: its communicator was released; it cannot be used after close")
        return self._pg

    def release_group(self) -> None:
        """Shut the group down and forget it. Safe to call twice, and from several holders of one group."""
        pg, self._pg = self._pg, None
        if pg is not None:
            shutdown_group(pg)
