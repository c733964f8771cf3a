"""The staleness check of the optional mypyc build (torchpass_p2p/_native.py): the entry points
refuse compiled code older than its source; importing the package touches no file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchpass_p2p._native import refusal, stale_extensions

SUFFIX = ".cpython-311-x86_64-linux-gnu.so"


def tree(tmp_path: Path, *, so_newer: bool) -> Path:
    """A repository with one compiled core module and the pulse responder beside their sources."""
    core = tmp_path / "torchpass_p2p" / "core"
    agent = tmp_path / "torchpass_p2p" / "agent"
    core.mkdir(parents=True)
    agent.mkdir()
    (core / "cut.py").write_text("")
    (core / f"cut{SUFFIX}").write_bytes(b"")
    (agent / "_pulse.c").write_text("")
    (agent / f"_pulse{SUFFIX}").write_bytes(b"")
    old, new = 1_000_000_000, 1_000_000_100
    os.utime(core / "cut.py", (new, new) if not so_newer else (old, old))
    os.utime(core / f"cut{SUFFIX}", (old, old) if not so_newer else (new, new))
    os.utime(agent / f"_pulse{SUFFIX}", (old, old))  # older than nothing it is compared with
    return tmp_path


def test_a_compiled_module_older_than_its_source_is_named(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    monkeypatch.delenv("TORCHPASS_PURE_PYTHON", raising=False)
    repo = tree(tmp_path, so_newer=False)
    stale = stale_extensions(str(repo))
    assert stale == [str(repo / "torchpass_p2p" / "core" / f"cut{SUFFIX}")]
    assert refusal(stale).startswith(f"{stale[0]} (and 0 more) is older than its source: run "
                                     "scripts/build-native")
    assert (repo / "torchpass_p2p" / "core" / f"cut{SUFFIX}").exists()  # reported, not deleted


def test_fresh_products_and_the_pure_switch_are_not_stale(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    monkeypatch.delenv("TORCHPASS_PURE_PYTHON", raising=False)
    assert stale_extensions(str(tree(tmp_path / "a", so_newer=True))) == []
    monkeypatch.setenv("TORCHPASS_PURE_PYTHON", "1")
    assert stale_extensions(str(tree(tmp_path / "b", so_newer=False))) == []


def test_importing_the_package_walks_no_tree() -> None:
    code = ("import os, sys\n"
            "walked = []\n"
            "real = os.walk\n"
            "os.walk = lambda *a, **k: walked.append(a) or real(*a, **k)\n"
            "import torchpass_p2p\n"
            "print(len(walked))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "0"
