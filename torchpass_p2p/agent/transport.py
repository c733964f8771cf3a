"""Sockets of one agent: UDP datagrams for gossip, TCP frames for what does not fit and requests.

Why one module of this size: UDP and TCP share the port, the keys, the per-peer key choice and
the drop counters; both paths must seal, open and count the same way.

Both listen on the same port number. A core message whose sealed datagram fits
``max_datagram_bytes`` (1,400: no IP fragmentation) goes by UDP; a larger one (a full
``SyncState``, a ``Vote`` with a full cut) goes as one TCP frame to the same address. A joining
process asks a seed for the current configuration over TCP (request/reply on one connection).

Every datagram and frame is sealed (ChaCha20-Poly1305, :mod:`torchpass_p2p.core.seal`). A frame
is a 4-byte big-endian length, one channel byte, and a sealed body whose first byte is its kind.
Each channel has its own sealer under sub-keys derived for it
(:meth:`~torchpass_p2p.core.seal.Keyring.derive`), so no two sealers ever share a nonce and the
channel byte, which selects the key, cannot be changed undetected:

* ``Channel.MESSAGE``: core messages, sealed with the sender's incarnation and bound to the
  receiving member, like datagrams (a copy replayed to another member fails there).
* ``Channel.REQUEST``: requests and their replies, incarnation 0. A request is not bound to a
  member (a joiner asks a seed it knows by address only); a reply is bound to the request it
  answers (:func:`reply_tag`), so an old reply replayed to a new request does not open.
* ``Channel.REFUSED``: the answer to a request sealed under a key this member does not hold:
  in clear, the ids of the keys it accepts, primary first (ids are in every datagram's clear
  header anyway), then the connection closes. The requester raises :class:`KeyRefused`. Only
  ever read as the reply on a connection the requester opened itself, so a process off the
  path cannot make anyone believe it (it would have to inject into that TCP stream).

Key rotation (``docs/running.md``, "Keys"). :meth:`Transport.rekey` swaps the keyring in place,
keeping counters and replay windows. Each channel seals under the primary key, except to a peer
last heard under another key this ring accepts: that peer gets that key, so a process still on
the old key (a spare started from an old key file) hears its peers while the old key is
accepted. Those peers are forgotten at each rekey, so two members that both moved to a new
primary do not keep talking under the old one. A reply goes under the key of its request.
Datagrams and frames under a key this member does not hold are counted (``unknown_key``) and
logged once a minute per source (host and claimed sender), at most
:data:`UNKNOWN_KEY_LINES_PER_MINUTE` lines a minute in all.

Connections that have not yet delivered an authenticated frame are *unproven*: they must send one
within ``FIRST_FRAME_TIMEOUT_S``, and past ``MAX_UNPROVEN_CONNECTIONS`` the oldest is closed, so
idle connections from a process without the key cannot take every slot from the members.

Bad input is dropped and counted by reason in ``rejected`` (datagrams, the reasons of
:mod:`torchpass_p2p.core.wire`, and ``kernel_dropped``: those lost in a full receive buffer,
:mod:`torchpass_p2p.kernel_drops`) and ``rejected_frames`` (TCP); it never raises out of a
callback and never reaches the core. Each inbound connection that ends without a frame that
opened under the key counts exactly once in ``rejected_frames``, under the first reason that
ended it: ``evicted_unproven`` (closed to make room, whatever it held), ``first_frame_timeout``,
``empty`` (closed before a byte), ``reset``, ``truncated`` (closed or stalled inside a frame), a
frame's own reason (``too_large``, ``auth_failed``, ...), or ``too_many_connections``; so does a
proven connection that ends inside a frame (``truncated``) or on a bad frame. A proven
connection closed, reset or idle between frames dropped nothing and is not counted. Connection
attempts the kernel dropped from the listening socket's full accept queue count as
``kernel_dropped`` (packets, not connections).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import socket
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass

from torchpass_p2p.core.codec import DecodeError, decode, encode
from torchpass_p2p.core.configuration import Address
from torchpass_p2p.core.messages import MemberId, Message
from torchpass_p2p.core.seal import (
    HEADER,
    HEADER_BYTES,
    OVERHEAD_BYTES,
    VERSION,
    Keyring,
    Opener,
    OpenError,
    Sealer,
    key_id,
)
from torchpass_p2p.core.wire import DEFAULT_MAX_DATAGRAM_BYTES, Wire
from torchpass_p2p.kernel_drops import socket_drops
from torchpass_p2p.tasks import OwnedTasks, TaskLimitReached

from .sockets import adopt_socket

__all__ = ["Channel", "KeyRefused", "Kind", "Transport", "TransportError", "reply_tag"]

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
STREAM_LABEL = b"torchpass tcp frames v1"
"""Sub-key label of the message channel."""
REQUEST_LABEL = b"torchpass tcp requests v1"
"""Sub-key label of the request channel."""
MAX_INBOUND_FRAME = 64 * 1024
"""Largest frame a member accepts unasked (bytes): a core message is at most 2 KiB."""
MAX_REPLY_FRAME = 64 * 1024 * 1024
"""Largest reply a requester reads (bytes): a 131k-member configuration is about 20 MB."""
MAX_INBOUND_CONNECTIONS = 256
"""Inbound connections served at once; past this a new one is closed unread."""
MAX_OUTBOUND_CONNECTIONS = 131_072
"""Outbound connections (one per peer address, each with its writing task) at once: as many
as a configuration has members (``bootstrap.MAX_MEMBERS``); past this a frame to a new address
is dropped and counted ``dropped_queue_full``."""
MAX_UNPROVEN_CONNECTIONS = 64
"""Inbound connections without an authenticated frame yet; past this the oldest is closed."""
FIRST_FRAME_TIMEOUT_S = 2.0
"""An inbound connection must deliver its first frame within this (seconds): a member writes
its frame right after connecting."""
OUTBOUND_QUEUE = 256
"""Frames waiting per destination; more are dropped and counted (gossip repairs loss)."""
CONNECT_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 30.0
"""An inbound or outbound connection with no frame for this long is closed."""
REPLY_TIMEOUT_S = 10.0
"""A requester must take its reply within this (seconds; a 20 MB configuration takes
milliseconds on loopback), or the connection is closed and the reply dropped."""
MAX_PEER_KEYS = 4096
"""Peers remembered as sealing under a key other than the primary (oldest forgotten first;
a forgotten one is sealed to under the primary). Only processes on an older key are kept:
during a rotation, a few."""
UNKNOWN_KEY_LOG_S = 60.0
"""A source sending under a key this member does not hold is logged once per this many
seconds (the issue asked for once a minute); every datagram or frame is counted."""
UNKNOWN_KEY_LINES_PER_MINUTE = 16
"""Lines about such sources in any minute, all sources together: the sender id in a header is
not authenticated, so a stranger cycling ids must not flood the log. The rest are counted
(``unknown_key_lines_suppressed``)."""
MAX_UNKNOWN_KEY_SOURCES = 1024
"""Sources whose last line is remembered (oldest forgotten first)."""


class Channel:
    """The byte before a frame's sealed body: which sub-keys sealed it (module docstring)."""

    MESSAGE = 0
    REQUEST = 1
    REFUSED = 2


