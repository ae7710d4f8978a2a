"""Fuzz of the command line: any mix of valid and invalid flags of ``prague run``, ``bench`` and ``simulate``,
any cluster file and any saved run configuration is either accepted by validation or refused with exit code
2 and one line naming the problem, never a traceback.

Nothing runs: the points where validated settings are handed on, ``prague.cli.run_config`` (the launcher)
and ``prague.simulate.run.simulate_bench`` (the simulator), are replaced by one that raises
:class:`Accepted`, so an accepted input stops there. The flags are read from the parser itself, so a new
flag is fuzzed without a change here; flags whose values have a grammar (methods, scenarios, paths,
addresses) get values that are often valid and often just wrong. Inputs the fuzz found are kept as
explicit examples in tests/test_cli_errors.py.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prague.algorithms.registry import METHODS, all_options
from prague.hetero.spec import KINDS
from prague.sim.cluster import _KEYS as CLUSTER_KEYS  # the sections and keys a cluster file may hold
from prague.sim.cluster import DISTRIBUTIONS, PRESETS
from prague_testing import MNIST_DIR

pytestmark = pytest.mark.timeout(240)

# Examples per property: the whole file runs in about 10 s on 2 cores; PRAGUE_FUZZ_EXAMPLES=5000 digs deeper.
EXAMPLES = int(os.environ.get("PRAGUE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COMMANDS = ("run", "bench", "simulate")


class Accepted(Exception):
    """Raised where validated settings would be handed to the launcher or the simulator."""


def _accept(*args: object, **kwargs: object) -> Any:
    raise Accepted


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A working folder holding the files the fuzz points flags at; the launcher and the simulator are
    replaced for the module (see the module docstring), and relative default ``--out`` folders land here."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "empty").mkdir()
    (root / "file.txt").write_text("not a folder\n")
    for name, text in {"garbage": "{not json", "list": "[]", "types": '{"nproc": "two", "algorithm": 3}',
                       "options": '{"algorithm": "allreduce", "options": [1, 2]}',
                       "unknown": '{"colour": "blue"}', "inf": '{"nproc": Infinity}'}.items():
        (root / "resume" / name).mkdir(parents=True)
        (root / "resume" / name / "run.json").write_text(text)
    for name, text in {"garbage.json": "][", "dict.json": '{"records": 5}', "empty.json": "[]",
                       "junk.json": '[1, "two", null]', "partial.json": '[{"algorithm": "prague"}]',
                       "binary.json": "\udcff\udcfe"}.items():
        (root / "bench" / name).parent.mkdir(exist_ok=True)
        (root / "bench" / name).write_bytes(text.encode("utf-8", "surrogateescape"))
    (root / "cluster.toml").write_text('base = "paper"\n[compute]\ntime_ms = 20\n')
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("prague.cli.run_config", _accept)
        mp.setattr("prague.runtime.forkserver.prestart", lambda *args, **kwargs: None)  # no workers to fork
        mp.setattr("prague.simulate.run.simulate_bench", _accept)
        mp.chdir(root)
        yield root


def call(argv: list[str]) -> tuple[int | None, str]:
    """``prague ARGV`` in this process: (exit code, stderr); code None when validation accepted it."""
    from prague.cli import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code: int | None = main(argv)
    except Accepted:
        code = None
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 1
    return code, err.getvalue()


def check(argv: list[str]) -> None:
    """The property: accepted, or exit code 2 with one line saying what is wrong (no traceback)."""
    code, err = call(argv)
    if code is None:
        event("accepted")  # --hypothesis-show-statistics tells how many of each
        return
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (argv, code, err)
    assert lines[0].startswith("prague") and "error: " in lines[0], (argv, lines[0])
    event("refused: exit 2, one line")


# -- values -----------------------------------------------------------------------------------------------

# Any text an argv can carry (no NUL; lone surrogates are what Python makes of undecodable bytes).
TEXT = st.text(st.characters(blacklist_characters="\x00"), max_size=12)
JUNK = st.sampled_from(["", " ", "two", "1.5", "1e3", "0x10", " 3", "nan", "inf", "-inf", "1_000", "\u0663",
                        "-", "--", ":", ",", "+", "a\nb", "\udcff"])
HUGE = st.sampled_from([2**31, 2**63, 2**70, -(2**63), 10**6]).map(str)
INTS = st.one_of(st.integers(-3, 40).map(str), HUGE, JUNK)
SMALL = st.one_of(st.integers(1, 9).map(str), INTS)
FLOATS = st.one_of(st.floats(-5, 500).map(lambda x: f"{x:g}"), st.floats().map(repr),
                   st.sampled_from(["1e309", "-0", "1e-320", "1,5"]), JUNK)

METHOD_SPECS = sorted({m.name for m in METHODS.values()}
                      | {f"{m.name}:{v}" for m in METHODS.values() for v in m.variants})
METHOD = st.one_of(st.sampled_from(METHOD_SPECS), st.sampled_from(["nosuch", "prague:", "prague:smart:x",
                                                                   "allreduce:x", "PRAGUE", ":smart"]), TEXT)
METHOD_LIST = st.lists(METHOD, min_size=0, max_size=3).map(",".join)

RANK = st.one_of(st.integers(-2, 12).map(str), HUGE, JUNK)
FACTOR = st.one_of(st.sampled_from(["1", "2", "5", "0.5", "0"]), FLOATS)
TERM = st.one_of(
    st.just("homogeneous"),
    FACTOR.map(lambda x: f"paper:{x}"),
    st.tuples(RANK, FACTOR).map(lambda t: f"straggler:{t[0]}:{t[1]}"),
    st.tuples(st.sampled_from(["crash", "hang"]), RANK, RANK).map(lambda t: f"{t[0]}:{t[1]}:{t[2]}"),
    st.tuples(st.sampled_from(KINDS), st.lists(RANK, max_size=3)).map(lambda t: ":".join([t[0], *t[1]])),
    TEXT,
)
SCENARIO = st.lists(TERM, min_size=1, max_size=3).map("+".join)
SCENARIO_LIST = st.lists(SCENARIO, min_size=0, max_size=3).map(",".join)
ADDRESS = st.one_of(st.sampled_from(["127.0.0.1:5000", "localhost:1", "[::1]:80", "host", ":80", "h:", "h:-1",
                                     "h:65536", "h:port", "h:80:90", "[::1", "::1:80", "h :80"]), TEXT)
RANKS = st.one_of(st.lists(RANK, max_size=4).map(",".join), TEXT)


def _paths(root: Path, *names: str) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([str(root / n) for n in names]), TEXT)


def special_values(root: Path) -> dict[str, st.SearchStrategy[str]]:
    """Values of the flags with a grammar of their own, by ``dest``."""
    dirs = _paths(root, "empty", "file.txt", "missing/deeper", str(MNIST_DIR), "out")
    return {
        "algorithm": METHOD, "algorithms": METHOD_LIST, "slowdown": SCENARIO, "scenarios": SCENARIO_LIST,
        "nproc": SMALL, "nodes": SMALL, "group_size": SMALL, "batch_size": st.one_of(st.integers(1, 64).map(str), INTS),
        "data_dir": dirs, "out": _paths(root, "out", "file.txt", "empty", "file.txt/below", "/proc/no/such"),
        "resume": _paths(root, *(f"resume/{n}" for n in ("garbage", "list", "types", "options", "unknown", "inf")),
                         "empty", "missing"),
        "calibrate": _paths(root, *(f"bench/{n}" for n in os.listdir(root / "bench")), "missing", "empty"),
        "check": _paths(root, *(f"bench/{n}" for n in os.listdir(root / "bench")), "missing", "empty"),
        "cluster": st.one_of(st.sampled_from(sorted(PRESETS)), _paths(root, "cluster.toml", "file.txt", "missing")),
        "gg_address": ADDRESS, "adpsgd_active": RANKS, "math": st.one_of(st.sampled_from(["none", "real"]), TEXT),
        "compute_dist": st.one_of(st.sampled_from(DISTRIBUTIONS), TEXT),
    }


def option_choices() -> dict[str, tuple[str, ...]]:
    """The valid names of every name-valued method option (argparse leaves them to the method)."""
    return {name: tuple(c for _, info in declared for c in info.choices or ())
            for name, declared in all_options().items()}


def flag_values(parser: argparse.ArgumentParser, root: Path,
                plausible: bool) -> dict[str, st.SearchStrategy[str | None]]:
    """Every flag of ``parser`` (one sub-command) and a strategy for its value (None: a switch); with
    ``plausible``, numbers are mostly small and names mostly valid, so that more inputs pass the parser
    and reach the checks of whole combinations."""
    special, choices = special_values(root), option_choices()
    ints = st.one_of(st.integers(-1, 12).map(str), st.integers(1, 4).map(str), INTS) if plausible else INTS
    floats = st.one_of(st.floats(0, 10).map(lambda x: f"{x:g}"), FLOATS) if plausible else FLOATS
    out: dict[str, st.SearchStrategy[str | None]] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = max(action.option_strings, key=len)
        names = list(action.choices or choices.get(action.dest) or ())
        if not names and str(action.metavar or "").startswith("{"):
            names = str(action.metavar).strip("{}").split(",")
        if action.nargs == 0:
            out[flag] = st.none()
        elif action.dest in special:
            out[flag] = special[action.dest]
        elif names:
            valid = st.sampled_from(names)
            out[flag] = st.one_of(valid, valid, TEXT) if plausible else st.one_of(valid, TEXT)
        elif action.type is int:
            out[flag] = ints
        elif action.type is float:
            out[flag] = floats
        else:
            out[flag] = TEXT
    return out


@functools.cache
def _values(command: str, root: Path, plausible: bool) -> dict[str, st.SearchStrategy[str | None]]:
    from prague.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return flag_values(sub.choices[command], root, plausible)


OPTION_FLAGS = {info.flag for declared in all_options().values() for _, info in declared}


@st.composite
def command_lines(draw: st.DrawFn, command: str, root: Path) -> list[str]:
    """``[command, flags...]``: a few of the command's flags (sometimes repeated or unknown), each with a
    value as ``--flag value`` or ``--flag=value``. Half of them are coherent: known methods, only their
    options, plausible values (so the checks of combinations are reached: group size against
    ``--nproc``, ``--nproc`` against ``--nodes``, ranks of a scenario or of ``--adpsgd-active``...)."""
    from prague.algorithms.registry import parse_method

    argv = [command]
    coherent = draw(st.booleans())
    values = _values(command, root, coherent)
    flags = sorted(values)
    if coherent:
        methods = draw(st.lists(st.sampled_from(METHOD_SPECS), min_size=1, max_size=1 if command == "run" else 3,
                                unique=True))
        argv += ["--algorithm" if command == "run" else "--algorithms", ",".join(methods)]
        declared = {o.flag for m in methods for o in parse_method(m)[0].option_infos}
        declared |= {"--nodes"} if command == "simulate" else set()  # the simulated topology, for every method
        flags = [f for f in flags if (f not in OPTION_FLAGS or f in declared)
                 and f not in ("--algorithm", "--algorithms", "--resume")]
    for flag in draw(st.lists(st.sampled_from(flags), max_size=6)):
        value = draw(values[flag])
        if value is None:
            argv.append(flag)
        elif value.startswith("-") or draw(st.booleans()):
            argv.append(f"{flag}={value}")  # a value like -3 or -inf would read as a flag
        else:
            argv += [flag, value]
    if draw(st.integers(0, 9)) == 0:
        argv += draw(st.sampled_from([["--nosuch"], ["stray"], ["--nproc"]]))
    return argv


# -- the properties ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_any_flags_are_accepted_or_one_clear_line(command: str, place: Path) -> None:
    @FUZZ
    @given(argv=command_lines(command, place))
    def fuzz(argv: list[str]) -> None:
        check(argv)

    fuzz()


def test_known_good_command_lines_are_accepted(place: Path) -> None:
    """The fuzz's stand-ins are in place: well-formed commands stop where they would start running."""
    for argv in (["run", "--nproc", "2", "--steps", "1"], ["bench", "--algorithms", "allreduce,prague:smart"],
                 ["simulate", "--nproc", "8", "--nodes", "2", "--cluster", str(place / "cluster.toml")]):
        assert call(argv) == (None, ""), argv


