"""``ps-eager``: an asynchronous parameter server whose pull is decoupled from the push and never waited for.

The "eager pull" variant of the parameter server, on the shards and protocol of
:mod:`prague.algorithms.ps.runtime` (Li et al., OSDI 2014) in ``async`` mode. After backward a worker sends its
push and, at once, posts the pull of the values that follow it; it does not wait for either. The
answer arrives in a second buffer while the worker computes its next gradient, and is installed

* before the next forward pass if it has already arrived (checked without blocking: a background thread,
  :class:`prague.algorithms.ps.client.ReplyCompleter`, completes the receive as soon as the data is in,
  since a gloo receive is only marked complete by ``wait()``), else
* right after the next backward, before that gradient is pushed (it then waits only if the shard has
  not answered within a whole iteration).

So a worker never waits on the server in the steady state; the price is staleness. A pull installed
before the forward pass gives tau about n - 1, as plain ``async``; one installed after the next backward
gives tau about 2n - 1 (the gradient was computed on values one pull older). Which one happens depends on
the time between a push and the next forward pass (the loop's own work, data loading, a straggler's
slowdown, which precedes the forward pass) against the shard's round trip: with nothing in between
(emulated compute, homogeneous) it is rarely long enough. Each push
carries the versions its gradient was computed on; a shard measures the staleness tau (versions it
advanced since) and scales the update's learning rate by ``--staleness-lr``: ``inverse`` (default),
lr/max(n - 1, tau): the 1/tau rule of Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for
Distributed Deep Learning", IJCAI 2016, with tau floored at n - 1
(:func:`prague.algorithms.ps.rules.staleness_scale`); ``exp``;
or ``none``. ``--max-staleness T`` rejects (and counts) any update with
tau > T; the worker still receives fresh values.

Two choices make the extra round of delay affordable:

* read-my-writes: right after pushing, the worker applies its own update to its local copy with the
  rule the shard uses (the staleness scale taken from the shard's last answer), so its next gradient
  is computed on values that already include its own last step; the next install replaces the local
  copy with the server's. This is the client-cache consistency of Ho et al., "More Effective
  Distributed ML via a Stale Synchronous Parallel Parameter Server", NIPS 2013;
* ``--ps-momentum folded`` (default here): the shard takes momentum's steady-state step lr/(1 - m)
  without a momentum buffer, because heavy-ball momentum oscillates on gradients two rounds old
  (:meth:`prague.optim.SGDRule.folded`).

Measured (CNN on MNIST, 8 workers, one epoch, lr 0.05, momentum 0.9): per-worker momentum without
read-my-writes 92.4% test accuracy, with it 93.1%, folded with it 97.5% (``ps --ps-mode async``: 97.6%).

Staleness histograms, rejected updates and how often the pull was installed before the forward pass
are in the run's ``algorithm_stats``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from prague.algorithms.api import BeforeForward, StepTimes
from prague.algorithms.ps.client import PendingReplies
from prague.algorithms.ps.rules import sgd_rule, staleness_scale
from prague.algorithms.ps.runtime import ParameterServerBase
from prague.algorithms.ps_eager import PSEagerOptions


class EagerParameterServer(ParameterServerBase):
    """Push, post the pull, keep computing; see the module docstring."""

    options: PSEagerOptions

    @classmethod
    def shard_mode(cls, options: Any) -> str:
        return "async"

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        super().setup(model, optimizer)
        self.in_background(self.clients.completer())  # stopped before the links close
        self._own_rule = sgd_rule(self.layout, self.options.ps_momentum)
        self._own_momentum: torch.Tensor | None = None
        self._last_tau = 0
        # The second buffer the pull lands in: on the host when the model is on CUDA (gloo), so that
        # installing it is the one copy to the device.
        self.incoming = torch.empty(self.flat.shape, dtype=self.flat.dtype,
                                    device=self.stage_on or self.flat.device,
                                    pin_memory=self.stage_on is not None and self.flat.is_cuda)
        self.pending: PendingReplies | None = None
        self._pending_step = 0  # the step whose push self.pending answers
        self.installs_before_forward = 0
        self.installs_after_backward = 0
        self.rejections_seen = 0

        def before_forward() -> None:
            if self.pending is not None and self.pending.done():
                self._install()
                self.installs_before_forward += 1

        return BeforeForward(model, before_forward)

    def _install(self) -> None:
        """Take the pending answer (waiting for it if need be) as this worker's values."""
        pending, self.pending = self.pending, None
        assert pending is not None
        replies = self._guard(pending.wait)
        self._log_push(self._pending_step, replies)
        self.rejections_seen += sum(not r.accepted for r in replies)
        self._last_tau = max(r.tau for r in replies)
        self._took(replies)
        self.flat.copy_(self.incoming)

    def after_backward(self, step: int, times: StepTimes) -> None:
        bases = list(self.versions)  # the values this gradient was computed on
        if self.pending is not None:
            t0 = time.perf_counter()
            self._install()
            self.installs_after_backward += 1
            times.wait_s += time.perf_counter() - t0
        # Completed in the background, so that the next forward pass can install it if it has arrived.
        self.pending = self._push(step, bases, self.incoming, background=True)
        self._pending_step = step
        # Read-my-writes: take this push's step locally too, as the shard will (see the module docstring).
        scale = staleness_scale(self.options.staleness_lr, self._last_tau, self.ctx.world_size)
        p = self.n_params
        self._own_momentum = self._own_rule.step(self.flat[:p], self.push_buf[:p], self._own_momentum, scale)

    def _drain(self) -> None:
        if self.pending is not None:
            self._install()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "installs_before_forward": self.installs_before_forward,
                "installs_after_backward": self.installs_after_backward, "rejections_seen": self.rejections_seen}