def reply_tag(request: bytes) -> int:
    """The uint64 a reply to the sealed ``request`` is bound to: a hash of its sealed header
    (sender and counter, unique per request)."""
    return int.from_bytes(hashlib.blake2b(request[:HEADER_BYTES], digest_size=8).digest(), "big")


class Kind:
    """First byte of a frame's body."""

    MESSAGE = 0
    """A core message (codec body), handled as if it had come by UDP."""
    CONFIG_REQUEST = 1
    CONFIG_REPLY = 2
    SERVICE_REQUEST = 3
    """msgpack ``[name, config_id]``: where does this member serve ``name`` (e.g. the
    rendezvous store of a configuration)?"""
    SERVICE_REPLY = 4
    """msgpack ``port`` (int), or None when the member does not serve it (yet)."""
    KEY_CHECK = 5
    """Empty: does this member accept the key the request is sealed under? Answered with an
    empty ``KEY_CHECK_REPLY`` if so, else by the ``Channel.REFUSED`` frame."""
    KEY_CHECK_REPLY = 6


class TransportError(ConnectionError):
    """A request that got no valid reply: refused, timed out, or answered with a bad frame."""


class KeyRefused(TransportError):
    """A peer answered that it holds none of the keys this process sealed under.

    ``own``: the key ids of this process's ring, primary first; ``accepted``: the peer's,
    primary first; ``address``: the peer. Key ids only, never keys."""

    def __init__(self, address: Address, own: tuple[int, ...], accepted: tuple[int, ...]
                 ) -> None:
        self.address = address
        self.own = own
        self.accepted = accepted
        super().__init__(f"{address[0]}:{address[1]} accepts key ids {_ids(accepted)}, not "
                         f"key id {own[0]} this process seals with")


