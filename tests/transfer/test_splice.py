"""Zero-copy sending (transfer/splice.py): exact bytes, bounded waits, the server using it."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading

import pytest

from torchpass_p2p.transfer import TransferKeys, TransferServer, fetch, splice

from .states import capture

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def test_available_on_linux() -> None:
    # CI runs on Linux: the zero-copy path is what the transfer tests exercise there.
    assert splice.available()


def test_pages_arrive_exactly_across_pipe_sized_steps() -> None:
    # Three buffers: empty, a 3 MiB + 5 bytes one (several pipe loads) and an odd-sized tail.
    data = [bytearray(), bytearray(os.urandom(3 * splice.PIPE_BYTES + 5)), bytearray(b"tail!")]
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)  # as the event loop's sockets are
        got = bytearray()

        def read() -> None:
            while chunk := b.recv(1 << 20):
                got.extend(chunk)

        reader = threading.Thread(target=read)
        reader.start()
        sent = splice.send_pages(a.fileno(), [memoryview(d) for d in data], 10.0)
        a.shutdown(socket.SHUT_WR)
        reader.join(30)
    assert sent == sum(map(len, data)) and got == b"".join(data)


def test_a_peer_that_stops_reading_is_a_timeout_and_a_stop_request_ends_the_wait() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        big = [memoryview(bytearray(64 << 20))]  # far more than the socket buffers hold
        with pytest.raises(TimeoutError):
            splice.send_pages(a.fileno(), big, 0.3)
        with pytest.raises(ConnectionError):
            splice.send_pages(a.fileno(), big, 30.0, stop=lambda: True)


def test_read_only_memory_is_refused() -> None:
    a, b = socket.socketpair()
    with a, b, pytest.raises(TypeError):
        splice.send_pages(a.fileno(), [memoryview(b"read-only")], 1.0)


@pytest.mark.parametrize("zero_copy", [True, False, None])
def test_the_server_sends_the_same_bytes_either_way(zero_copy: bool | None) -> None:
    snap, _ = capture("mlp_adam", "source")

    async def main() -> tuple[int, bytes]:
        keys = TransferKeys(os.urandom(32))
        async with TransferServer(keys, lambda: 7, zero_copy=zero_copy) as server:
            assert server.zero_copy is zero_copy
            server.publish(snap)
            result = await fetch([server.address], keys, 7)
            return server.stats["chunks"], result.snapshot.fingerprint()

    chunks, fingerprint = asyncio.run(main())
    assert chunks == snap.num_chunks > 1 and fingerprint == snap.fingerprint()
