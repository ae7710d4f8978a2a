"""One description per method: the registry, what is derived from it, and what a worker imports."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from prague.algorithms.api import Algorithm
from prague.algorithms.registry import METHODS, parse_method
from prague.cli import main
from prague.errors import ConfigError
from prague.sim.method import SimMethod
from prague_testing import REPO

SRC = REPO / "src" / "prague"


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_is_complete(name: str) -> None:
    method = METHODS[name]
    assert issubclass(method.runtime_class(), Algorithm)
    assert issubclass(method.sim_class(), SimMethod)
    defaults = method.make_options()
    # a method whose default variant is the method itself (allreduce is DDP) names it by the plain name
    assert method.variant_of(defaults) == (None if method.plain_default else method.default_variant)
    for variant in method.variants:
        assert parse_method(f"{name}:{variant}") == (method, variant)
        named = None if method.plain_default and variant == method.default_variant else variant
        assert method.variant_of(method.make_options({}, variant)) == named
        assert issubclass(method.runtime_class(variant), Algorithm)
        assert issubclass(method.sim_class(variant), SimMethod)
    assert all(o.help for o in method.option_infos), "every option has help text"


def test_bad_names_list_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="valid choices: .*allreduce"):
        parse_method("nosuch")
    with pytest.raises(ConfigError, match="no variants"):
        parse_method("dssync:fast")
    with pytest.raises(ConfigError, match="backup, balanced, ddp, drop"):
        parse_method("allreduce:fast")
    with pytest.raises(ConfigError, match="random, ready, smart, smart-blind, static, static-blind"):
        parse_method("prague:fast")


def test_methods_json_lists_every_method_and_variant(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in listed] == list(METHODS)
    for entry in listed:
        method = METHODS[entry["name"]]
        assert entry["variants"] == list(method.variants)
        assert {o["name"]: o["default"] for o in entry["options"]} == {o.name: o.default for o in method.option_infos}


def _imports(path: Path) -> set[str]:
    """Every prague module ``path`` imports, at any depth of the file (function-level imports too)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("prague")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prague") and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_no_import_cycle_in_src() -> None:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {name: sorted(m for m in _imports(path) if m in files and m != name) for name, path in files.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


WORKER_IMPORTS = """
import sys
from prague.cli import build_parser
build_parser(only="worker").parse_args(["worker", "--algorithm", "prague", "--data", "synthetic"])
import prague.train.loop, prague.runtime.worker
from prague.algorithms.registry import METHODS
for method in METHODS.values():
    method.runtime_class()
from prague.workload.data import load_dataset
load_dataset("synthetic")
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("matplotlib", "sklearn")
             or m == "prague.sim" or m.startswith(("prague.sim.", "prague.simulate")))
print(",".join(bad))
"""


def test_a_worker_imports_neither_the_simulator_nor_plotting_nor_sklearn() -> None:
    out = subprocess.run([sys.executable, "-c", WORKER_IMPORTS], capture_output=True, text=True, timeout=120,
                         check=True).stdout.strip()
    assert out == "", f"a worker process imported {out}"


