"""Cluster descriptions: presets, TOML files, validation messages, flags and the TOML round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from prague.errors import ConfigError
from prague.simulate.cli import cluster_to_toml
from prague.sim.cluster import GBIT, PAPER, PRESETS, Cluster, Link, load_cluster


def test_presets_load_by_name() -> None:
    assert load_cluster("paper") is PAPER
    assert set(PRESETS) >= {"paper", "local"}


def test_toml_file_with_base_and_units(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        'name = "mine"\nbase = "paper"\n[compute]\ntime_ms = 80\ncv = 0.1\ndistribution = "lognormal"\n'
        "[links.inter]\nbandwidth_gbps = 100\n[gg]\nservice_us = 20\n"
    )
    c = load_cluster(path)
    assert c.name == "mine" and c.compute_s == pytest.approx(0.080) and c.compute_dist == "lognormal"
    assert c.inter.bandwidth_bytes_per_s == pytest.approx(100 * GBIT)
    assert c.inter.latency_s == PAPER.inter.latency_s  # kept from the base preset
    assert c.intra == PAPER.intra and c.gg_service_s == pytest.approx(20e-6)


@pytest.mark.parametrize("text,match", [
    ("[compute]\ntime_msec = 3\n", r"unknown key\(s\) \['time_msec'\]"),
    ("[links.intra]\nbandwidth_gbps = -1\n", "must be > 0"),
    ("[compute]\ndistribution = 'weird'\n", "valid choices: constant, lognormal, normal, uniform"),
    ("base = 'nope'\n", "valid choices: local, paper"),
    ("[compute\n", "cannot read cluster file"),
    ("[compute]\nbackward_share = 1.5\n", "between 0 and 1, got 1.5"),
    ("[allreduce]\nexposed_fraction = 0.5\n", r"no longer a cluster key.*backward_share.*ring_factor"),
])
def test_bad_files_say_what_and_where(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_cluster(path)


def test_missing_file_lists_presets() -> None:
    with pytest.raises(ConfigError, match="neither a preset"):
        load_cluster("/no/such/cluster.toml")


def test_validation_quotes_the_value() -> None:
    with pytest.raises(ConfigError, match="-3"):
        Cluster(compute_s=-3)
    with pytest.raises(ConfigError, match="bandwidth"):
        Link(1e-6, 0.0)


def test_toml_round_trip(tmp_path: Path) -> None:
    c = PAPER.replace_fields(name="x", speeds=(1.0, 2.0), server=Link.of(30, 10), compute_overhead_s=0.004,
                             backward_share=0.5, allreduce_ring_factor=1.7)
    path = tmp_path / "x.toml"
    path.write_text(cluster_to_toml(c))
    back = load_cluster(path)
    for key, value in c.describe().items():
        got = back.describe()[key]
        if isinstance(value, (float, dict, list)) and value:
            assert got == pytest.approx(value, rel=1e-5), key
        else:
            assert got == value, key
