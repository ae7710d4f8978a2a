"""``--report-to``: each rank's numbers in TensorBoard event files and CSV rows, as they are recorded."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest

from prague.errors import ConfigError
from prague.metrics.writers import Writers, parse_report_to


def test_report_to_takes_tensorboard_and_csv_and_names_the_choices() -> None:
    assert parse_report_to("tensorboard,csv") == ("tensorboard", "csv")
    assert parse_report_to(None) == parse_report_to("none") == parse_report_to("") == ()
    for bad in ("wandb", "csv,csv", "csv,"):
        with pytest.raises(ConfigError, match="give one or more of tensorboard, csv"):
            parse_report_to(bad)


def _step(step: int, end_s: float, loss: float | None) -> SimpleNamespace:
    return SimpleNamespace(step=step, t_end_s=end_s, loss=loss, compute_s=0.1, comm_s=0.02, wait_s=0.0)


def test_steps_and_an_evaluation_reach_csv_rows_and_tensorboard_events(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Writers(tmp_path, 3, ("tensorboard", "csv")) as writers:
        writers.step(_step(0, 0.5, 2.0))
        writers.step(_step(1, 0.75, float("nan")))  # a non-finite loss is left out, the times are written
        writers.scalars({"user/lr": 0.1, "user/none": None}, 1, time_s=1000.0)
        writers.history([{"wall_s": 0.0, "accuracy": 0.1, "loss": 2.3}, {"wall_s": 1.25, "accuracy": 0.6, "loss": None}])
    rows = list(csv.DictReader((tmp_path / "metrics" / "rank3.csv").open()))
    by_name: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        by_name.setdefault(row["name"], []).append((int(row["step"]), float(row["value"])))
    assert by_name["train/loss"] == [(0, 2.0)]
    assert by_name["time/step_s"] == [(1, 0.25)]  # from the previous step's end
    assert by_name["time/compute_s"] == [(0, 0.1), (1, 0.1)] and by_name["user/lr"] == [(1, 0.1)]
    assert by_name["eval/accuracy"] == [(0, 0.1), (1250, 0.6)] and by_name["eval/loss"] == [(0, 2.3)]
    assert "user/none" not in by_name
    with Writers(tmp_path, 3, ("csv",)) as again:  # appended, one header
        again.scalars({"user/lr": 0.05}, 2)
    lines = (tmp_path / "metrics" / "rank3.csv").read_text().splitlines()
    assert lines[0] == "step,time_s,name,value" and lines.count(lines[0]) == 1 and lines[-1].endswith("user/lr,0.05")

    events = EventAccumulator(str(tmp_path / "tensorboard" / "rank3"))
    events.Reload()
    assert {"train/loss", "time/step_s", "user/lr", "eval/accuracy"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(0, pytest.approx(0.1)),
                                                                          (1250, pytest.approx(0.6))]


def test_without_kinds_nothing_is_written(tmp_path: Path) -> None:
    with Writers(tmp_path, 0, ()) as writers:
        writers.step(_step(0, 0.5, 1.0))
    assert not any(tmp_path.iterdir())
