"""Guard for the optional mypyc build (scripts/build-native): never run stale compiled code.

Python imports ``membership.cpython-311-*.so`` in preference to ``membership.py``. If the source
was edited after the build, the extension no longer matches it; such an extension is deleted
(it is a build product, ignored by git) so the import falls back to the source.
"""

from __future__ import annotations

import importlib.machinery
import os
import warnings


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
                warnings.warn(f"removed stale compiled module {so} (its source changed; rerun "
                              "scripts/build-native)", RuntimeWarning, stacklevel=2)
                try:
                    os.remove(so)
                except OSError:
                    pass
