"""Guard for the optional mypyc build (scripts/build-native): never run stale compiled code.

Python imports ``membership.cpython-311-*.so`` in preference to ``membership.py``. If a source
was edited after the build, the extensions no longer match it; they are deleted (build products,
ignored by git) so the imports fall back to the sources.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def drop_stale_extensions(package_dir: str) -> None:
    """If any compiled module under ``package_dir`` or its sibling ``sims`` package (one mypyc
    group: scripts/native_build.py) is older than its ``.py`` source, delete every compiled
    module of the group: a partly removed group would mix old and new code. An extension with its
    ``.c`` source beside it (the pulse responder, agent/_pulse.c) is not mypyc's: left alone."""
    suffixes = [s for s in importlib.machinery.EXTENSION_SUFFIXES if s != ".so"]
    roots = [package_dir, os.path.join(os.path.dirname(package_dir), "sims")]
    compiled: list[str] = []
    stale: list[str] = []
    for top in roots:
        for root, _dirs, files in os.walk(top):
            for name in files:
                suffix = next((s for s in suffixes if name.endswith(s)), None)
                if suffix is None:
                    continue
                so = os.path.join(root, name)
                source = so[: -len(suffix)] + ".py"
                if os.path.exists(so[: -len(suffix)] + ".c"):  # C source: not mypyc's (_pulse)
                    continue
                compiled.append(so)
                try:
                    if os.path.getmtime(source) > os.path.getmtime(so):
                        stale.append(so)
                except OSError:
                    continue
    if not stale:
        return
    # Not a warning: under ``-W error`` a warning here would break the import it protects.
    sys.stderr.write(f"torchpass_p2p: {stale[0]} is older than its source; removed all "
                     f"{len(compiled)} compiled modules (scripts/build-native rebuilds them)\n")
    for so in compiled:
        try:
            os.remove(so)
        except OSError:
            pass


class _SourceOnlyFinder:
    """A meta-path finder that loads ``.py`` sources for our packages even where a compiled
    module sits beside them (``TORCHPASS_PURE_PYTHON=1``: the reference path, and the baseline
    benchmarks/sim_speed.py measures against)."""

    PREFIXES = ("torchpass_p2p.", "sims.")

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):  # noqa: ANN001, ANN206 - finder API
        if not fullname.startswith(cls.PREFIXES) or not path:
            return None
        leaf = fullname.rpartition(".")[2]
        for entry in path:
            source = os.path.join(entry, leaf + ".py")
            if os.path.isfile(source):
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def prefer_sources() -> None:
    """Ignore compiled modules from now on if ``TORCHPASS_PURE_PYTHON=1``."""
    if os.environ.get("TORCHPASS_PURE_PYTHON") == "1" and _SourceOnlyFinder not in sys.meta_path:
        sys.meta_path.insert(0, _SourceOnlyFinder)  # type: ignore[arg-type]
