"""A script's own collectives (prague.live_ranks, leader, is_leader, barrier, all_reduce, broadcast) in a job
of one, where every one is exact, and their refusals of bad input; the same calls across real workers
that die are tested in tests/runtime/test_torchrun_failure.py."""

from __future__ import annotations

import sys

from prague_testing import run_command

ALONE = """
import torch, prague
from prague.errors import CommError, ConfigError

ctx = prague.init()
assert prague.live_ranks() == [0] and prague.leader() == 0 and prague.is_leader()
prague.barrier()
t = torch.tensor([1.5, -2.0])
for op in ("sum", "mean", "max", "min"):
    assert torch.equal(prague.all_reduce(t.clone(), op=op), t), op
counts = torch.tensor([3, 7])
assert torch.equal(prague.all_reduce(counts.clone()), counts)  # integers through float64, exactly
assert torch.equal(prague.broadcast(t.clone()), t) and torch.equal(prague.broadcast(counts.clone(), src=0), counts)
for call, message in [
    (lambda: prague.all_reduce(t, op="median"), "unknown op 'median'; one of sum, mean, max, min"),
    (lambda: prague.all_reduce([1.0]), "takes a tensor, got list"),
    (lambda: prague.all_reduce(counts, op="mean"), "op='mean') takes a floating-point tensor"),
    (lambda: prague.broadcast(t, src=3), "src 3 is not a rank of this job (0..0)"),
]:
    try:
        call()
    except ConfigError as exc:
        assert message in str(exc), (message, str(exc))
    else:
        raise AssertionError(f"no error: {message}")
prague.shutdown()
print("ok")
"""


def test_collectives_in_a_job_of_one_are_exact_and_refuse_bad_input() -> None:
    res = run_command([sys.executable, "-c", ALONE], timeout_s=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), (res.stdout[-2000:], res.stderr[-3000:])
