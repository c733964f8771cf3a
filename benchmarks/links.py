"""Rate-limited links to source processes, for transfer benchmarks on one machine.

Each source gets its own network namespace joined to this one by a veth pair, and a token-bucket
filter (``tc tbf``) on the namespace's end limits what the source can send: as if each source
were another host with an uplink of ``gbit`` Gbit/s. Several processes in one namespace share
its link: as if every source sat behind the receiver's one incoming link of that rate. Linux
only, needs root and ``ip`` / ``tc`` (iproute2); namespaces, veth pairs and tbf work on this
project's development machines, ``tc netem`` does not (``docs/transfer.md``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = "10.77"
"""Link ``i`` is ``10.77.i.0/30``: this side ``.1``, the source's namespace ``.2``."""
BURST = "4mb"
"""tbf bucket: one 4 MiB socket buffer's worth, so a burst never stalls a full window."""


@dataclass(frozen=True)
class Link:
    """One source's side: run its process with :meth:`argv` and connect to ``address``."""

    namespace: str
    address: str
    device: str = ""
    """The veth end in ``namespace``, whose queue discipline is the rate limit."""

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run inside this link's namespace."""
        return ["ip", "netns", "exec", self.namespace, *command]


def unavailable() -> str | None:
    """Why links cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def source_links(count: int, gbit: float, prefix: str = "tpbench", burst: str = BURST,
                 subnet: str = SUBNET) -> Iterator[list[Link]]:
    """``count`` namespaces, each joined to this one by a veth pair whose namespace end sends
    at most ``gbit`` Gbit/s (``tc`` rate syntax: 0.016 is 2 MB/s) with a token bucket of
    ``burst`` (``tc`` size syntax), link ``i`` in ``subnet``'s ``.i.0/30`` (another subnet
    keeps two benchmarks running at once apart); all removed on exit. Raises
    ``subprocess.CalledProcessError`` when a command fails (the ones made so far are
    removed)."""
    tag = f"{prefix}{os.getpid() % 10000}"
    made: list[str] = []
    try:
        links = []
        for i in range(count):
            ns, here, there = f"{tag}s{i}", f"{tag}h{i}", f"{tag}n{i}"
            _run("ip", "netns", "add", ns)
            made.append(ns)
            _run("ip", "link", "add", here, "type", "veth", "peer", "name", there)
            _run("ip", "link", "set", there, "netns", ns)
            _run("ip", "addr", "add", f"{subnet}.{i}.1/30", "dev", here)
            _run("ip", "link", "set", here, "up")
            _run("ip", "-n", ns, "addr", "add", f"{subnet}.{i}.2/30", "dev", there)
            _run("ip", "-n", ns, "link", "set", there, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("tc", "-n", ns, "qdisc", "add", "dev", there, "root", "tbf", "rate",
                 f"{gbit}gbit", "burst", burst, "latency", "100ms")
            links.append(Link(ns, f"{subnet}.{i}.2", there))
        yield links
    finally:
        for ns in made:  # deleting a namespace deletes its veth end, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30,
                           check=False)


def sent_bytes(link: Link) -> int:
    """Bytes the link's rate limit has let through so far (``tc -s``: every packet sent from
    the namespace, headers included)."""
    out = subprocess.run(["tc", "-s", "-j", "-n", link.namespace, "qdisc", "show", "dev",
                          link.device], check=True, capture_output=True, text=True, timeout=30)
    return sum(int(q.get("bytes", 0)) for q in json.loads(out.stdout))
