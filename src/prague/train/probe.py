"""``--compute-ms auto``: the smallest pace this machine holds for a job's workers and model.

Under paced compute every worker's real forward and backward pass must fit in the pace, while all the
job's workers compute on this machine's cores at once. :func:`probe_pace` measures exactly that: it starts
one process per worker (``python -m prague.train.probe``, one thread each, as a worker runs), each
builds the job's model, warms up, and once all are ready they run real training steps on batches of the
data set's shape together for :data:`PROBE_S` seconds. The pace is the slowest process's median step
times :data:`MARGIN` (room for what a real job adds: communication, the Group Generator, snapshots, a
noisy neighbour), rounded up to :data:`ROUND_MS`. ``prague bench`` probes once for the whole bench and
prints the result in its header; ``prague run`` probes for its run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from prague import jobenv
from prague.errors import ConfigError

#: How long the processes train together, s.
PROBE_S = 4.0
#: The pace is the slowest process's median step times this.
MARGIN = 1.5
#: The pace is rounded up to a multiple of this, ms.
ROUND_MS = 10.0
#: The longest a probe may take (start-up of every process included), s.
PROBE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class PaceProbe:
    """What :func:`probe_pace` found: the pace ``ms``, the slowest process's median step ``step_ms``, the
    workers that computed together, and the margin applied."""

    ms: float
    step_ms: float
    workers: int
    margin: float = MARGIN
    probed: bool = True

    def as_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)

    def line(self) -> str:
        return (f"pace {self.ms:g} ms per step (--compute-ms auto: {self.workers} workers' real steps together "
                f"take {self.step_ms:.1f} ms here, times {self.margin:g})")


def pace_of(step_ms: float, margin: float = MARGIN) -> float:
    """The pace for a measured median step ``step_ms``: times ``margin``, rounded up to :data:`ROUND_MS`."""
    return max(ROUND_MS, math.ceil(step_ms * margin / ROUND_MS) * ROUND_MS)


def probe_pace(model: str, data: str, batch_size: int, workers: int, seed: int = 0,
               optimizer: str = "sgd") -> PaceProbe:
    """Probe the pace of ``workers`` processes training ``model`` with ``optimizer`` on batches of
    ``data``'s shape (module docstring). Raises ConfigError when a process fails (its message quoted)."""
    argv = [sys.executable, "-m", "prague.train.probe", "--model", model, "--data", data, "--optimizer", optimizer,
            "--batch-size", str(batch_size), "--seed", str(seed), "--seconds", str(PROBE_S)]
    env = jobenv.child({"OMP_NUM_THREADS": "1"})
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(workers)]
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    try:
        for proc in procs:  # each says it is ready once warmed up
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != "ready":
                raise ConfigError(f"--compute-ms auto: a probe process failed: {_failure(proc)}")
        for proc in procs:  # then all start together
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        medians = []
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise ConfigError(f"--compute-ms auto: a probe process failed: {err.strip().splitlines()[-1:]}")
            medians.append(float(json.loads(out)["median_ms"]))
    except subprocess.TimeoutExpired:
        raise ConfigError(f"--compute-ms auto: the probe took over {PROBE_TIMEOUT_S:g} s; give --compute-ms") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    step_ms = max(medians)
    return PaceProbe(ms=pace_of(step_ms), step_ms=round(step_ms, 3), workers=workers)


def _failure(proc: subprocess.Popen[str]) -> str:
    proc.kill()
    _, err = proc.communicate()
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


def main(argv: list[str] | None = None) -> int:
    """One probe process: warm up, say ``ready``, wait for ``go`` on stdin, train for ``--seconds``, print
    ``{"median_ms": ...}``."""
    parser = argparse.ArgumentParser(prog="python -m prague.train.probe")
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=PROBE_S)
    args = parser.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from prague.workload.catalog import dataset_info
    from prague.workload.data import example_batch
    from prague.workload.models import build_model, build_optimizer

    torch.set_num_threads(1)
    info = dataset_info(args.data)
    torch.manual_seed(args.seed)
    model = build_model(args.model, info.input_shape, info.num_classes)
    optimizer = build_optimizer(args.optimizer, model, lr=0.001, momentum=0.9)
    x, y = example_batch(info.input_shape, info.num_classes, args.batch_size)

    def step() -> float:
        t0 = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    times: list[float] = []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end or len(times) < 3:
        times.append(step())
    times.sort()
    print(json.dumps({"median_ms": 1e3 * times[len(times) // 2], "steps": len(times)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