def _ids(ids: tuple[int, ...]) -> str:
    return ", ".join(map(str, ids)) or "none"


def _derived_ids(keyring: Keyring, label: bytes) -> dict[int, int]:
    """Key id of each cluster key -> the key id of its sub-key for ``label``
    (:meth:`Keyring.derive`): the key a frame to a peer on that cluster key goes under."""
    return {kid: key_id(secret) for kid, secret in keyring.derive_secrets(label).items()}


@dataclass(frozen=True, slots=True)
class Received:
    """An authenticated core message and where it came from."""

    sender: MemberId
    incarnation: int
    message: Message
    address: Address


OnMessage = Callable[[Received], None]
OnSendError = Callable[[Address, OSError], None]
Reply = tuple[int, bytes]
OnRequest = Callable[[int, bytes], "Reply | Awaitable[Reply | None] | None"]


class Transport:
    """UDP and TCP endpoints of member ``member_id`` (module docstring).

    Callbacks run on the event loop: ``on_message`` for every authenticated core message,
    ``on_send_error`` when a send to an address fails at once (e.g. ENETUNREACH),
    ``on_request(kind, body)`` for a TCP request, returning ``(kind, body)`` to reply or None,
    or an awaitable of either to hold the request until the answer exists (the handler bounds
    that wait; the connection is the requester's own, so nothing else waits behind it).

    Counters: ``rejected`` (datagrams, by reason), ``rejected_frames`` (TCP, by reason; module
    docstring),
    ``traffic`` (``datagrams_sent``, ``bytes_sent``, ``datagrams_received``,
    ``bytes_received``, ``frames_sent``, ``frames_received``, ``requests_held``, ``dropped_*``).
    """

    def __init__(
        self,
        cluster: str,
        keyring: Keyring,
        member_id: MemberId,
        *,
        on_message: OnMessage,
        on_send_error: OnSendError,
        on_request: OnRequest,
        on_unknown_key: Callable[[Address], None] | None = None,
        max_datagram_bytes: int = DEFAULT_MAX_DATAGRAM_BYTES,
    ) -> None:
        self.member_id = member_id
        self._keyring = keyring
        # Datagrams are bound to their receiver: a copy replayed to another member fails there.
        self._wire = Wire(cluster, keyring, member_id, max_datagram_bytes, bind_receiver=True)
        stream_keys = keyring.derive(STREAM_LABEL)
        self._message_sealer = Sealer(cluster, stream_keys, member_id)
        self._message_opener = Opener(cluster, stream_keys, member_id, bind_receiver=True)
        request_keys = keyring.derive(REQUEST_LABEL)
        self._request_sealer = Sealer(cluster, request_keys, member_id)
        self._request_opener = Opener(cluster, request_keys, member_id)
        self._cluster = cluster
        self._request_keys = request_keys
        self._stream_ids = _derived_ids(keyring, STREAM_LABEL)
        self._on_message = on_message
        self._on_send_error = on_send_error
        self._on_request = on_request
        self._on_unknown_key = on_unknown_key
        self._refused_frames: Counter[str] = Counter()
        self.traffic: Counter[str] = Counter()
        self.key_events: Counter[str] = Counter()
        """``refusals_sent`` (``Channel.REFUSED`` answers), ``unknown_key_lines`` (sources
        logged) and ``unknown_key_lines_suppressed`` (past the cap a minute)."""
        self._peer_kids: OrderedDict[MemberId, int] = OrderedDict()
        """Peers last heard under a key of this ring other than the primary: that key."""
        self._unknown_key_logged: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._unknown_key_lines: list[float] = []  # when the lines of the last minute were
        self._udp: asyncio.DatagramTransport | None = None
        self._udp_socket: socket.socket | None = None  # for the kernel's drop count
        self._server: asyncio.Server | None = None
        self._outbound: dict[Address, asyncio.Queue[bytes]] = {}
        self._writing = OwnedTasks(f"transport-{member_id:016x}-out", MAX_OUTBOUND_CONNECTIONS)
        self._inbound: set[asyncio.StreamWriter] = set()
        # Inbound handlers: made by asyncio.start_server, held from their first step.
        self._serving = OwnedTasks(f"transport-{member_id:016x}-in", MAX_INBOUND_CONNECTIONS)
        self._unproven: dict[asyncio.StreamWriter, None] = {}  # oldest first
        # Closed by an eviction, which counted them: their handler must not count them again.
        self._evicted: set[asyncio.StreamWriter] = set()
        self._closed = False  # close() ends every connection: that is no peer's drop
        self._sending_to: Address | None = None
        self.address: Address | None = None

    @property
    def rejected(self) -> Counter[str]:
        """Datagrams dropped, by reason: the wire's, and ``kernel_dropped`` (module docstring).
        The live counter; the kernel's figure is written into it when read."""
        rejected = self._wire.rejected
        if self._udp is not None and not self._udp.is_closing() and self._udp_socket is not None:
            dropped = socket_drops(self._udp_socket)
            if dropped:
                rejected["kernel_dropped"] = dropped
        return rejected

    @property
    def rejected_frames(self) -> Counter[str]:
        """Inbound connections and frames dropped, by reason, and ``kernel_dropped`` (module
        docstring). The live counter; the kernel's figure is written into it when read."""
        listening = self._server.sockets if self._server is not None else ()
        dropped = sum(socket_drops(s) or 0 for s in listening)
        if dropped:
            self._refused_frames["kernel_dropped"] = dropped
        return self._refused_frames

    @property
    def keyring(self) -> Keyring:
        """The keyring this transport seals and opens with."""
        return self._keyring

    def rekey(self, keyring: Keyring) -> None:
        """Seal and open under ``keyring`` from now on (module docstring): counters and replay
        windows are kept, the peers remembered on another key are forgotten."""
        self._keyring = keyring
        self._wire.rekey(keyring)
        stream_keys = keyring.derive(STREAM_LABEL)
        self._message_sealer.rekey(stream_keys)
        self._message_opener.rekey(stream_keys)
        self._request_keys = keyring.derive(REQUEST_LABEL)
        self._request_sealer.rekey(self._request_keys)
        self._request_opener.rekey(self._request_keys)
        self._stream_ids = _derived_ids(keyring, STREAM_LABEL)
        self._peer_kids.clear()

    def peer_key_id(self, member: MemberId) -> int:
        """The key id to seal to ``member`` under: the key it was last heard under if this
        ring accepts it and it is not the primary, else the primary."""
        return self._peer_kids.get(member, self._keyring.primary_id)

    def _heard(self, sender: MemberId, kid: int) -> None:
        """``sender`` sealed under ``kid`` (authenticated): seal to it under that key."""
        peers = self._peer_kids
        if kid == self._keyring.primary_id:
            peers.pop(sender, None)
            return
        peers[sender] = kid
        peers.move_to_end(sender)
        while len(peers) > MAX_PEER_KEYS:
            peers.popitem(last=False)

    def _unknown_key(self, data: bytes, address: Address, what: str) -> None:
        """``data`` (a sealed header first) came under a key id this ring lacks: log its source
        at most once a minute (module docstring), tell the owner. The key id is named for
        datagrams only: a frame's is that of a sub-key, which says nothing to an operator."""
        _version, kid, sender, _inc, _counter = HEADER.unpack_from(data)
        under = f"key id {kid}" if what == "datagrams" else "a key"
        now = time.monotonic()
        source = (address[0], sender)
        logged = self._unknown_key_logged
        last = logged.get(source)
        if last is None or now - last >= UNKNOWN_KEY_LOG_S:
            lines = self._unknown_key_lines
            while lines and now - lines[0] >= 60.0:
                lines.pop(0)
            if len(lines) < UNKNOWN_KEY_LINES_PER_MINUTE:
                lines.append(now)
                logged[source] = now
                logged.move_to_end(source)
                while len(logged) > MAX_UNKNOWN_KEY_SOURCES:
                    logged.popitem(last=False)
                self.key_events["unknown_key_lines"] += 1
                log.warning("dropping %s from %s (member %016x): sealed under %s this member "
                            "does not accept (it accepts key ids %s); logged once a minute per "
                            "source, counted as unknown_key", what, address[0], sender, under,
                            _ids(self._keyring.key_ids))
            else:
                self.key_events["unknown_key_lines_suppressed"] += 1
        if self._on_unknown_key is not None:
            try:
                self._on_unknown_key(address)
            except Exception:  # the owner's code: it must not break the socket
                self.traffic["handler_errors"] += 1
                log.exception("handling a datagram under an unknown key failed")

    # ------------------------------------------------------------------ lifecycle

    async def start(self, bind: Address, fds: tuple[int, int] | None = None) -> Address:
        """Bind UDP and TCP on ``bind`` (port 0: a free port both can use), or serve on the
        inherited UDP and TCP sockets ``fds`` already bound to it; return the address.

        Raises:
            OSError: the address cannot be bound, or listening on ``fds`` failed.
            :class:`.sockets.NotInherited`: ``fds`` are not such sockets (left open).
        """
        loop = asyncio.get_running_loop()
        host, port = bind
        if fds is not None:
            sock = adopt_socket(fds[0], socket.SOCK_DGRAM, bind)
            actual = sock.getsockname()[1]
            with ExitStack() as on_error:  # whatever was taken is closed if a step fails
                on_error.callback(sock.close)
                tcp = adopt_socket(fds[1], socket.SOCK_STREAM, (host, actual))
                on_error.callback(tcp.close)
                udp, _ = await loop.create_datagram_endpoint(lambda: _Datagrams(self),
                                                             sock=sock)
                on_error.callback(udp.close)
                self._server = await asyncio.start_server(self._serve, sock=tcp,
                                                          limit=MAX_INBOUND_FRAME + 8)
                on_error.pop_all()
            self._udp, self._udp_socket = udp, sock
            self.address = (host, actual)
            return self.address
        for _ in range(20 if port == 0 else 1):
            # Bound here, not by create_datagram_endpoint: uvloop leaks its transport when
            # the bind inside it fails.
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                raise
            sock.setblocking(False)
            udp, _ = await loop.create_datagram_endpoint(lambda: _Datagrams(self), sock=sock)
            actual = sock.getsockname()[1]
            try:
                self._server = await asyncio.start_server(
                    self._serve, host, actual, limit=MAX_INBOUND_FRAME + 8,
                    reuse_address=True)
            except OSError:
                udp.close()
                await asyncio.sleep(0)  # let the transport finish closing
                if port != 0:
                    raise
                continue  # the TCP port of that number is taken: draw another
            self._udp, self._udp_socket = udp, sock
            self.address = (host, actual)
            return self.address
        raise OSError(f"no port free for both UDP and TCP on {host}")

    async def close(self) -> None:
        """Close both sockets and every connection; bounded (cancels what is left)."""
        self._closed = True
        if self._udp is not None:
            self._udp.close()
        if self._server is not None:
            self._server.close()
        # Inbound handlers end on EOF (on Python 3.11 a cancelled one makes asyncio's stream
        # callback log a spurious traceback); the rest is cancelled, all within 2 s.
        for writer in list(self._inbound):
            writer.close()
        await asyncio.gather(self._writing.close(2.0), self._serving.wait(2.0))
        self._serving.cancel()  # handlers still reading after 2 s
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except TimeoutError:
                log.warning("TCP server of %016x did not close within 2 s", self.member_id)

    # ------------------------------------------------------------------ sending

    def send(self, address: Address, message: Message, incarnation: int, to: MemberId) -> None:
        """Seal ``message`` for member ``to`` and send it to ``address``: UDP if it fits (bound
        to ``to``), else a TCP frame.

        Never raises for a peer's sake: an unsendable message is counted (``dropped_invalid``)
        and a failing socket is reported through ``on_send_error``.
        """
        if self._udp is None or self._udp.is_closing():
            return
        try:
            datagram = self._wire.seal(message, incarnation, to, self._peer_kids.get(to))
        except ValueError:
            self._send_frame_message(address, message, incarnation, to)
            return
        self._sending_to = address
        try:
            self._udp.sendto(datagram, address)
        finally:
            self._sending_to = None
        self.traffic["datagrams_sent"] += 1
        self.traffic["bytes_sent"] += len(datagram)

    def _send_frame_message(self, address: Address, message: Message, incarnation: int,
                            to: MemberId) -> None:
        try:
            body = encode(message)
        except ValueError:
            self.traffic["dropped_invalid"] += 1
            log.exception("core produced a message the codec refuses: %r", message)
            return
        kid = self._peer_kids.get(to)
        frame = self._frame(Channel.MESSAGE, self._message_sealer.seal(
            bytes((Kind.MESSAGE,)) + body, incarnation, to,
            None if kid is None else self._stream_ids.get(kid)))
        queue = self._outbound.get(address)
        if queue is None:
            queue = self._outbound[address] = asyncio.Queue(OUTBOUND_QUEUE)
            try:
                self._writing.spawn(self._write_frames(address, queue),
                                    name=f"write {address[0]}:{address[1]}")
            except TaskLimitReached:
                del self._outbound[address]
                self.traffic["dropped_queue_full"] += 1
                return
        try:
            queue.put_nowait(frame)
        except asyncio.QueueFull:
            self.traffic["dropped_queue_full"] += 1

    @staticmethod
    def _frame(channel: int, sealed: bytes) -> bytes:
        return _LENGTH.pack(1 + len(sealed)) + bytes((channel,)) + sealed

    async def _write_frames(self, address: Address, queue: asyncio.Queue[bytes]) -> None:
        writer = None
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(*address), CONNECT_TIMEOUT_S)
            while True:
                try:
                    frame = await asyncio.wait_for(queue.get(), IDLE_TIMEOUT_S)
                except TimeoutError:
                    return
                writer.write(frame)
                await asyncio.wait_for(writer.drain(), CONNECT_TIMEOUT_S)
                self.traffic["frames_sent"] += 1
                self.traffic["bytes_sent"] += len(frame)
        except (OSError, TimeoutError) as exc:
            self.traffic["dropped_connect_failed"] += queue.qsize() + 1
            if isinstance(exc, OSError):
                self._on_send_error(address, exc)
        finally:
            if self._outbound.get(address) is queue:
                del self._outbound[address]
            if writer is not None:
                writer.close()

    # ------------------------------------------------------------------ requests

    async def request(self, address: Address, kind: int, body: bytes, *,
                      timeout_s: float = 5.0) -> tuple[int, bytes]:
        """Send one request frame to ``address`` and return the reply's (kind, body).

        Raises:
            KeyRefused: ``address`` holds none of this ring's keys it was sealed under (its
                ``Channel.REFUSED`` answer).
            TransportError: no connection, no reply within ``timeout_s`` seconds, or a reply
                that does not open under the cluster key.
        """
        writer = None
        request = self._request_sealer.seal(bytes((kind,)) + body, 0)
        try:
            async with asyncio.timeout(timeout_s):
                reader, writer = await asyncio.open_connection(*address, limit=1 << 20)
                writer.write(self._frame(Channel.REQUEST, request))
                await writer.drain()
                header = await reader.readexactly(_LENGTH.size)
                (size,) = _LENGTH.unpack(header)
                if size > MAX_REPLY_FRAME:
                    raise TransportError(f"reply of {size} bytes from {address} is too large")
                data = await reader.readexactly(size)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            raise TransportError(f"request to {address[0]}:{address[1]} failed: {exc!r}") from exc
        finally:
            if writer is not None:
                writer.close()
        # A fresh opener: replies come from whoever answers, on a one-off connection; only a
        # reply bound to this very request opens.
        if data[:1] == bytes((Channel.REFUSED,)):
            raise KeyRefused(address, self._keyring.key_ids, tuple(data[1:257]))
        opener = Opener(self._cluster, self._request_keys, self.member_id,
                        bind_receiver=True, receiver=reply_tag(request))
        try:
            if not data or data[0] != Channel.REQUEST:
                raise OpenError("bad_channel")
            _, _, plain = opener.open(data[1:])
        except OpenError as exc:
            raise TransportError(f"reply from {address} rejected: {exc.reason}") from exc
        if not plain:
            raise TransportError(f"empty reply from {address}")
        return plain[0], plain[1:]

    # ------------------------------------------------------------------ receiving

    def _datagram(self, data: bytes, address: Address) -> None:
        self.traffic["datagrams_received"] += 1
        self.traffic["bytes_received"] += len(data)
        opened = self._wire.open(data)
        if opened is not None:
            self._heard(opened.sender, data[1])
            self._deliver(Received(opened.sender, opened.incarnation, opened.message,
                                   (address[0], address[1])))
        elif (len(data) >= OVERHEAD_BYTES and data[0] == VERSION
              and self._keyring.cipher(data[1]) is None):
            self._unknown_key(data, (address[0], address[1]), "datagrams")

    def _deliver(self, received: Received) -> None:
        try:
            self._on_message(received)
        except Exception:  # a bug in our handler must not kill the socket
            self.traffic["handler_errors"] += 1
            log.exception("handling a message from %016x failed", received.sender)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._inbound) >= MAX_INBOUND_CONNECTIONS:
            self._refused_frames["too_many_connections"] += 1
            writer.close()
            return
        if len(self._unproven) >= MAX_UNPROVEN_CONNECTIONS:
            self._refused_frames["evicted_unproven"] += 1
            oldest = next(iter(self._unproven))
            del self._unproven[oldest]
            self._evicted.add(oldest)
            oldest.close()  # its handler then reads EOF and ends, counting nothing more
        self._inbound.add(writer)
        self._unproven[writer] = None
        task = asyncio.current_task()
        if task is not None:  # within the bound: its connection passed the check above
            self._serving.adopt(task)
        peer = writer.get_extra_info("peername") or ("?", 0)
        timeout_s = FIRST_FRAME_TIMEOUT_S
        try:
            while True:
                ending = await self._serve_frame(reader, writer, (peer[0], peer[1]), timeout_s)
                if ending is not None:
                    endings = _UNPROVEN_ENDINGS if writer in self._unproven else _PROVEN_ENDINGS
                    reason = endings.get(ending, ending)
                    if reason is not None and writer not in self._evicted and not self._closed:
                        self._refused_frames[reason] += 1
                    return
                self._unproven.pop(writer, None)
                timeout_s = IDLE_TIMEOUT_S
        finally:
            self._inbound.discard(writer)
            self._unproven.pop(writer, None)
            self._evicted.discard(writer)
            writer.close()

    async def _serve_frame(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           peer: Address, timeout_s: float) -> str | None:
        """Read and handle one frame; why the connection ends, or None. Between frames: ``closed``
        (end of stream), ``timeout`` (nothing for ``timeout_s``), ``reset`` (a socket error);
        ``truncated`` for any of them inside a frame; else the frame's reason."""
        inside = False  # a frame's length is in: ending from here on drops that frame
        try:
            async with asyncio.timeout(timeout_s):
                header = await reader.readexactly(_LENGTH.size)
                inside = True
                (size,) = _LENGTH.unpack(header)
                if size > MAX_INBOUND_FRAME:
                    return "too_large"
                if size < 1 + OVERHEAD_BYTES + 1:
                    return "too_short"
                data = await reader.readexactly(size)
        except asyncio.IncompleteReadError as exc:
            return "truncated" if inside or exc.partial else "closed"
        except TimeoutError:
            return "truncated" if inside else "timeout"
        except OSError:
            return "truncated" if inside else "reset"
        self.traffic["frames_received"] += 1
        self.traffic["bytes_received"] += _LENGTH.size + size
        channel, sealed = data[0], data[1:]
        if channel == Channel.MESSAGE:
            return self._serve_message(sealed, peer)
        if channel != Channel.REQUEST:
            return "bad_channel"
        try:
            _, _, plain = self._request_opener.open(sealed)
        except OpenError as exc:
            if exc.reason == "unknown_key":
                await self._refuse(writer)
                self._unknown_key(sealed, peer, "requests")
            return exc.reason
        try:
            reply = self._on_request(plain[0], plain[1:])
            if inspect.isawaitable(reply):
                self.traffic["requests_held"] += 1
                self._unproven.pop(writer, None)  # it opened under the key: no stranger
                reply = await reply
        except Exception:  # a bug in our handler must not escape into asyncio's callback
            self.traffic["handler_errors"] += 1
            log.exception("handling a request of kind %d failed", plain[0])
            return "handler_error"
        if reply is None:
            return "unknown_kind"
        try:
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                writer.write(self._frame(Channel.REQUEST, self._request_sealer.seal(
                    bytes((reply[0],)) + reply[1], 0, reply_tag(sealed), sealed[1])))
                await writer.drain()
        except (OSError, RuntimeError, TimeoutError):
            # uvloop raises RuntimeError, not OSError, writing to a transport the requester
            # closed while its request was held (a lookup cancelled, its deadline passed).
            return "reply_not_taken"
        return None

    async def _refuse(self, writer: asyncio.StreamWriter) -> None:
        """Answer a request under an unknown key with this ring's key ids (``Channel.REFUSED``),
        within ``CONNECT_TIMEOUT_S``; a requester that does not read it loses nothing."""
        ids = bytes(self._keyring.key_ids)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                writer.write(_LENGTH.pack(1 + len(ids)) + bytes((Channel.REFUSED,)) + ids)
                await writer.drain()
            self.key_events["refusals_sent"] += 1
        except (OSError, RuntimeError, TimeoutError):
            pass

    def _serve_message(self, sealed: bytes, peer: Address) -> str | None:
        try:
            sender, incarnation, plain = self._message_opener.open(sealed)
        except OpenError as exc:
            if exc.reason == "unknown_key":
                self._unknown_key(sealed, peer, "frames")
            return exc.reason
        for kid, derived in self._stream_ids.items():  # a handful of keys
            if derived == sealed[1]:
                self._heard(sender, kid)
        if plain[0] != Kind.MESSAGE:
            return "unknown_kind"
        try:
            message = decode(plain[1:])
        except DecodeError as exc:
            return "decode_" + exc.reason
        self._deliver(Received(sender, incarnation, message, peer))
        return None


_UNPROVEN_ENDINGS: dict[str, str | None] = {
    "closed": "empty", "timeout": "first_frame_timeout", "reset": "reset"}
"""The reason counted when a connection without an authenticated frame ends between frames:
whatever it was, it delivered nothing."""
_PROVEN_ENDINGS: dict[str, str | None] = {"closed": None, "timeout": None, "reset": None}
"""A proven connection ending between frames (its peer done, gone, or idle for
``IDLE_TIMEOUT_S``) dropped nothing: not counted."""


class _Datagrams(asyncio.DatagramProtocol):
    def __init__(self, owner: Transport) -> None:
        self._owner = owner

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self._owner._datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        # asyncio reports a failed sendto here, synchronously inside sendto(), so the
        # destination is still known; ICMP errors arriving later have none and are counted only.
        owner = self._owner
        owner.traffic["send_errors"] += 1
        if owner._sending_to is not None and isinstance(exc, OSError):
            owner._on_send_error(owner._sending_to, exc)
