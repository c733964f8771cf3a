"""Guard for the optional mypyc build (scripts/build-native): never run stale compiled code.

Python imports ``membership.cpython-311-*.so`` in preference to ``membership.py``. If the source
was edited after the build, the extension no longer matches it; such an extension is deleted
(it is a build product, ignored by git) so the import falls back to the source.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def drop_stale_extensions(package_dir: str) -> None:
    """Delete every compiled module under ``package_dir`` older than its ``.py`` source."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    for root, _dirs, files in os.walk(package_dir):
        for name in files:
            suffix = next((s for s in suffixes if name.endswith(s) and s != ".so"), None)
            if suffix is None:
                continue
            so = os.path.join(root, name)
            source = so[: -len(suffix)] + ".py"
            try:
                stale = os.path.getmtime(source) > os.path.getmtime(so)
            except OSError:
                continue
            if stale:
                # Not a warning: under ``-W error`` a warning here would break the import it
                # is protecting.
                sys.stderr.write(f"torchpass_p2p: removed stale compiled module {so} (its "
                                 "source changed; scripts/build-native rebuilds it)\n")
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
