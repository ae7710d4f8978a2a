"""The compiled build of the simulator's hot path (``make compiled``): refused when older than its source, and
taking the very decisions of the pure build (``make test-compiled`` runs the simulator's tests against it)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

import prague
from prague import native

SRC = Path(prague.__file__).resolve().parent.parent


def _tree(root: Path) -> Path:
    """A source tree holding every module of COMPILED (one line each), as ``make compiled`` sees it."""
    src = root / "src"
    for path in native.COMPILED:
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_text(f"# {path}\n")
    return src


def _compile(src: Path, *paths: str) -> None:
    """Put an extension file beside each of ``paths``, as the build does (only their presence is checked)."""
    for path in paths:
        source = src / path
        (source.parent / (source.name[: -len(".py")] + EXTENSION_SUFFIXES[0])).write_bytes(b"\x7fELF")


def test_a_tree_without_extensions_is_pure(tmp_path: Path) -> None:
    assert native.state(_tree(tmp_path)) == "pure"


def test_a_fresh_build_is_reported_with_its_modules(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    _compile(src, native.COMPILED[0], native.COMPILED[-1])
    manifest = native.write_manifest(src, src / "prague")
    assert json.loads(manifest.read_text())[native.COMPILED[0]] == hashlib.sha256(
        (src / native.COMPILED[0]).read_bytes()).hexdigest()
    assert native.state(src) == "compiled (2 modules)"


def test_a_source_edited_after_the_build_is_refused_with_the_fix(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    edited, kept = native.COMPILED[1], native.COMPILED[2]
    _compile(src, edited, kept)
    native.write_manifest(src, src / "prague")
    (src / edited).write_text("# edited after the build\n")
    with pytest.raises(native.StaleBuildError, match="make compiled") as caught:
        native.state(src)
    assert edited in str(caught.value) and kept not in str(caught.value)
    # A module edited but never compiled is not stale: its source is what runs.
    native.write_manifest(src, src / "prague")
    (src / native.COMPILED[3]).write_text("# not compiled\n")
    assert native.state(src) == "compiled (2 modules)"


def test_extensions_without_a_manifest_are_refused(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    _compile(src, native.COMPILED[0])
    with pytest.raises(native.StaleBuildError, match="native_manifest.json.*make clean-compiled"):
        native.state(src)
    (src / "prague" / native.MANIFEST).write_text("{not json")
    with pytest.raises(native.StaleBuildError, match="readable"):
        native.state(src)


def test_an_extension_the_build_no_longer_compiles_is_refused(tmp_path: Path) -> None:
    """A module dropped from COMPILED (or moved) leaves its extension from an older build, which would shadow the
    source as silently as a stale one: refused, naming it, while a shared library without a source is not."""
    src = _tree(tmp_path)
    _compile(src, native.COMPILED[0])
    native.write_manifest(src, src / "prague")
    (src / "prague" / ("native_lib__mypyc" + EXTENSION_SUFFIXES[0])).write_bytes(b"\x7fELF")  # no source: kept
    assert native.state(src) == "compiled (1 modules)"
    dropped = "prague/groups/api.py"
    (src / dropped).write_text("# the interface, not compiled\n")
    _compile(src, dropped)
    with pytest.raises(native.StaleBuildError, match="no longer compiles: prague/groups/api.py.*make clean-compiled"):
        native.state(src)


def _pure_copy(src: Path) -> Path:
    """This package's sources under ``src``, without any compiled module: the pure build."""
    shutil.copytree(SRC / "prague", src / "prague",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", native.MANIFEST))
    return src


def test_import_prague_refuses_a_stale_build(tmp_path: Path) -> None:
    """The check runs where it protects: ``import prague``, before any extension could shadow its source."""
    copy = _pure_copy(tmp_path / "src")
    _compile(copy, "prague/sim/engine.py")
    native.write_manifest(copy, copy / "prague")
    with (copy / "prague/sim/engine.py").open("a") as f:
        f.write("\n# an edit the build has not seen\n")
    env = {**os.environ, "PYTHONPATH": str(copy)}
    done = subprocess.run([sys.executable, "-c", "import prague"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert "StaleBuildError" in done.stderr and "prague/sim/engine.py" in done.stderr and "make compiled" in done.stderr


# Small simulations that reach every compiled part: the generators (ready, smart), overlap off, crashes and
# hangs, random failures with restarts charged, cross traffic with 8-bit messages, and the other methods.
_CONFIGS = [
    "--algorithms prague --scenarios paper:5 --nproc 128 --nodes 16 --steps 30",
    "--algorithms prague --generator smart --scenarios straggler:3:4 --nproc 32 --nodes 8 --steps 30",
    "--algorithms prague --overlap off --scenarios crash:3:10+hang:5:15 --nproc 16 --nodes 4 --steps 30",
    "--algorithms prague,allreduce --scenarios failures:0.5 --nproc 16 --nodes 4 --steps 80",
    "--algorithms prague,allreduce --scenarios homogeneous --nproc 16 --hosts 4 --cross-traffic bursts:0.3:20 "
    "--steps 20 --compress int8",
    "--algorithms allreduce:backup,allreduce:balanced,allreduce:drop,adpsgd,localsgd,diloco,dssync,ps,ps-eager,"
    "eager-sgd,lossy --scenarios paper:5 --nproc 8 --nodes 2 --steps 20",
]
_MEASURED = {"run_s", "build", "policy_us_per_call", "policy_core_share", "command"}


def _records(src: Path, args: str, out: Path) -> list:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "prague", "simulate", *args.split(), "--model", "resnet18", "--compute", "emulated",
           "--compute-ms", "100", "--quiet", "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

    def strip(x: object) -> object:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in _MEASURED}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    records = json.loads((out / "bench.json").read_text())["records"]
    assert records
    return strip(records)  # type: ignore[return-value]


@pytest.mark.skipif(prague.BUILD == "pure", reason="the pure build runs: `make test-compiled` tests the compiled one")
@pytest.mark.timeout(600)
def test_the_compiled_build_takes_the_pure_builds_decisions(tmp_path: Path) -> None:
    pure = _pure_copy(tmp_path / "pure")
    for k, args in enumerate(_CONFIGS):
        assert _records(SRC, args, tmp_path / f"c{k}") == _records(pure, args, tmp_path / f"p{k}"), args
