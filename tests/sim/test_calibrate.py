"""Calibration recovers a cluster from benchmark records and compares throughput method by method."""

from __future__ import annotations

import json
from pathlib import Path

from prague.simulate.calibrate import calibrate, calibration_table
from prague.sim.cluster import Cluster, Link
from prague.simulate.run import SimConfig, simulate

TRUTH = Cluster(name="truth", compute_s=0.2, compute_overhead_s=0.02, compute_cv=0.02, compute_dist="normal",
                intra=Link(80e-6, 6e8), inter=Link(80e-6, 6e8), allreduce_exposed=2.0, gg_rtt_s=3e-3,
                server=Link(80e-6, 9e8))


def test_calibration_recovers_a_known_cluster(tmp_path: Path) -> None:
    """Records simulated on a known cluster stand in for a real benchmark (marked not simulated)."""
    records = []
    for scenario in ("homogeneous", "paper:5"):
        for algorithm in ("allreduce", "prague:smart", "prague:ready", "dssync", "ps:sync"):
            # The GG's round trip shows only where it blocks the worker: smart without overlap.
            options = {"overlap": "off"} if algorithm == "prague:smart" else {}
            r = simulate(SimConfig(algorithm=algorithm, scenario=scenario, nproc=8, steps=12, batch_size=32,
                                   model="resnet18", data="digits", cluster=TRUTH, compute_s=0.2, warmup_steps=2,
                                   options=options)).to_dict()
            r["simulated"] = False
            r.pop("sim")
            records.append(r)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(records))
    cal = calibrate(bench)
    assert len(cal.rows) == 10
    assert all(abs(row["error"]) < 0.15 for row in cal.rows), calibration_table(cal)
    assert abs(cal.cluster.intra.bandwidth_bytes_per_s / 6e8 - 1) < 0.15
    assert abs(cal.cluster.gg_rtt_s + cal.cluster.gg_service_s - 3e-3) < 3e-4
    table = calibration_table(cal)
    assert "| prague:ready | paper:5 |" in table and "measured (samples/s)" in table
