"""``prague simulate --huge-pages``: when a simulation starts itself again on glibc's malloc with huge pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prague.errors import ConfigError
from prague.simulate.memory import (
    AUTO_FROM_WORKERS, TUNABLE, active, allocator, environment, unsupported, wanted,
)

SRC = Path(__file__).resolve().parents[2] / "src"


def test_auto_turns_on_from_the_threshold_on_a_machine_that_allows_it() -> None:
    assert not wanted("auto", AUTO_FROM_WORKERS - 1, None)
    assert wanted("auto", AUTO_FROM_WORKERS, None)
    assert not wanted("auto", 10 * AUTO_FROM_WORKERS, "transparent huge pages are off")
    assert wanted("on", 8, None) and not wanted("off", 10 * AUTO_FROM_WORKERS, None)


def test_on_where_the_machine_cannot_names_the_reason_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"glibc 2\.35.*--huge-pages off"):
        wanted("on", 8, "this is glibc 2.31; huge pages for malloc (glibc.malloc.hugetlb) need glibc 2.35 or later")
    with pytest.raises(ConfigError, match="auto, on, off"):
        wanted("sometimes", 8, None)


def test_the_reasons_a_machine_cannot(tmp_path: Path) -> None:
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    reason = unsupported(never)
    if reason is not None and "huge pages are off" not in reason:  # not Linux or not glibc 2.35+: that reason
        assert "glibc" in reason or "Linux" in reason
        return
    assert reason is not None and "[never]" in reason
    never.write_text("always [madvise] never\n")
    assert unsupported(never) is None
    assert "cannot be read" in (unsupported(tmp_path / "missing") or "")


def test_the_environment_keeps_other_tunables_and_is_recognised() -> None:
    env = environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0", "HOME": "/h"})
    assert env["PYTHONMALLOC"] == "malloc" and env["HOME"] == "/h"
    assert env["GLIBC_TUNABLES"].split(":") == ["glibc.malloc.arena_max=2", TUNABLE]
    assert active(env) and allocator(env) == "glibc malloc on transparent huge pages"
    assert not active({}) and allocator({}) == "pymalloc" and allocator({"PYTHONMALLOC": "malloc"}) == "malloc"


def _simulate(tmp_path: Path, *flags: str) -> dict[str, object]:
    out = tmp_path / "sim"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONMALLOC", "GLIBC_TUNABLES")}
    env["PYTHONPATH"] = str(SRC)
    done = subprocess.run([sys.executable, "-m", "prague", "simulate", "--algorithms", "prague", "--scenarios",
                           "homogeneous", "--nproc", "8", "--nodes", "2", "--steps", "5", "--quiet", "--out", str(out),
                           *flags], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    sim: dict[str, object] = json.loads((out / "bench.json").read_text())["records"][0]["sim"]
    return sim


@pytest.mark.timeout(240)
def test_the_command_starts_itself_again_on_huge_pages_and_says_so(tmp_path: Path) -> None:
    """`--huge-pages on` runs the same command on glibc's malloc with huge pages (the record says which allocator
    ran); `auto` at 8 workers keeps CPython's own."""
    reason = unsupported()
    if reason is not None:
        pytest.skip(f"this machine cannot: {reason}")
    assert _simulate(tmp_path / "on", "--huge-pages", "on")["allocator"] == "glibc malloc on transparent huge pages"
    assert _simulate(tmp_path / "auto")["allocator"] == "pymalloc"
