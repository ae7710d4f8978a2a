"""The documentation: README.md stays a front door, docs/ builds as a strict MkDocs site, links and
named modules exist, and every shell or Python block either runs in a test or says why it does not.

Marking a fenced block whose language is bash, sh, shell, console or python, in README.md or any page
under docs/: the line right before its opening fence is one of

    <!-- not run: REASON -->
    <!-- run: tests/test_docs.py::TEST -->

where REASON says briefly what the block needs ("needs torchrun on two machines"), and TEST is one of
this file's block runners (:data:`RUNNERS`), which finds the blocks that name it and runs each of them.
So a block marked as run is run, and a new block without a marker fails
:func:`test_every_shell_and_python_block_is_marked`.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "prague"
README = ROOT / "README.md"
DOCS = ROOT / "docs"
THIS_FILE = "tests/test_docs.py"

README_MAX_LINES = 200
MARKED_LANGUAGES = {"bash", "sh", "shell", "console", "python"}
MARKER = re.compile(r"^<!-- (?:not run: (?P<reason>.+?)|run: (?P<test>\S+)) -->$")
#: The tests of this file that run the blocks naming them, and what each runs.
RUNNERS = {
    "test_cheap_commands_in_the_docs_run": "`prague --help`-like commands that start no worker",
    "test_readme_python_quick_start_runs": "a Python script, alone (a job of one)",
}
#: Variables of `prague launch` and torchrun: without them a script joins no job and runs as a job of one.
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_USE_AGENT_STORE")


def pages() -> list[Path]:
    """README.md and every Markdown page of the site."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its text, and the marker line before it."""

    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    marker: str

    @property
    def where(self) -> str:
        return f"{rel(self.page)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found: list[Block] = []
    opened: tuple[int, str] | None = None
    for i, line in enumerate(lines):
        if not line.startswith("```"):
            continue
        if opened is None:
            opened = (i, line[3:].strip().split(" ")[0].lower())
        else:
            start, language = opened
            marker = lines[start - 1].strip() if start > 0 else ""
            found.append(Block(page, start + 1, language, "\n".join(lines[start + 1:i]), marker))
            opened = None
    assert opened is None, f"{rel(page)}:{opened[0] + 1}: a fenced block is never closed"
    return found


def marked_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks(page) if b.language in MARKED_LANGUAGES]


def blocks_run_by(test: str) -> list[Block]:
    """The blocks whose marker names ``test`` of this file; a runner with none fails, so none is idle."""
    mine = [b for b in marked_blocks() if b.marker == f"<!-- run: {THIS_FILE}::{test} -->"]
    assert mine, f"no block is marked to be run by {test}; mark one or remove the runner"
    return mine


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}


# -- the site -----------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (it is in the dev extra: pip install -e '.[dev]')")
def test_site_builds_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "DistributedTrainer" in api, "the API page shows nothing generated from the docstrings"


def test_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < README_MAX_LINES, "README.md is the front door: move details to docs/"
    assert "make test" in text, "CI runs the test command README.md states: `make test`"


# -- code blocks --------------------------------------------------------------------------------------
def test_every_shell_and_python_block_is_marked() -> None:
    problems = []
    for block in marked_blocks():
        match = MARKER.match(block.marker)
        if match is None:
            problems.append(f"{block.where}: a {block.language} block needs `<!-- not run: REASON -->` or "
                            f"`<!-- run: {THIS_FILE}::TEST -->` on the line before it")
            continue
        test = match.group("test")
        if test is None:
            continue
        path, _, name = test.partition("::")
        if not (ROOT / path).exists() or name not in defined_tests(ROOT / path):
            problems.append(f"{block.where}: the marker names {test}, which does not exist")
        elif path != THIS_FILE or name not in RUNNERS:
            problems.append(f"{block.where}: {test} does not run marked blocks; name one of "
                            f"{', '.join(f'{THIS_FILE}::{r}' for r in RUNNERS)}")
    assert not problems, "\n".join(problems)


def test_every_marker_stands_before_a_block() -> None:
    problems = []
    for page in pages():
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if MARKER.match(line.strip()) and not (i + 1 < len(lines) and lines[i + 1].startswith("```")):
                problems.append(f"{rel(page)}:{i + 1}: a block marker must stand right before a fenced block")
    assert not problems, "\n".join(problems)


def test_the_runners_exist() -> None:
    assert set(RUNNERS) <= defined_tests(Path(__file__))


