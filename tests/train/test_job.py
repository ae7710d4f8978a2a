"""One job description: a run resolved once (method, typed options, settings), written once to
``OUT/run.json`` and read back by every worker; the simulator's configuration is it plus a cluster."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from prague.algorithms.prague import PragueOptions
from prague.algorithms.registry import METHODS
from prague.cli import _worker_job, build_parser
from prague.errors import ConfigError
from prague.simulate.run import SimConfig
from prague.train.config import RunConfig, read_job, worker_argv, write_job


def test_the_method_and_its_typed_options_are_resolved_once(tmp_path: Path) -> None:
    cfg = RunConfig(algorithm="prague:smart", nproc=4, out=tmp_path, options={"group_size": 2})
    assert cfg.method is METHODS["prague"]
    assert isinstance(cfg.options, PragueOptions)
    assert (cfg.options.generator, cfg.options.group_size) == ("smart", 2)
    assert cfg.label == "prague:smart"
    # Given typed, they are kept as they are (and still checked against the job).
    typed = RunConfig(algorithm="prague", nproc=4, out=tmp_path, options=cfg.options)
    assert typed.options is cfg.options and typed.label == "prague:smart"
    with pytest.raises(ConfigError, match="larger than the job"):
        RunConfig(algorithm="prague", nproc=2, out=tmp_path, options=PragueOptions(group_size=3 + 1))


@pytest.mark.parametrize("kw,match", [
    ({"algorithm": "prague", "options": {"ps_shards": 2}}, "--ps-shards is not an option of prague"),
    ({"algorithm": "prague:static", "options": PragueOptions(generator="smart")}, "disagree"),
    ({"algorithm": "allreduce", "options": PragueOptions()}, "AllReduceOptions"),
    ({"algorithm": "allreduce", "options": [1, 2]}, "option values by name"),
    ({"algorithm": "prague:nope"}, "valid choices"),
    ({"scenario": "straggler:9:2"}, "rank 9"),
])
def test_a_bad_description_is_refused_when_built(kw: dict[str, Any], match: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=match):
        RunConfig(nproc=4, out=tmp_path, **kw)


def test_seed_options_follow_the_run_seed_through_replace(tmp_path: Path) -> None:
    """A seed option left at 0 means the run's seed: replacing the seed (a bench's --repeat) moves it."""
    cfg = RunConfig(algorithm="prague", nproc=4, out=tmp_path, seed=3)
    assert cfg.options.gg_seed == 0 and cfg.seeded_options.gg_seed == 3
    assert dataclasses.replace(cfg, seed=7).seeded_options.gg_seed == 7
    fixed = RunConfig(algorithm="prague", nproc=4, out=tmp_path, seed=3, options={"gg_seed": 11})
    assert dataclasses.replace(fixed, seed=7).seeded_options.gg_seed == 11


@pytest.mark.parametrize("algorithm", ["allreduce", "prague:ready", "ps:async", "eager-sgd:solo", "lossy", "adpsgd"])
def test_the_written_job_reads_back_equal(algorithm: str, tmp_path: Path) -> None:
    cfg = RunConfig(algorithm=algorithm, scenario="straggler:1:3", nproc=4, out=tmp_path, steps=7, lr=0.1,
                    compute="paced", compute_ms=20, seed=5, log_decisions=True, timeline=True)
    path = write_job(cfg)
    assert path == tmp_path / "run.json"
    saved = json.loads(path.read_text())
    assert saved["options"] == dataclasses.asdict(cfg.options)  # every option, in full
    assert read_job(path) == cfg
    assert read_job(path, resume=True).resume and not read_job(path).resume


@pytest.mark.parametrize("change,match", [
    ({"options": {"group_size": "3"}}, "group_size = '3' is not a int"),
    ({"options": {"group_size": True}}, "is not a int"),
    ({"options": {"colour": 1}}, "--colour is not an option"),
    ({"colour": "blue"}, "not a job description"),
    ({"nproc": "4"}, "not a int"),
    ({"lr": -1}, "--lr must be"),
])
def test_a_bad_job_file_is_one_error_naming_it(change: dict[str, Any], match: str, tmp_path: Path) -> None:
    path = write_job(RunConfig(algorithm="prague", nproc=4, out=tmp_path))
    saved = json.loads(path.read_text())
    for key, value in change.items():
        if key == "options":
            saved["options"].update(value)
        else:
            saved[key] = value
    path.write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=match) as err:
        read_job(path)
    assert str(path) in str(err.value) and str(err.value).startswith("--job")
    with pytest.raises(ConfigError, match="no job description"):
        read_job(tmp_path / "missing.json")


def test_the_worker_reads_the_job_and_nothing_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = write_job(RunConfig(algorithm="dssync", nproc=3, out=tmp_path, steps=4))
    argv = worker_argv(job, resume=True)
    assert argv[-4:] == ["worker", "--job", str(job), "--resume"]
    parser = build_parser(only="worker")
    args = parser.parse_args(argv[argv.index("worker"):])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="WORLD_SIZE is not set"):
        _worker_job(args)
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = _worker_job(args)
    assert cfg.label == "dssync" and cfg.steps == 4 and cfg.resume
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="describes 3 workers, but this job has 2"):
        _worker_job(args)
    for extra in (["--steps", "5"], ["--algorithm", "prague"], ["--group-size", "2"]):
        bad = parser.parse_args(["worker", "--job", str(job), *extra])
        with pytest.raises(ConfigError, match=f"--job holds the whole job; drop {extra[0]}"):
            _worker_job(bad)
    # torchrun running `prague worker` with the flags: the job is theirs, for the environment's world size
    flags = parser.parse_args(["worker", "--algorithm", "prague", "--steps", "7", "--resume", "--out", str(tmp_path / "t")])
    cfg = _worker_job(flags)
    assert (cfg.algorithm, cfg.nproc, cfg.steps, cfg.resume, cfg.out) == ("prague", 2, 7, True, tmp_path / "t")


def test_a_simulation_is_the_job_description_plus_a_cluster(tmp_path: Path) -> None:
    run = RunConfig(algorithm="prague:smart", nproc=8, out=tmp_path, steps=5, seed=4, options={"group_size": 4})
    sim = SimConfig(run, nodes=2)
    assert sim.run is run and sim.steps == 5 and sim.topology.nodes == 2
    assert sim.options.nodes == 2 and sim.options.gg_seed == 4 and sim.options.group_size == 4
    assert SimConfig.of(algorithm="prague:smart", nproc=8, out=tmp_path, steps=5, seed=4, nodes=2,
                        options={"group_size": 4}) == sim
    assert SimConfig.of(algorithm="allreduce", nproc=8, out=tmp_path).steps == 200  # no length: the default
    with pytest.raises(ConfigError, match="differs from --hosts"):
        SimConfig.of(algorithm="allreduce", nproc=8, out=tmp_path, hosts=2, nodes=4)
