"""Python that must run on every call of a model, also inside a graph ``torch.compile`` captures.

A method's work around the forward pass (the step's start on the clock, ``prague``'s averages applied
before the pass, DDP's buffer broadcast timed) is Python with side effects: a clock read, a hook of the
method. Traced by ``torch.compile``, such code is a graph break (Dynamo cannot put ``time.perf_counter``
in a graph), or worse, runs once at tracing and never again. :class:`EveryCall` makes it one operator of
the graph instead (``prague::every_call``, a ``torch.library.custom_op``), which runs the Python on each
call like any other node; eagerly it is a plain call through the same operator. The operator declares
that it writes a one-element tensor of its own, so that no compiler drops a node whose results nobody
reads.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

_CALLS: weakref.WeakValueDictionary[int, EveryCall] = weakref.WeakValueDictionary()


@torch.library.custom_op("prague::every_call", mutates_args=("token",))
def _every_call(token: torch.Tensor, key: int, grad: bool) -> None:
    call = _CALLS.get(key)
    if call is not None:
        call.fn(grad)


@_every_call.register_fake
def _(token: torch.Tensor, key: int, grad: bool) -> None:
    return None


class EveryCall:
    """``fn(grad)`` (``grad``: whether grad mode is on at the call) each time this object is called, from
    eager code or from inside a compiled region alike (see the module docstring). Whoever holds the
    object keeps ``fn`` alive; once it is gone, a graph that still calls it does nothing."""

    def __init__(self, fn: Callable[[bool], None]) -> None:
        self.fn = fn
        self._key = id(self)
        self._token = torch.zeros(1)
        _CALLS[self._key] = self

    def __call__(self) -> None:
        _every_call(self._token, self._key, torch.is_grad_enabled())
