"""A run's timeline: every worker's iterations as a Chrome trace, and where the time went.

Built from what every run writes anyway: each worker's step records (``OUT/metrics/rankR.jsonl``: end
of the step on the worker's training clock, seconds computing, communicating and waiting) and, when the
run logged its decisions (``--log-decisions``), each step's group or partner
(``OUT/decisions/rankR.jsonl``). One track (Chrome-trace process) per worker; per step a ``compute``
slice, then a ``communicate`` slice whose first part is a nested ``wait`` slice (the time the method
reports waiting for peers: where inside the communication it happened is not recorded) and whose
arguments name the step's group members or partner and, for methods that drop data, the dropped share.
The file (``--timeline``: ``OUT/timeline.json``) opens in Perfetto (ui.perfetto.dev) or
chrome://tracing; ``prague timeline OUT`` prints :func:`summarize`'s table. Pure except for the
readers and the writer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prague.errors import ConfigError
from prague.io import atomic_write_json, atomic_write_text, read_json_lines

TIMELINE_FILE = "timeline.json"
BACKGROUND_DIR = "background"  # under OUT/metrics: each rank's background operations' stages
_US = 1e6


def build_trace(records: Mapping[int, Sequence[Mapping[str, Any]]],
                decisions: Mapping[int, Sequence[Mapping[str, Any]]] | None = None,
                background: Mapping[int, Sequence[Mapping[str, Any]]] | None = None) -> dict[str, Any]:
    """The Chrome trace of ``records`` (rank -> its step records, in step order) with the group or
    partner of each step from ``decisions`` (rank -> its decision lines), and each background thread's
    operations from ``background`` (rank -> its stage lines), if given."""
    events: list[dict[str, Any]] = []
    for rank in sorted(records):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.extend(_background_events(rank, background.get(rank, ()) if background else ()))
        with_whom = _with_whom(decisions.get(rank, ()) if decisions else ())
        for r in records[rank]:
            end, comm, compute = float(r["t_end_s"]), float(r["comm_s"]), float(r["compute_s"])
            wait = min(float(r.get("wait_s") or 0.0), comm)
            step = int(r["step"])
            start_comm = end - comm
            base = {"pid": rank, "tid": 0, "cat": "step"}
            events.append({**base, "ph": "X", "name": "compute", "ts": max(0.0, start_comm - compute) * _US,
                           "dur": compute * _US, "args": {"step": step, "slowdown": r.get("slowdown", 1.0)}})
            args: dict[str, Any] = {"step": step, "wait_ms": round(wait * 1e3, 3)}
            if step in with_whom:
                args.update(with_whom[step])
            if r.get("dropped") is not None:
                args["dropped"] = r["dropped"]
            events.append({**base, "ph": "X", "name": "communicate", "ts": start_comm * _US, "dur": comm * _US,
                           "args": args})
            if wait > 0:
                events.append({**base, "ph": "X", "name": "wait", "ts": start_comm * _US, "dur": wait * _US,
                               "args": {"step": step}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _background_events(rank: int, lines: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One track (thread) per background thread of ``rank``, after the training thread's (tid 0): a slice
    per stage of each operation (``waiting``, ``communicating``)."""
    keys = sorted({(str(line["work"]), int(line["thread"])) for line in lines})
    tids = {key: tid for tid, key in enumerate(keys, start=1)}
    several = {work for work, thread in keys if thread > 0}  # works with more than one thread
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
         "args": {"name": f"{work} {thread}" if work in several else work}} for (work, thread), tid in tids.items()]
    for line in lines:
        key = (str(line["work"]), int(line["thread"]))
        start, end = float(line["start_s"]), float(line["end_s"])
        events.append({"ph": "X", "pid": rank, "tid": tids[key], "cat": "background", "name": str(line["stage"]),
                       "ts": max(0.0, start) * _US, "dur": max(0.0, end - start) * _US,
                       "args": {"step": int(line["step"])}})
    return events


