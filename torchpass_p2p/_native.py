"""The optional mypyc build (scripts/build-native) and the pure-Python switch.

Python imports ``membership.cpython-311-*.so`` in preference to ``membership.py``, so a source
edited after the build would run as its old compiled self. The build keeps them in step:
scripts/build-native rebuilds whenever a compiled module's source changed (a hash of the
sources) and scripts/clean-native removes every product. Importing the package touches no file;
the entry points a developer runs straight after an edit (the test suite, ``python -m sims``)
call :func:`stale_extensions` and refuse to run stale code.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

ROOTS = ("torchpass_p2p", "sims")
"""The packages of the one mypyc group (scripts/native_build.py), relative to the repository."""


def stale_extensions(repo: str) -> list[str]:
    """Compiled modules under ``repo``'s :data:`ROOTS` older than their ``.py`` source, as
    paths. An extension with a ``.c`` source beside it (the pulse responder, agent/_pulse.c) is
    not mypyc's and is never stale here. Empty under ``TORCHPASS_PURE_PYTHON=1`` (compiled
    modules are ignored then: :func:`prefer_sources`)."""
    if os.environ.get("TORCHPASS_PURE_PYTHON") == "1":
        return []
    suffixes = [s for s in importlib.machinery.EXTENSION_SUFFIXES if s != ".so"]
    stale: list[str] = []
    for top in ROOTS:
        for root, _dirs, files in os.walk(os.path.join(repo, top)):
            for name in files:
                suffix = next((s for s in suffixes if name.endswith(s)), None)
                if suffix is None:
                    continue
                so = os.path.join(root, name)
                base = so[: -len(suffix)]
                if os.path.exists(base + ".c"):
                    continue
                try:
                    if os.path.getmtime(base + ".py") > os.path.getmtime(so):
                        stale.append(so)
                except OSError:
                    continue
    return stale


def refusal(stale: list[str]) -> str:
    """The one line an entry point prints before it refuses to run ``stale`` code."""
    return (f"{stale[0]} (and {len(stale) - 1} more) is older than its source: run "
            "scripts/build-native to rebuild, scripts/clean-native to run the sources, or set "
            "TORCHPASS_PURE_PYTHON=1")


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
    """Ignore compiled modules from now on if ``TORCHPASS_PURE_PYTHON=1`` (reads only the
    environment: the switch must hold before the first compiled module is imported)."""
    if os.environ.get("TORCHPASS_PURE_PYTHON") == "1" and _SourceOnlyFinder not in sys.meta_path:
        sys.meta_path.insert(0, _SourceOnlyFinder)  # type: ignore[arg-type]
