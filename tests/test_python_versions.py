"""Every file in src/prague runs on the oldest Python that pyproject.toml promises: requires-python.

vermin (a dev dependency) reads each file and names the newest language feature, module or function
it uses; the check fails when any file needs a newer Python than the promised minimum. The second
test feeds the same check files that need 3.11, so the check is shown to be able to fail.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same API from the tomli backport
    import tomli as tomllib

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        importlib.util.find_spec("vermin") is None,
        reason="vermin is not installed (it is in the dev extra: pip install -e '.[dev]')",
    ),
]

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "prague"

# vermin 1.9.2 has no ``__main__`` module, so ``python -m vermin`` does not work; call its entry
# point the way its console script does, with the interpreter running the tests.
VERMIN = [sys.executable, "-c", "import sys; from vermin import main; sys.exit(main())"]


def minimum_python() -> tuple[int, int]:
    """The lower bound of ``requires-python`` in pyproject.toml: ``">=3.10"`` -> ``(3, 10)``."""
    with open(ROOT / "pyproject.toml", "rb") as fh:
        spec = tomllib.load(fh)["project"]["requires-python"]
    lower = [m for part in spec.split(",") if (m := re.fullmatch(r"\s*>=\s*(\d+)\.(\d+)\s*", part))]
    assert len(lower) == 1, f"requires-python {spec!r}: expected exactly one '>=X.Y' lower bound"
    return int(lower[0].group(1)), int(lower[0].group(2))


def run_vermin(paths: list[Path], minimum: tuple[int, int]) -> subprocess.CompletedProcess[str]:
    """vermin over ``paths``; exit code 1 when some file needs a Python newer than ``minimum``."""
    command = [
        *VERMIN,
        # Ignore any vermin.ini / setup.cfg [vermin] section: the flags here are the whole check.
        "--no-config-file",
        # 'X.Y-' means "X.Y or older": every file's minimum must be <= the promised minimum.
        # (Without the '-', vermin would demand that the overall minimum equal X.Y exactly.)
        f"--target={minimum[0]}.{minimum[1]}-",
        # Report only the offending lines (file, feature, version needed), no tips or advice.
        "--violations",
        "--no-tips",
        # The annotated modules have `from __future__ import annotations`, so annotations are not
        # evaluated on import; but prague.train.config and prague.algorithms.spec call
        # typing.get_type_hints(), which evaluates them at run time. So judge annotations as code:
        # `list[int]` needs 3.9 and, with the union-types feature, `X | Y` needs 3.10.
        "--eval-annotations",
        "--feature",
        "union-types",
        # No --backport: vermin's backport list has nothing this package uses. The 3.10 fallback
        # for tomllib (`if sys.version_info >= (3, 11): import tomllib / else: import tomli as
        # tomllib`) is an if/else import pair, which vermin accepts as version-independent.
        "--no-backport",
        *(str(p) for p in paths),
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=180, cwd=ROOT, check=False
    )


def meets(paths: list[Path], minimum: tuple[int, int]) -> tuple[bool, str]:
    """Whether vermin finds every file in ``paths`` runnable on ``minimum``, and its report."""
    result = run_vermin(paths, minimum)
    output = result.stdout + result.stderr
    assert "Analyzing" in output, f"vermin analysed nothing:\n{output}"
    # A file the running interpreter cannot parse (e.g. `except*` read by vermin on 3.10) is
    # reported as "error: invalid syntax" without a non-zero exit, so count that as a failure too.
    if result.returncode != 0 or re.search(r"^\s*error:", output, re.MULTILINE):
        return False, output
    # Belt and braces: the overall minimum vermin reports is not newer than the promise.
    found = re.search(r"^Minimum required versions:(.*)$", output, re.MULTILINE)
    assert found is not None, output
    needed = [(3, int(m)) for m in re.findall(r"\b3\.(\d+)\b", found.group(1))]
    return all(v <= minimum for v in needed), output


def test_requires_python_is_met_by_every_source_file() -> None:
    minimum = minimum_python()
    ok, output = meets([SRC], minimum)
    assert ok, f"some files need a Python newer than requires-python ({minimum}):\n{output}"


SAMPLES = {
    "tomllib_unguarded": ("import tomllib\n\nDATA = tomllib.loads('a = 1')\n", "'tomllib' module"),
    "except_star": ("try:\n    raise ValueError()\nexcept* ValueError:\n    pass\n", "except*"),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_check_fails_on_a_file_that_needs_python_3_11(tmp_path: Path, name: str) -> None:
    source, feature = SAMPLES[name]
    sample = tmp_path / f"{name}.py"
    sample.write_text("from __future__ import annotations\n\n" + source, encoding="utf-8")
    # The same check as on src/prague, against the 3.10 minimum these samples are meant to break.
    ok, output = meets([sample], (3, 10))
    assert not ok, output
    if sys.version_info >= (3, 11) or "invalid syntax" not in output:
        # vermin could parse the sample, so it names the feature and the version it needs.
        assert feature in output and "requires !2, 3.11" in output, output
        assert "Target versions not met:   3.10-" in output, output