# Cluster files: tables of the known sections and keys (and unknown ones) with values of every TOML type.
SCALAR = st.one_of(st.floats(0, 100), st.floats(), st.integers(-5, 10**6), st.booleans(), TEXT,
                   st.sampled_from(DISTRIBUTIONS), st.sampled_from(sorted(PRESETS)))
VALUE = st.one_of(SCALAR, st.lists(SCALAR, max_size=3), st.dictionaries(TEXT, SCALAR, max_size=2))
KEY = st.one_of(st.sampled_from(sorted({k for keys in CLUSTER_KEYS.values() for k in keys} | {"base", "name"})),
                TEXT)


def _toml_key(key: str) -> str:
    bare = key and all(c.isascii() and (c.isalnum() or c in "-_") for c in key)
    return key if bare else json.dumps(key, ensure_ascii=False)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else {"nan": "nan", "inf": "inf", "-inf": "-inf"}[repr(value)]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"


def toml_text(data: dict[str, Any]) -> str:
    """``data`` in TOML (tables as ``[section]`` / ``[section.sub]``; never fails, may be invalid TOML)."""
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, table in data.items():
        if isinstance(table, dict):
            lines.append(f"[{_toml_key(section)}]")
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
            for sub, inner in table.items():
                if isinstance(inner, dict):
                    lines.append(f"[{_toml_key(section)}.{_toml_key(sub)}]")
                    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in inner.items()]
    return "\n".join(lines) + "\n"


