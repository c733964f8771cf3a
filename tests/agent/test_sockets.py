"""Sockets handed over by the launcher: the settings that name them and their adoption."""

from __future__ import annotations

import os
import socket

import pytest

from tests.agent.test_http import FakeSource
from torchpass_p2p.agent.http import StatusServer
from torchpass_p2p.agent.metrics import AgentMetrics
from torchpass_p2p.agent.settings import SettingsError, load_settings
from torchpass_p2p.agent.sockets import NotInherited, adopt_socket
from torchpass_p2p.agent.transport import Transport
from torchpass_p2p.core.seal import Keyring
from torchpass_p2p.launch.ports import reserve_ports

KEY = {"TORCHPASS_KEY": "ab" * 32}


def test_the_environment_names_the_inherited_descriptors() -> None:
    settings = load_settings(environ={**KEY, "TORCHPASS_SEEDS": "127.0.0.1:9",
                                      "TORCHPASS_BIND_FDS": "5,6", "TORCHPASS_STATUS_FD": "7"})
    assert (settings.bind_fds, settings.status_fd) == ((5, 6), 7)
    assert load_settings(environ={**KEY, "TORCHPASS_SEEDS": "127.0.0.1:9"}).bind_fds is None
    for name, bad in (("BIND_FDS", "5"), ("BIND_FDS", "5,6,7"), ("BIND_FDS", "a,b"),
                      ("BIND_FDS", "-1,4"), ("STATUS_FD", "3,4"), ("STATUS_FD", "x")):
        with pytest.raises(SettingsError, match=f"TORCHPASS_{name}: .* descriptor"):
            load_settings(environ={**KEY, "TORCHPASS_SEEDS": "127.0.0.1:9",
                                   f"TORCHPASS_{name}": bad})


def test_an_adopted_socket_is_the_bound_one_non_blocking_and_not_inherited() -> None:
    [held] = reserve_ports(1)
    udp_fd, tcp_fd = held.hand_over()
    for fd in (udp_fd, tcp_fd):
        os.set_inheritable(fd, True)  # as pass_fds leaves them in the child
    udp = adopt_socket(udp_fd, socket.SOCK_DGRAM, ("127.0.0.1", held.port))
    tcp = adopt_socket(tcp_fd, socket.SOCK_STREAM, ("127.0.0.1", 0))  # 0: any port
    with udp, tcp:
        assert (udp.fileno(), tcp.fileno()) == (udp_fd, tcp_fd)
        assert udp.getsockname()[1] == tcp.getsockname()[1] == held.port
        assert not udp.getblocking() and not udp.get_inheritable() and not tcp.get_inheritable()
        with socket.create_connection(("127.0.0.1", held.port), timeout=5):
            pass  # listening already


def test_a_descriptor_of_the_wrong_kind_or_port_is_refused_and_left_open() -> None:
    [held] = reserve_ports(1)
    with pytest.raises(NotInherited, match=rf"descriptor {held.fds[0]}: not a SOCK_STREAM socket"):
        adopt_socket(held.fds[0], socket.SOCK_STREAM, ("127.0.0.1", held.port))
    wrong_port = f"not a SOCK_DGRAM socket bound to port {held.port + 1}"
    with pytest.raises(NotInherited, match=wrong_port):
        adopt_socket(held.fds[0], socket.SOCK_DGRAM, ("127.0.0.1", held.port + 1))
    assert held.sockets[0].getsockname()[1] == held.port  # still open: not closed by a refusal
    held.close()
    read, write = os.pipe()
    try:
        with pytest.raises(NotInherited, match=f"descriptor {read}: not an open socket"):
            adopt_socket(read, socket.SOCK_DGRAM, ("127.0.0.1", 0))
    finally:
        os.close(read)
        os.close(write)


def test_an_address_given_to_start_drops_the_inherited_sockets_of_that_address() -> None:
    environ = {**KEY, "TORCHPASS_SEEDS": "127.0.0.1:9", "TORCHPASS_BIND_FDS": "5,6",
               "TORCHPASS_STATUS_FD": "7"}
    settings = load_settings(environ=environ, bind=("127.0.0.1", 0))
    assert (settings.bind_fds, settings.status_fd) == (None, 7)
    settings = load_settings(environ=environ, status=None)
    assert (settings.bind_fds, settings.status_fd) == ((5, 6), None)


def test_a_stream_socket_whose_port_another_socket_listens_on_is_refused_and_closed() -> None:
    # Two sockets with SO_REUSEADDR may both bind one TCP port while neither listens; the
    # first to listen wins. adopt_socket listens itself, so the loss is an error, not a
    # server that silently serves nothing (uvloop's start_server(sock=...)).
    [held] = reserve_ports(1, udp=False)
    (fd,) = held.hand_over()
    with socket.socket() as rival:
        rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        rival.bind(("127.0.0.1", held.port))
        rival.listen()
        with pytest.raises(OSError, match="Address already in use"):
            adopt_socket(fd, socket.SOCK_STREAM, ("127.0.0.1", held.port))
    with pytest.raises(OSError):
        os.fstat(fd)  # closed, not leaked


async def test_descriptors_that_are_not_the_handed_sockets_fail_the_start_and_stay_open() -> None:
    # E.g. a Python wrapper between the launcher and the script closed them (subprocess's
    # close_fds) but passed the environment on: the numbers name nothing, or another file.
    read, write = os.pipe()
    transport = Transport("t", Keyring(b"k" * 32), 1, on_message=lambda m: None,
                          on_send_error=lambda *e: None, on_request=lambda k, b: None)
    server = StatusServer(FakeSource(), AgentMetrics(), token="x")
    hint = "a wrapper process must pass them on"
    try:
        with pytest.raises(NotInherited, match=f"descriptor {read}: not an open socket .*{hint}"):
            await transport.start(("127.0.0.1", 0), (read, write))
        with pytest.raises(NotInherited, match=f"descriptor {write}: not an open socket"):
            await server.start(fd=write)
        os.fstat(read)  # never the agent's: left open
        os.fstat(write)
    finally:
        await transport.close()
        await server.stop()
        os.close(read)
        os.close(write)


async def test_a_failed_start_closes_what_it_took_and_leaves_the_rest() -> None:
    [a, b] = reserve_ports(2)
    udp_a, tcp_a = a.hand_over()
    udp_b, tcp_b = b.hand_over()
    transport = Transport("t", Keyring(b"k" * 32), 1, on_message=lambda m: None,
                          on_send_error=lambda *e: None, on_request=lambda k, b: None)
    try:
        with pytest.raises(NotInherited, match=f"not a SOCK_STREAM socket bound to port {a.port}"):
            await transport.start(("127.0.0.1", a.port), (udp_a, tcp_b))  # B's TCP socket
        with pytest.raises(OSError):
            os.fstat(udp_a)  # taken, then closed
        with socket.socket(fileno=os.dup(tcp_b)) as left_alone:
            assert left_alone.getsockname()[1] == b.port
    finally:
        for fd in (tcp_a, udp_b, tcp_b):
            os.close(fd)
