"""Ordering background communication against the compute stream, on a device with streams (CUDA).

On a GPU every kernel is queued on a stream and runs later; the training thread queues its forward,
backward and optimizer kernels on the device's current stream (the *compute* stream). A background
average (``prague --overlap on``) must neither wait for that queue nor run ahead of it:

* it runs on a stream of its own (the *side* stream), so its copies and collectives (NCCL collectives
  start after the work already queued on the stream that is current when they are called) never wait
  behind the next iteration's compute, and the compute never waits behind them;
* the snapshot it averages is copied on the compute stream, after the step that produced the values; the
  side stream waits for an event recorded right after that copy before it reads the snapshot;
* the background thread blocks on an event recorded after its last kernel before it hands the
  correction over, so the correction the worker adds on its compute stream is complete, and the buffers
  it recycles are no longer read by the side stream;
* a step is timed by an event on the compute stream, not by ``torch.cuda.synchronize()``, which would
  also wait for the side stream's average and charge it to the step.

On the CPU (gloo) kernels run when called: :class:`HostStreams` does nothing. The logic is tested on the
CPU with a recording stand-in for :class:`Streams` (``tests/algorithms/test_overlap.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class Streams(Protocol):
    """The four stream operations background communication needs (see the module docstring)."""

    def mark(self) -> Any:
        """Record an event on the calling thread's current stream, after the work queued so far."""

    def wait(self, mark: Any) -> None:
        """Make the calling thread's current stream wait for ``mark`` (no CPU wait)."""

    def finish(self, mark: Any) -> None:
        """Block the calling thread until the work before ``mark`` has run."""

    def side(self) -> contextlib.AbstractContextManager[None]:
        """Make the side stream the calling thread's current stream for the ``with`` block."""


class HostStreams:
    """CPU tensors: work runs when it is called, so there is nothing to order."""

    def mark(self) -> None:
        return None

    def wait(self, mark: Any) -> None:
        pass

    def finish(self, mark: Any) -> None:
        pass

    def side(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class CudaStreams:
    """One side stream on ``device`` and CUDA events; the current stream is per thread in PyTorch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = torch.cuda.Stream(device=device)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, mark: Any) -> None:
        if mark is not None:
            torch.cuda.current_stream(self.device).wait_event(mark)

    def finish(self, mark: Any) -> None:
        if mark is not None:
            mark.synchronize()

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(self._side):
            yield


HOST = HostStreams()


def streams_for(device: torch.device) -> Streams:
    """The stream operations for tensors on ``device``: CUDA streams and events, or nothing to do."""
    return CudaStreams(device) if device.type == "cuda" else HOST