SECTION = st.dictionaries(KEY, st.one_of(VALUE, st.dictionaries(KEY, SCALAR, max_size=3)), max_size=4)
CLUSTER = st.dictionaries(st.one_of(st.sampled_from(sorted(k for k in CLUSTER_KEYS if k)), KEY),
                          st.one_of(SECTION, VALUE), max_size=5)


@st.composite
def cluster_files(draw: st.DrawFn) -> bytes:
    """A cluster file: generated TOML, that TOML garbled (cut, spliced with junk), or any bytes."""
    text = toml_text(draw(CLUSTER)).encode("utf-8", "surrogatepass")
    kind = draw(st.sampled_from(["toml", "toml", "garbled", "bytes"]))
    if kind == "garbled":
        cut = draw(st.integers(0, len(text)))
        return text[:cut] + draw(st.binary(max_size=8)) + text[cut + draw(st.integers(0, 8)):]
    return draw(st.binary(max_size=64)) if kind == "bytes" else text


def test_any_cluster_file_is_accepted_or_one_clear_line(place: Path) -> None:
    path = place / "fuzzed.toml"

    @FUZZ
    @given(content=cluster_files())
    def fuzz(content: bytes) -> None:
        path.write_bytes(content)
        check(["simulate", "--cluster", str(path), "--algorithms", "allreduce,prague:smart", "--nproc", "4",
               "--steps", "2"])

    fuzz()


# Saved run configurations (``prague run --resume OUT`` reads OUT/run.json).
RUN_FIELDS = ["algorithm", "scenario", "nproc", "out", "options", "epochs", "steps", "batch_size", "lr", "model",
              "data", "data_dir", "seed", "timeout_s", "lease_s", "checkpoint_every", "resume", "colour"]
JSON_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-5, 10), HUGE.map(int), st.floats(), TEXT,
                       st.sampled_from(METHOD_SPECS), st.lists(st.integers(0, 3), max_size=2),
                       st.dictionaries(st.sampled_from(["group_size", "nodes", "generator", "x"]),
                                       st.one_of(st.integers(-1, 9), TEXT), max_size=2))


def test_any_saved_run_is_resumed_or_one_clear_line(place: Path) -> None:
    folder = place / "resumed"
    folder.mkdir()

    @FUZZ
    @given(saved=st.one_of(st.dictionaries(st.sampled_from(RUN_FIELDS), JSON_VALUE, max_size=6), JSON_VALUE))
    def fuzz(saved: Any) -> None:
        (folder / "run.json").write_text(json.dumps(saved))
        check(["run", "--resume", str(folder)])

    fuzz()