def _with_whom(lines: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """step -> {"group": members} or {"partner": rank}, from one worker's decision lines."""
    out: dict[int, dict[str, Any]] = {}
    for line in lines:
        if line.get("kind") == "group" and line.get("members") is not None:
            out[int(line["step"])] = {"group": list(line["members"])}
        elif line.get("kind") == "partner" and line.get("partner") is not None:
            out[int(line["step"])] = {"partner": int(line["partner"])}
    return out


def read_run(out: Path) -> tuple[dict[int, list[dict[str, Any]]], dict[int, list[dict[str, Any]]],
                                 dict[int, list[dict[str, Any]]]]:
    """(step records, decision lines, background stage lines) of the run in folder ``out``, each rank ->
    its lines."""
    records = {_rank(p): read_json_lines(p) for p in sorted((out / "metrics").glob("rank*.jsonl"))}
    decisions = {_rank(p): read_json_lines(p) for p in sorted((out / "decisions").glob("rank*.jsonl"))}
    background = {_rank(p): read_json_lines(p) for p in sorted((out / "metrics" / BACKGROUND_DIR).glob("rank*.jsonl"))}
    return records, decisions, background


def _rank(path: Path) -> int:
    return int(path.stem.removeprefix("rank"))


def write_background(path: Path, spans: Sequence[tuple[str, Any]], origin_s: float) -> None:
    """A rank's background operations' stages (``OUT/metrics/background/rankR.jsonl``, for the timeline):
    each (work, :class:`~prague.runtime.background.Span`) as one line, its times on the rank's clock, which
    reads ``perf_counter() + origin_s``. Nothing for a method without any."""
    lines = [{"work": what, "thread": s.thread, "stage": s.stage, "step": s.step,
              "start_s": round(s.start_s + origin_s, 6), "end_s": round(s.end_s + origin_s, 6)} for what, s in spans]
    if lines:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "".join(json.dumps(line) + "\n" for line in lines))


def write_timeline(out: Path) -> Path:
    """Write ``out/timeline.json`` from the run's files (atomically); returns its path."""
    records, decisions, background = read_run(out)
    path = out / TIMELINE_FILE
    atomic_write_json(path, build_trace(records, decisions, background))
    return path


def load_trace(out: Path) -> dict[str, Any]:
    """The trace of the run in ``out``: its timeline.json, or one built from its step records."""
    path = out / TIMELINE_FILE
    if path.is_file():
        try:
            trace = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path} is not a Chrome trace ({exc}); run `prague run --timeline` again") from None
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
            raise ConfigError(f"{path} has no traceEvents list; it is not a prague timeline")
        return trace
    records, decisions, background = read_run(out)
    if not records:
        raise ConfigError(f"{str(out)!r} holds no run: no {TIMELINE_FILE} and no metrics/rank*.jsonl; pass a "
                          "`prague run` output folder")
    return build_trace(records, decisions, background)


def summarize(trace: Mapping[str, Any], slowest: int = 5) -> str:
    """Where the time went, per worker: steps, compute, communication, of it waiting, and idle time
    (between steps); then the ``slowest`` longest steps."""
    per: dict[int, dict[str, float]] = {}
    spans: dict[int, list[tuple[float, float]]] = {}
    steps: list[tuple[float, int, int, float, float]] = []  # (duration, rank, step, compute, comm)
    compute_of: dict[tuple[int, int], float] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        rank, name, dur = int(e["pid"]), e["name"], float(e["dur"]) / _US
        t = per.setdefault(rank, {"compute": 0.0, "communicate": 0.0, "wait": 0.0, "steps": 0.0})
        t[name] = t.get(name, 0.0) + dur
        if name in ("compute", "communicate"):
            spans.setdefault(rank, []).append((float(e["ts"]) / _US, float(e["ts"]) / _US + dur))
        if name == "compute":
            t["steps"] += 1
            compute_of[(rank, int(e["args"]["step"]))] = dur
        elif name == "communicate":
            step = int(e["args"]["step"])
            c = compute_of.get((rank, step), 0.0)
            steps.append((c + dur, rank, step, c, dur))
    if not per:
        return "no steps in this timeline"
    lines = [f"{'rank':>4}  {'steps':>5}  {'span s':>7}  {'compute':>8}  {'comm':>8}  {'of it wait':>10}  {'idle':>7}"]
    for rank in sorted(per):
        t = per[rank]
        lo = min(s for s, _ in spans[rank])
        hi = max(e for _, e in spans[rank])
        span = max(hi - lo, 1e-12)
        idle = max(0.0, span - t["compute"] - t["communicate"])
        lines.append(f"{rank:>4}  {int(t['steps']):>5}  {span:>7.2f}  {_pct(t['compute'], span)}  "
                     f"{_pct(t['communicate'], span)}  {_pct(t['wait'], span, 10)}  {_pct(idle, span, 7)}")
    lines.append(f"slowest steps (of {len(steps)}):")
    for dur, rank, step, c, comm in sorted(steps, reverse=True)[:slowest]:
        lines.append(f"  rank {rank} step {step}: {dur * 1e3:.1f} ms (compute {c * 1e3:.1f}, comm {comm * 1e3:.1f})")
    return "\n".join(lines)


def _pct(part: float, whole: float, width: int = 8) -> str:
    return f"{100 * part / whole:>{width - 1}.1f}%"
