"""The kernel's per-socket drop counter (torchpass_p2p.kernel_drops), read from real sockets."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from torchpass_p2p.kernel_drops import socket_drops

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="SO_MEMINFO is Linux's")
SENT = 200


def _proc_udp_drops(sock: socket.socket) -> int:
    """The ``drops`` column of the socket's line in /proc/net/udp: the same counter, read the
    other way."""
    inode = str(os.fstat(sock.fileno()).st_ino)
    with open("/proc/self/net/udp") as table:
        for line in table:
            fields = line.split()
            if fields[9] == inode:
                return int(fields[-1])
    raise AssertionError("socket not in /proc/self/net/udp")


def test_every_datagram_is_read_or_counted_dropped_once() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        receiver.bind(("127.0.0.1", 0))
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's minimum
        assert socket_drops(receiver) == 0
        for _ in range(SENT):  # nobody reads meanwhile: a few fit, the rest are dropped
            sender.sendto(bytes(1000), receiver.getsockname())
        receiver.setblocking(False)
        read = 0
        while True:
            try:
                receiver.recv(2048)
            except BlockingIOError:
                break
            read += 1
        dropped = socket_drops(receiver)
        assert dropped is not None and dropped > 0 and read > 0
        assert read + dropped == SENT  # loopback delivers at once: nothing else in flight
        assert dropped == _proc_udp_drops(receiver)


def test_a_full_accept_queue_counts_on_the_listening_socket() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)  # holds 2 (the kernel allows one more than the backlog)
        clients = [socket.socket() for _ in range(20)]
        try:
            for c in clients:
                c.setblocking(False)
                try:
                    c.connect(listener.getsockname())
                except BlockingIOError:
                    pass
            # Each of the 18 that do not fit loses at least its first SYN (retransmissions,
            # from 1 s on, add more: a count of packets).
            end = time.monotonic() + 10.0
            while (socket_drops(listener) or 0) < 18:
                assert time.monotonic() < end, socket_drops(listener)
                time.sleep(0.01)
        finally:
            for c in clients:
                c.close()


def test_what_cannot_be_read_is_none() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.close()
    assert socket_drops(sock) is None
