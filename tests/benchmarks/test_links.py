"""benchmarks.links: rate-limited source links are made as asked and removed afterwards."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from benchmarks import links

pytestmark = pytest.mark.skipif(links.unavailable() is not None,
                                reason=f"links unavailable: {links.unavailable()}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_each_source_gets_a_namespace_behind_a_token_bucket_and_all_are_removed() -> None:
    before = _namespaces()
    with links.source_links(2, 2.5, prefix="tptest") as made:
        assert [link.address for link in made] == ["10.77.0.2", "10.77.1.2"]
        assert {link.namespace for link in made} == _namespaces() - before
        for i, link in enumerate(made):
            qdisc = subprocess.run(["tc", "-n", link.namespace, "qdisc", "show"],
                                   capture_output=True, text=True, check=True).stdout
            assert "tbf" in qdisc and "rate 2500Mbit" in qdisc, qdisc
            # A process in the namespace reaches this side of its own link.
            with socket.create_server((f"10.77.{i}.1", 0)) as server:
                port = server.getsockname()[1]
                client = subprocess.Popen(link.argv([
                    sys.executable, "-c", "import socket; socket.create_connection("
                    f"('10.77.{i}.1', {port}), timeout=10).sendall(b'hi')"]))
                server.settimeout(10)
                conn, (peer, _) = server.accept()
                with conn:
                    assert peer == link.address and conn.recv(2) == b"hi"
                assert client.wait(10) == 0
    assert _namespaces() == before