def test_help_does_not_import_torch() -> None:
    code = ("import sys\nfrom prague.cli import build_parser\nbuild_parser()\n"
            "print(','.join(m for m in ('torch', 'matplotlib', 'sklearn', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout.strip()
    assert out == "", f"building the parser imported {out}"


def test_options_are_checked_against_the_size_of_the_job() -> None:
    from prague.algorithms.registry import get_method

    prague_method, dssync = get_method("prague"), get_method("dssync")
    prague_method.check_job(prague_method.make_options({}), 2)  # the default group size shrinks to the job
    dssync.check_job(dssync.make_options({"group_size": 4}), 4)
    with pytest.raises(ConfigError, match="--group-size 5 is larger than the job"):
        dssync.check_job(dssync.make_options({"group_size": 5}), 4)
    with pytest.raises(ConfigError, match="--nodes 4"):
        prague_method.check_job(prague_method.make_options({"nodes": 4}), 6)
    adpsgd = get_method("adpsgd")
    with pytest.raises(ConfigError, match=r"\[5\]"):
        adpsgd.check_job(adpsgd.make_options({"adpsgd_active": "0,5"}), 4)
    get_method("eager-sgd").check_job(get_method("eager-sgd").make_options({}), 1)


def test_listing_the_methods_and_the_help_start_without_torch() -> None:
    """``prague methods`` and ``prague --help`` answer at once: no option of any method imports torch."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\n"
            "from prague.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['methods'])\n"
            "    try:\n"
            "        main(['--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_only_the_job_environment_module_touches_the_environment() -> None:
    """Every environment variable is read and written in ``prague/jobenv.py`` alone (os.environ, getenv,
    putenv, unsetenv, or ``environ`` imported from os), so a job's variables have one owner."""
    touched = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "jobenv.py" and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                    and node.attr in ("environ", "environb", "getenv", "putenv", "unsetenv"):
                touched.append(f"{path.relative_to(SRC)}:{node.lineno} os.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                    and any(a.name in ("environ", "getenv", "putenv") for a in node.names):
                touched.append(f"{path.relative_to(SRC)}:{node.lineno} from os import")
    assert not touched, f"read or write the environment through prague.jobenv instead: {touched}"


#: The process entry points that read the job's environment (``jobenv.current()``): the CLI, a worker's and a
#: guard's start, the forkserver, the launcher link of a child, the services' mains. Everything below them
#: gets the value passed down (a worker's in its context, ``DistContext.job``).
ENVIRONMENT_READERS = {"cli.py", "jobenv.py", "runtime/worker.py", "runtime/forkserver.py", "runtime/guard.py",
                       "runtime/parent.py", "runtime/context.py", "net/hosts.py", "groups/service.py",
                       "algorithms/ps/server.py"}


def test_the_job_environment_is_read_at_the_entry_points_and_passed_down() -> None:
    """``jobenv.current()`` (a read of the process environment) is called by the entry points alone; a
    method, the training loop, the communication layer and the metrics take the value they are given."""
    readers = set()
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "current" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "jobenv":
                readers.add(path.relative_to(SRC).as_posix())
    assert readers <= ENVIRONMENT_READERS, f"pass the JobEnv down instead: {sorted(readers - ENVIRONMENT_READERS)}"
    assert "train/prepared.py" not in readers and "algorithms/prague/source.py" not in readers


def test_every_thread_of_the_package_is_started_by_the_background_work_primitive() -> None:
    """No module but ``prague/runtime/background.py`` makes a thread (``threading.Thread``, a ``Timer``,
    a thread pool, ``_thread``), so every thread has one stop and one error path and shows in
    ``live_works()``."""
    made = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).as_posix() == "runtime/background.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("Thread", "Timer", "ThreadPoolExecutor",
                                                                 "start_new_thread"):
                made.append(f"{path.relative_to(SRC)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module in ("threading", "concurrent.futures", "_thread") \
                    and any(a.name in ("Thread", "Timer", "ThreadPoolExecutor", "start_new_thread") for a in node.names):
                made.append(f"{path.relative_to(SRC)}:{node.lineno} from {node.module} import")
    assert not made, f"run the thread on prague.runtime.background (FunctionWork, PeriodicWork...): {made}"


@pytest.mark.parametrize(("method", "options", "message"), [
    ("prague", {"group_size": "abc"}, r"option group_size of method 'prague' takes an int \(the CLI's --group-size\), "
                                      r"got 'abc' \(str\)"),
    ("prague", {"group_size": 2.0}, "takes an int"),
    ("prague", {"group_size": True}, "takes an int"),
    ("prague", {"gg_address": 3}, r"takes a str \(the CLI's --gg-address\), got 3 \(int\)"),
    ("diloco", {"outer_lr": "0.7"}, "option outer_lr of method 'diloco' takes a float"),
])
def test_options_given_through_python_are_checked_by_type_with_the_flag(method: str, options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        METHODS[method].make_options(options)


def test_an_int_given_for_a_float_option_is_taken_as_a_float() -> None:
    options = METHODS["diloco"].make_options({"outer_lr": 1})
    assert options.outer_lr == 1.0 and isinstance(options.outer_lr, float)


def test_no_module_counts_its_instances_to_name_store_keys() -> None:
    """Store keys are named from the namespace a component is given (DistContext.namespace), never from a
    module-wide counter of instances (itertools.count()), which names them right only if every rank
    builds every object of the process in the same order."""
    counters = [f"{p.relative_to(SRC)}" for p in SRC.rglob("*.py") if "itertools.count(" in p.read_text()]
    assert not counters, counters


def test_gone_flags_are_parsed_to_say_what_replaced_them_but_not_offered_in_help() -> None:
    """A flag whose help starts with "gone:" is still parsed (its refusal names the replacement) and left
    out of every subcommand's --help."""
    import contextlib
    import io

    from prague.train.config import RunConfig

    gone = [f.name for f in dataclasses.fields(RunConfig) if str(f.metadata.get("help", "")).startswith("gone:")]
    assert gone, "no gone flag to check"
    for command in ("run", "bench", "simulate"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--eval-every-s" in out.getvalue()  # the replacement is offered
        for name in gone:
            assert f"--{name.replace('_', '-')} " not in out.getvalue(), (command, name)