def _commands(block: Block) -> list[list[str]]:
    return [argv for line in block.text.splitlines() if (argv := shlex.split(line, comments=True))]


#: Runs `prague` commands in one interpreter (the CLI's imports are paid once): argv lists in, JSON out.
_CLI_DRIVER = """
import contextlib, io, json, sys
from prague.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results.append({"code": code or 0, "out": out.getvalue()})
print(json.dumps(results))
"""


def test_cheap_commands_in_the_docs_run(tmp_path: Path) -> None:
    """Each line of the blocks marked for this test is a `prague` command that starts no worker (a help
    text, the method list): it must exit 0 and print something."""
    commands: dict[str, tuple[str, list[str]]] = {}
    for block in blocks_run_by("test_cheap_commands_in_the_docs_run"):
        for argv in _commands(block):
            assert argv[0] == "prague", f"{block.where}: {shlex.join(argv)} is not a prague command"
            cheap = "--help" in argv or "-h" in argv or argv[1:2] == ["methods"]
            assert cheap, f"{block.where}: {shlex.join(argv)} may start workers: mark the block `not run`"
            commands.setdefault(shlex.join(argv), (block.where, argv[1:]))
    done = subprocess.run([sys.executable, "-c", _CLI_DRIVER, json.dumps([a for _, a in commands.values()])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    for (command, (where, _)), result in zip(commands.items(), json.loads(done.stdout.splitlines()[-1])):
        assert result["code"] == 0 and result["out"].strip(), f"{where}: {command} exited {result['code']}"


@pytest.mark.timeout(150)
def test_readme_python_quick_start_runs(tmp_path: Path) -> None:
    """The README's Python quick start, started alone: `prague.init()` then makes a job of one."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    for i, block in enumerate(blocks_run_by("test_readme_python_quick_start_runs")):
        script = tmp_path / f"block{i}.py"
        script.write_text(block.text + "\n")
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"{block.where} failed:\n{done.stdout}\n{done.stderr}"


# -- links, names and generated tables ----------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    from markdown.extensions.toc import slugify  # installed with mkdocs

    headings = [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]
    return {slugify(h.replace("`", ""), "-") for h in headings}


@pytest.mark.skipif(importlib.util.find_spec("markdown") is None, reason="markdown (with mkdocs) is not installed")
def test_relative_links_resolve() -> None:
    problems = []
    for page in pages():
        in_block = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            in_block ^= line.startswith("```")
            if in_block:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http:, https:, mailto:
                path, _, anchor = target.partition("#")
                linked = (page.parent / path).resolve() if path else page
                if not linked.exists():
                    problems.append(f"{rel(page)}:{number}: {target}: no such file")
                elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                    problems.append(f"{rel(page)}:{number}: {target}: no heading with that anchor")
    assert not problems, "\n".join(problems)


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _path_exists(token: str) -> bool:
    """A path as the docs write it: from the repository root (`tests/...`, `src/prague/...`), from
    `src/` (`prague/...`), from `src/prague/` (`comm/preduce.py`), or inside `algorithms/` (a method's
    package: `ps/rules.py`)."""
    return any((base / token).exists() for base in (ROOT, ROOT / "src", SRC, SRC / "algorithms"))


def _module_exists(dotted: str) -> bool:
    """`prague.a.b` is a module or package in src/, or names something in the longest such prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT / "src" / Path(*parts[:i])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.exists():
            rest = parts[i:i + 1]
            return not rest or re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()) is not None
    return False


#: The worked example of adding a method in ARCHITECTURE.md names a package that does not exist, on purpose.
EXAMPLE_METHOD = "gossip"


def _missing_names(page: Path, *, bare_files: bool) -> list[str]:
    missing = []
    for span in _code_spans(page.read_text()):
        for token in re.findall(r"[\w./<>-]+", span):
            if "<" in token or token.startswith(("OUT/", "runs/")) or EXAMPLE_METHOD in token:
                continue
            if re.search(r"\.(py|proto)$", token) and "/" in token:
                if not _path_exists(token):
                    missing.append(token)
            elif bare_files and re.fullmatch(r"\w+\.(py|proto)", token):
                if not any(SRC.rglob(token)):
                    missing.append(token)
            elif bare_files and re.fullmatch(r"[\w/]+/", token):
                if not _path_exists(token.rstrip("/")):
                    missing.append(token)
        missing += [m for m in re.findall(r"\bprague(?:\.\w+)+", span) if not _module_exists(m)]
    return missing


def test_architecture_names_only_modules_that_exist() -> None:
    """Every module, file and folder docs/ARCHITECTURE.md names (`train/loop.py`, `groups/`, `errors.py`,
    `prague.comm.preduce`) exists in src/."""
    missing = _missing_names(DOCS / "ARCHITECTURE.md", bare_files=True)
    assert not missing, f"docs/ARCHITECTURE.md names what src/ does not have: {sorted(set(missing))}"


def test_other_pages_name_only_modules_that_exist() -> None:
    """The other pages: every path with a folder (`prague/metrics/record.py`, `examples/custom_loop.py`)
    and every dotted `prague.` name."""
    missing = {rel(p): m for p in pages() if p.name != "ARCHITECTURE.md" if (m := _missing_names(p, bare_files=False))}
    assert not missing, f"pages name modules or files that do not exist: {missing}"


def _between(text: str, start: str, end: str) -> str:
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def test_generated_tables_in_the_docs_are_current() -> None:
    from prague.metrics.record import fields_markdown

    methods = subprocess.run([sys.executable, "-m", "prague", "methods", "--markdown"], capture_output=True,
                             text=True, timeout=60, check=True).stdout.strip()
    page = (DOCS / "methods.md").read_text()
    assert _between(page, "<!-- methods table: generated by `prague methods --markdown`; a test keeps it in sync -->",
                    "<!-- end methods table -->") == methods
    page = (DOCS / "running.md").read_text()
    assert _between(page, "<!-- record fields: generated from prague.metrics.record.fields_markdown(); a test keeps "
                          "it in sync -->", "<!-- end record fields -->") == fields_markdown()


#: A generated report: `<!-- prague report [--tta] FILE -->` (or `--decide FILE...`), a blank line, what
#: `prague report` prints with those arguments (FILE: a bench.json or a benchmark's JSON, from the repository
#: root), a blank line, `<!-- end report -->`.
REPORT_START = re.compile(r"^<!-- prague report (?:--tta |--decide )?(?P<path>\S+(?: \S+)*?) -->$", re.M)
REPORT_BLOCK = re.compile(r"^<!-- prague report (?P<flag>--tta |--decide )?(?P<path>\S+(?: \S+)*?) -->\n"
                          r"(?P<text>.*?)^<!-- end report -->$", re.M | re.S)
#: Set to 1 to rewrite the generated reports of README.md and docs/ instead of failing on a stale one.
UPDATE_REPORTS = "PRAGUE_UPDATE_REPORTS"


def test_generated_reports_in_the_docs_are_current() -> None:
    """Every generated report in README.md and docs/ holds exactly what `prague report FILE` prints today
    (for a bench.json the function that writes its bench.md; for another benchmark's JSON its table): a
    table cannot drift from the data it names."""
    from prague.metrics.tables import decision_table, read_decision, report_file

    def report(block: re.Match[str]) -> str:
        paths = [ROOT / p for p in block["path"].split()]
        if block["flag"] == "--decide ":
            return decision_table(read_decision(paths))
        assert len(paths) == 1, f"`prague report` without --decide reads one file: {block['path']}"
        return report_file(paths[0], tta_only=block["flag"] == "--tta ")

    problems, stale, found = [], [], 0
    for page in pages():
        text = page.read_text()
        blocks = list(REPORT_BLOCK.finditer(text))
        if len(blocks) != len(REPORT_START.findall(text)):
            problems.append(f"{rel(page)}: a `<!-- prague report FILE -->` without its `<!-- end report -->`")
            continue
        fresh = text
        for block in reversed(blocks):
            found += 1
            expected = f"\n{report(block)}\n"
            if block["text"] != expected:
                stale.append(f"{rel(page)}:{text.count(chr(10), 0, block.start()) + 1}: the report of "
                             f"{block['path']} is not what `prague report {block['path']}` prints")
                fresh = fresh[:block.start("text")] + expected + fresh[block.end("text"):]
        if fresh != text and os.environ.get(UPDATE_REPORTS) == "1":
            page.write_text(fresh)
    assert not problems, "\n".join(problems)
    assert found, "no generated report in README.md or docs/: the check has nothing to check"
    assert not stale or os.environ.get(UPDATE_REPORTS) == "1", "\n".join(stale) + (
        f"\n(rewrite them: {UPDATE_REPORTS}=1 .venv/bin/python -m pytest {THIS_FILE} -k reports)")
