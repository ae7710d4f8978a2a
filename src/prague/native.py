"""Which build of the simulator's hot path is imported: pure Python, or compiled with mypyc.

``make compiled`` (``PRAGUE_COMPILE=1`` for any build, see ``setup.py``) compiles the modules of
:data:`COMPILED` to C extensions with mypyc, and writes :data:`MANIFEST` beside them: the SHA-256 of each
source it compiled. An extension module shadows its ``.py`` file, so a source edited after the build would
silently not run; :func:`state` refuses that with the fix, and ``import prague`` calls it. Only the standard
library is imported here: ``setup.py`` loads this file on its own, before anything is installed.

The compiled build takes the same decisions as the pure one (the same source, checked by mypy); only its
speed differs. It pays where the simulator spends its time: a million worker-iterations of Python calls.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

#: The modules compiled by ``make compiled``, relative to ``src/``: the event engine and the world, the
#: Group Generator's decision code, and each method's simulated loop with the rules it shares with its runtime.
COMPILED: tuple[str, ...] = (
    "prague/sim/engine.py",
    "prague/sim/world.py",
    "prague/sim/costs.py",
    "prague/sim/traffic.py",
    "prague/sim/restarts.py",
    "prague/groups/group.py",
    "prague/groups/trace.py",
    "prague/groups/base.py",
    "prague/groups/ready.py",
    "prague/groups/smart.py",
    "prague/groups/static.py",
    "prague/groups/random_gen.py",
    "prague/groups/shards.py",
    "prague/comm/cache.py",
    "prague/comm/codecs.py",
    "prague/algorithms/prague/sim.py",
    "prague/algorithms/prague/flow.py",
    "prague/algorithms/allreduce/sim.py",
    "prague/algorithms/allreduce/backup_sim.py",
    "prague/algorithms/allreduce/balanced_sim.py",
    "prague/algorithms/allreduce/drop_sim.py",
    "prague/algorithms/adpsgd/sim.py",
    "prague/algorithms/localsgd/sim.py",
    "prague/algorithms/diloco/sim.py",
    "prague/algorithms/dssync/sim.py",
    "prague/algorithms/eager_sgd/sim.py",
    "prague/algorithms/lossy/sim.py",
    "prague/algorithms/ps/sim.py",
    "prague/algorithms/ps_eager/sim.py",
)

#: Written by the compiled build beside the package: ``{source path: sha256 of the source compiled}``.
MANIFEST = "native_manifest.json"

_SRC = Path(__file__).resolve().parent.parent


class StaleBuildError(ImportError):
    """A compiled module no longer matches its source."""


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(src: Path, target: Path) -> Path:
    """Record the digest of every compiled source under ``src`` into ``target/`` (the built package)."""
    entries = {path: digest(src / path) for path in COMPILED}
    out = target / MANIFEST
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    tmp.replace(out)
    return out


def _compiled_sources(src: Path) -> set[str]:
    """The source path (relative to ``src``) of every extension module under ``src/prague``, one walk of the tree
    (``import prague`` makes it), whether or not that source exists."""
    suffixes = sorted(EXTENSION_SUFFIXES, key=len, reverse=True)  # ``api.cpython-311-...so`` is ``api``'s
    found = set()
    for folder, dirs, names in os.walk(src / "prague"):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            suffix = next((s for s in suffixes if name.endswith(s)), None)
            if suffix is not None:
                found.add((Path(folder) / (name[: -len(suffix)] + ".py")).relative_to(src).as_posix())
    return found


def extensions(src: Path = _SRC, compiled: set[str] | None = None) -> list[str]:
    """The modules of :data:`COMPILED` that have a compiled extension beside their source (``compiled``: what
    :func:`_compiled_sources` found, read again when not given)."""
    compiled = _compiled_sources(src) if compiled is None else compiled
    return [path for path in COMPILED if path in compiled]


def strays(src: Path = _SRC, compiled: set[str] | None = None) -> list[str]:
    """Compiled extensions beside a source that :data:`COMPILED` no longer names (left by an older build): each
    shadows its source as a stale build would. (A shared library without a source, mypyc's, is none.)"""
    compiled = _compiled_sources(src) if compiled is None else compiled
    return sorted(path for path in compiled if path not in COMPILED and (src / path).exists())


def state(src: Path = _SRC) -> str:
    """``"pure"``, or ``"compiled (N modules)"``; :class:`StaleBuildError` when a compiled module is stale."""
    fix = "run `make compiled` to build it again, or `make clean-compiled` to run the pure Python"
    compiled = _compiled_sources(src)
    left = strays(src, compiled)
    if left:
        raise StaleBuildError(f"compiled modules that the build no longer compiles: {', '.join(left)}: {fix}")
    built = extensions(src, compiled)
    if not built:
        return "pure"
    manifest = src / "prague" / MANIFEST
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise StaleBuildError(f"compiled modules without a readable {manifest} ({exc}): {fix}") from None
    stale = [
        path for path in built
        if (src / path).exists() and recorded.get(path) != digest(src / path)
    ]
    if stale:
        raise StaleBuildError(f"compiled modules older than their source: {', '.join(stale)}: {fix}")
    return f"compiled ({len(built)} modules)"
