"""The core stays sans-IO (docs/design.md section 3): no event loop, socket, thread, clock, OS or
torch.

Two checks:

* a static one walks every module under ``torchpass_p2p/core/`` with ``ast`` and names the file
  and line of each forbidden import, and of each call of the ``random`` module's global generator;
* a dynamic one imports every core module in a fresh interpreter and fails if that pulled in
  asyncio, socket, threading, torch or their kin, however indirectly (e.g. ``logging`` imports
  ``threading``, so the core must not log: it hands events to the host instead).

Decision on ``random``: the core draws only from an injected ``random.Random`` (conventionally
named ``rng``), so the same seed gives the same trace. ``import random`` / ``from random import
Random`` is allowed solely inside ``if TYPE_CHECKING:``, for annotations; anywhere else the
module-level generator (``random.random()``, ``random.shuffle()``...) would be one slip away.
A name ``random`` in core code therefore always means the module, never the injected generator.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "torchpass_p2p" / "core"
CORE_FILES = sorted(CORE.rglob("*.py"))

FORBIDDEN_IMPORTS = frozenset(
    {
        "asyncio", "socket", "selectors", "threading", "multiprocessing", "concurrent",
        "time", "datetime", "random", "uvloop", "aiohttp", "torch", "os", "subprocess", "signal",
        # The C modules underneath, and dynamic imports that would dodge this check.
        "_asyncio", "_socket", "_thread", "_random", "_datetime", "importlib",
    }
)  # fmt: skip
TYPE_CHECKING_ONLY = frozenset({"random"})
"""Allowed inside ``if TYPE_CHECKING:`` (annotations of the injected ``random.Random``)."""

# Every attribute of the random module except the class the core is handed an instance of.
# SystemRandom reads OS entropy, so it is as unreplayable as the global generator.
RANDOM_ALLOWED_ATTRS = frozenset({"Random"})

# Modules that must not appear in sys.modules after importing the core. Measured with this venv
# (Python 3.11): msgpack pulls in datetime and numpy; cryptography's AEAD pulls in none of these.
FORBIDDEN_LOADED = (
    "asyncio", "socket", "selectors", "ssl", "threading", "multiprocessing", "concurrent",
    "subprocess", "uvloop", "aiohttp", "torch",
)  # fmt: skip
# Forbidden modules that a third-party dependency of the core imports unavoidably, each with the
# culprit named. Empty: no dependency needs one today.
THIRD_PARTY_EXEMPT: dict[str, str] = {}


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _walk(node: ast.AST, type_checking: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Yield ``(node, inside_type_checking)`` for every node below ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield child, type_checking
            for stmt in child.body:
                yield stmt, True
                yield from _walk(stmt, True)
            for stmt in child.orelse:  # the else branch runs at run time
                yield stmt, type_checking
                yield from _walk(stmt, type_checking)
        else:
            yield child, type_checking
            yield from _walk(child, type_checking)


def violations(source: str) -> list[tuple[int, str]]:
    """``(line, message)`` for every sans-IO violation in ``source``, in line order."""
    found: list[tuple[int, str]] = []
    for node, type_checking in _walk(ast.parse(source)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        for module in modules:
            top = module.partition(".")[0]
            if top not in FORBIDDEN_IMPORTS:
                continue
            if type_checking and top in TYPE_CHECKING_ONLY:
                continue
            where = " outside `if TYPE_CHECKING:`" if top in TYPE_CHECKING_ONLY else ""
            found.append((node.lineno, f"imports {module}{where}"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "random"
            and node.func.attr not in RANDOM_ALLOWED_ATTRS
        ):
            found.append(
                (node.lineno, f"calls random.{node.func.attr}() (use the injected random.Random)")
            )
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "__import__":
                found.append((node.lineno, "calls __import__()"))
    return sorted(found)


def test_core_has_modules() -> None:
    # Guards against the walk silently checking nothing after a move.
    assert CORE / "params.py" in CORE_FILES


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_is_sans_io(path: Path) -> None:
    rel = path.relative_to(REPO)
    bad = [f"{rel}:{line}: {msg}" for line, msg in violations(path.read_text())]
    assert bad == [], "core must stay sans-IO (docs/design.md section 3):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import asyncio", [(1, "imports asyncio")]),
        ("import os.path", [(1, "imports os.path")]),
        ("from concurrent.futures import Future", [(1, "imports concurrent.futures")]),
        ("x = 1\nfrom time import monotonic", [(2, "imports time")]),
        ("def f():\n    import socket", [(2, "imports socket")]),
        ("import random", [(1, "imports random outside `if TYPE_CHECKING:`")]),
        ("from random import Random", [(1, "imports random outside `if TYPE_CHECKING:`")]),
        ("if TYPE_CHECKING:\n    import random", []),
        ("if typing.TYPE_CHECKING:\n    from random import Random", []),
        (
            "if TYPE_CHECKING:\n    pass\nelse:\n    import random",
            [(4, "imports random outside `if TYPE_CHECKING:`")],
        ),
        ("if TYPE_CHECKING:\n    import torch", [(2, "imports torch")]),
        ("x = random.random()", [(1, "calls random.random() (use the injected random.Random)")]),
        ("random.shuffle(xs)", [(1, "calls random.shuffle() (use the injected random.Random)")]),
        ("rng.shuffle(xs)\nrng.random()", []),
        ("from . import params\nfrom .messages import Ack", []),
        ("m = __import__('socket')", [(1, "calls __import__()")]),
    ],
)
def test_checker_finds_violations(source: str, expected: list[tuple[int, str]]) -> None:
    assert violations(source) == expected


@pytest.mark.parametrize(
    "call", ["random", "randint", "choice", "shuffle", "sample", "uniform", "SystemRandom"]
)
def test_checker_rejects_global_random_calls(call: str) -> None:
    assert [line for line, _ in violations(f"random.{call}(1)")] == [1]


def test_importing_core_loads_no_io_modules() -> None:
    modules = ["torchpass_p2p.core"] + [
        ".".join(("torchpass_p2p", *p.relative_to(CORE.parent).with_suffix("").parts))
        for p in CORE_FILES
        if p.name != "__init__.py"
    ]
    # -I: no user site or PYTHON* variables; the repository goes on sys.path explicitly. Each
    # forbidden module is attributed to the first core module whose import brought it in.
    script = textwrap.dedent(
        """
        import importlib, json, sys
        sys.path.insert(0, sys.argv[1])
        forbidden, modules = json.loads(sys.argv[2]), json.loads(sys.argv[3])
        preloaded = sorted(m for m in forbidden if m in sys.modules)
        culprit = {}
        for name in modules:
            importlib.import_module(name)
            for m in forbidden:
                if m in sys.modules and m not in preloaded:
                    culprit.setdefault(m, name)
        print(json.dumps({"preloaded": preloaded, "culprit": culprit}))
        """
    )
    forbidden = [m for m in FORBIDDEN_LOADED if m not in THIRD_PARTY_EXEMPT]
    proc = subprocess.run(
        [sys.executable, "-I", "-c", script, str(REPO), json.dumps(forbidden), json.dumps(modules)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # If the interpreter itself loaded one at startup, this test could not see the core do it.
    assert report["preloaded"] == [], f"interpreter preloads {report['preloaded']}"
    loaded = [f"{m} (first loaded by importing {name})" for m, name in report["culprit"].items()]
    assert loaded == [], "importing the core loaded I/O modules: " + ", ".join(loaded)
