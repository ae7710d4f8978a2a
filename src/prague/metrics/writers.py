"""Where a run's numbers go besides its JSON lines: TensorBoard and CSV, one option away (``--report-to``).

``prague run`` and ``prague bench`` (``--report-to tensorboard,csv``), and a script's job under ``prague
launch`` or ``prague guard`` (the same flag), write what each rank records, as it records it:

* every step: ``train/loss``, ``time/step_s`` (from the previous step's end), ``time/compute_s``,
  ``time/comm_s`` and ``time/wait_s`` (what the step record holds, :class:`~prague.train.trainer.StepRecord`),
  at the step's number;
* what a script gives :func:`prague.log_metrics`, under ``user/NAME``, at its step;
* at the end of a ``prague run``, rank 0's evaluation of the replicas' average on the common clock
  (``eval/accuracy``, ``eval/loss``), at the millisecond of the run's clock each point was taken.

``tensorboard``: one event file folder per rank, ``OUT/tensorboard/rankR`` (``tensorboard --logdir
OUT/tensorboard`` shows every rank side by side), written by ``torch.utils.tensorboard`` (it needs the
``tensorboard`` package: ``pip install tensorboard``). ``csv``: ``OUT/metrics/rankR.csv``, one row per
number (``step,time_s,name,value``: long form, so metrics that appear later need no new column), appended
and flushed row by row.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from prague.errors import ConfigError

REPORT_TO = ("tensorboard", "csv")
TENSORBOARD_MISSING = ("--report-to tensorboard needs the tensorboard package: pip install tensorboard (or "
                       "pip install 'prague[tensorboard]'), or report to csv only")


def parse_report_to(text: str | None) -> tuple[str, ...]:
    """``"tensorboard,csv"`` -> ``("tensorboard", "csv")``; None, ``""`` or ``"none"`` -> ``()``;
    ConfigError naming the choices for anything else, or the package to install when ``tensorboard`` is
    asked for and missing."""
    if text is None or text.strip() in ("", "none"):
        return ()
    kinds = tuple(k.strip() for k in text.split(","))
    bad = [k for k in kinds if k not in REPORT_TO]
    if bad or len(set(kinds)) != len(kinds):
        raise ConfigError(f"--report-to {text!r} is not valid; give one or more of {', '.join(REPORT_TO)}, "
                          "comma-separated (tensorboard,csv), or none")
    if "tensorboard" in kinds and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(TENSORBOARD_MISSING)
    return kinds


class Writers:
    """One rank's TensorBoard and CSV writers under ``out`` (see the module docstring); ``kinds`` from
    :func:`parse_report_to`. With no kinds every call does nothing. Not thread-safe: the training
    thread writes."""

    def __init__(self, out: Path, rank: int, kinds: tuple[str, ...]) -> None:
        self.kinds = kinds
        self._tensorboard: Any = None
        self._csv: tuple[IO[str], Any] | None = None
        self._last_end: float | None = None
        if "tensorboard" in kinds:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(TENSORBOARD_MISSING) from None
            self._tensorboard = SummaryWriter(log_dir=str(Path(out) / "tensorboard" / f"rank{rank}"), flush_secs=10)
        if "csv" in kinds:
            path = Path(out) / "metrics" / f"rank{rank}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            new = not path.exists() or path.stat().st_size == 0
            handle = open(path, "a", newline="", buffering=1)
            writer = csv.writer(handle)
            if new:
                writer.writerow(["step", "time_s", "name", "value"])
            self._csv = (handle, writer)

    def scalars(self, values: Mapping[str, float | None], step: int, time_s: float | None = None) -> None:
        """Write each finite number of ``values`` (name -> value; None and non-finite values are left out)
        at ``step``, stamped ``time_s`` (seconds since the epoch, now by default)."""
        if not self.kinds:
            return
        stamp = time.time() if time_s is None else time_s
        for name, value in values.items():
            if value is None or not math.isfinite(float(value)):
                continue
            if self._tensorboard is not None:
                self._tensorboard.add_scalar(name, float(value), step, walltime=stamp)
            if self._csv is not None:
                self._csv[1].writerow([step, f"{stamp:.3f}", name, repr(float(value))])

    def step(self, record: Any) -> None:
        """One step record (:class:`~prague.train.trainer.StepRecord`): its loss and times."""
        if not self.kinds:
            return
        step_s = None if self._last_end is None else record.t_end_s - self._last_end
        self._last_end = record.t_end_s
        self.scalars({"train/loss": record.loss, "time/step_s": step_s, "time/compute_s": record.compute_s,
                      "time/comm_s": record.comm_s, "time/wait_s": record.wait_s}, record.step)

    def history(self, points: list[dict[str, float | None]]) -> None:
        """An evaluation on the common clock (``{wall_s, accuracy, loss}`` each), at the millisecond of each."""
        for point in points:
            self.scalars({"eval/accuracy": point.get("accuracy"), "eval/loss": point.get("loss")},
                         round(1000 * float(point["wall_s"] or 0.0)))

    def flush(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.flush()
        if self._csv is not None:
            self._csv[0].flush()

    def __enter__(self) -> Writers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._csv is not None:
            self._csv[0].close()
            self._csv = None
        self.kinds = ()
