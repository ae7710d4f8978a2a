"""Optional native build of the simulator's hot path.

``pip install`` builds prague as pure Python. With ``PRAGUE_COMPILE=1`` (``make compiled`` in a checkout) the
modules of ``prague.native.COMPILED`` (the discrete-event engine, the world the workers live in, the Group
Generator's decision code and the methods' simulated loops) are compiled to C extensions with mypyc, the
compiler that ships with mypy, and ``prague/native_manifest.json`` records the sources compiled. The source is
the same Python: the runtime and the simulator take the same decisions either way, only faster.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_prague_native", ROOT / "src" / "prague" / "native.py")
assert _spec is not None and _spec.loader is not None
native = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native)


class BuildWithManifest(build_ext):
    """Builds the extensions, then records the digest of every source compiled beside them."""

    def run(self) -> None:
        super().run()
        if not self.extensions:  # the pure build: nothing compiled, nothing to record
            return
        target = ROOT / "src" / "prague" if self.inplace else Path(self.build_lib) / "prague"
        target.mkdir(parents=True, exist_ok=True)
        native.write_manifest(ROOT / "src", target)


ext_modules = []
if os.environ.get("PRAGUE_COMPILE") == "1":
    from mypyc.build import mypycify

    ext_modules = mypycify(
        [os.path.join("src", path) for path in native.COMPILED],
        group_name="prague.native_lib",
        target_dir=os.path.join("build", "mypyc"),
    )

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildWithManifest})
