"""Pulse pings: an authenticated UDP "are you alive" answered by a native thread.

Why native: probes answered from a member's asyncio loop fall silent while a thread holds the
GIL, for up to 3 s in scenario S01, so such probes cannot convict anyone sooner than that, even a
process that is SIGSTOPped or gone. The responder (``_pulse.c``) is a pthread that never takes
the GIL nor touches a Python object: a process whose loop is merely blocked keeps answering; one
that is stopped (SIGSTOP, cgroup freeze), dead or cut off does not.

Wire format, version 2 (fixed binary, big-endian; HMAC is HMAC-SHA256, RFC 2104, truncated to
16 bytes):

    ping, 45 bytes: b"TPp2" | key id (1) | target member id (8, unsigned) | nonce (16)
                    | HMAC(keys[key id], bytes 0..28)[:16]
                    nonce = prober's member id (8, unsigned) | sequence (8, unsigned, from 1)
    pong, 45 bytes: b"TPq2" | key id (1) | the ping's nonce (16) | member id (8, unsigned)
                    | HMAC(keys[key id], bytes 0..28)[:16]

The responder answers a ping only if it has exactly 45 bytes, the magic, a known key id, its
own member id as the target and a tag that verifies (compared in constant time); it answers
under the same key id and counts every dropped datagram by reason. Secrets are 32 bytes.

No reflection: a ping binds the member it is for under its tag, so one captured on its way to
one member and relayed to others is dropped by every one of them (``misdirected``). A ping whose
sequence is not above the last one its prober sent (:func:`ping_nonce`) is a replay: dropped and
counted, not answered, so a captured ping sent again to its own target can neither reflect
pongs at a spoofed address nor crowd out the prober's real pings. Both checks come before the
tag: a flood of captured pings costs a compare or a table lookup each, never an HMAC. A pong is
no bigger than its ping (no amplification). The prober matches a pong to its outstanding ping by
nonce and checks the answering member, so a replayed pong proves nothing.

Version 1 (b"TPp1"/b"TPq1": a 37-byte ping without its target, answered by any responder that
had not seen its sequence) is not understood: its pings are ``malformed`` here, and a version 1
prober drops these pongs, so mixed versions read as silence, never as a half-checked answer.
"""

from __future__ import annotations

import hmac
import socket
import struct
import warnings
from collections.abc import Mapping
from types import TracebackType

from torchpass_p2p.kernel_drops import socket_drops

try:
    from . import _pulse
except ImportError:  # not built: scripts/build-native
    _pulse = None  # type: ignore[assignment]

__all__ = [
    "KEY_BYTES", "MEMBER_BYTES", "NATIVE", "NONCE_BYTES", "PING_BYTES", "PING_MAGIC",
    "PONG_BYTES", "PONG_MAGIC", "TAG_BYTES", "PulseResponder", "PulseUnavailable", "available",
    "decode_ping", "decode_pong", "encode_ping", "encode_pong", "ping_nonce",
]

PING_MAGIC = b"TPp2"
PONG_MAGIC = b"TPq2"
KEY_BYTES = 32  # a full SHA-256 block's worth of entropy is more than HMAC-SHA256 can use
NONCE_BYTES = 16
TAG_BYTES = 16  # 128-bit tags: forging one is out of reach; the rest of the digest buys nothing
MEMBER_BYTES = 8
PING_BYTES = len(PING_MAGIC) + 1 + MEMBER_BYTES + NONCE_BYTES + TAG_BYTES  # 45
PONG_BYTES = len(PONG_MAGIC) + 1 + NONCE_BYTES + MEMBER_BYTES + TAG_BYTES  # 45
_MEMBER = struct.Struct(">Q")

NATIVE: bool = _pulse is not None
"""Whether the compiled responder (``_pulse``) imported."""


class PulseUnavailable(RuntimeError):
    """The native responder is not built (it needs a C compiler and OpenSSL's libcrypto)."""


def available() -> bool:
    """Whether :class:`PulseResponder` can start (the compiled ``_pulse`` imported)."""
    return NATIVE


def _tag(secret: bytes, data: bytes) -> bytes:
    return hmac.digest(secret, data, "sha256")[:TAG_BYTES]


def _check(kid: int, secret: bytes, nonce: bytes) -> None:
    if not 0 <= kid <= 255:
        raise ValueError(f"key id must be in 0..255, not {kid}")
    if len(secret) != KEY_BYTES:
        raise ValueError(f"secret must be {KEY_BYTES} bytes, not {len(secret)}")
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"nonce must be {NONCE_BYTES} bytes, not {len(nonce)}")


def ping_nonce(prober: int, seq: int) -> bytes:
    """The nonce of the ``seq``-th ping (1, 2, ...) of prober ``prober`` (a member id): 16
    bytes. Raises ``OverflowError`` outside 0..2**64-1."""
    return _MEMBER.pack(prober) + _MEMBER.pack(seq)


def encode_ping(kid: int, secret: bytes, nonce: bytes, target: int) -> bytes:
    """A 45-byte ping for the responder of member ``target`` (0..2**64-1) under key ``kid``
    (0..255) with ``secret`` (32 bytes) and ``nonce`` (16 bytes, fresh per ping:
    :func:`ping_nonce`). Raises ValueError on a bad argument (struct.error, a ValueError, for
    ``target``)."""
    _check(kid, secret, nonce)
    head = PING_MAGIC + bytes([kid]) + _MEMBER.pack(target) + nonce
    return head + _tag(secret, head)


def decode_ping(data: bytes, secrets: Mapping[int, bytes]) -> tuple[int, bytes] | None:
    """``(target, nonce)`` from a ping whose tag verifies under ``secrets[key id]``; None for
    anything else. What the native responder checks, bar the target and the sequence (tests
    and tools read captured pings with it). Never raises on any bytes."""
    if not _verified(data, PING_BYTES, PING_MAGIC, secrets):
        return None
    start = 5 + MEMBER_BYTES
    return _MEMBER.unpack_from(data, 5)[0], bytes(data[start:start + NONCE_BYTES])


def encode_pong(kid: int, secret: bytes, nonce: bytes, member: int) -> bytes:
    """The 45-byte pong the responder of ``member`` (0..2**64-1) sends for a ping under ``kid``
    carrying ``nonce``: the native code's reply, spelled out (tests compare the two). Raises
    ValueError on a bad argument (struct.error, a ValueError, for ``member``)."""
    _check(kid, secret, nonce)
    head = PONG_MAGIC + bytes([kid]) + nonce + _MEMBER.pack(member)
    return head + _tag(secret, head)


def decode_pong(data: bytes, secrets: Mapping[int, bytes]) -> tuple[bytes, int] | None:
    """``(nonce, member)`` from a pong whose tag verifies under ``secrets[key id]``; None for
    anything else (wrong length or magic, unknown key id, bad tag). Never raises on any bytes."""
    if not _verified(data, PONG_BYTES, PONG_MAGIC, secrets):
        return None
    return bytes(data[5:5 + NONCE_BYTES]), _MEMBER.unpack_from(data, 5 + NONCE_BYTES)[0]


def _verified(data: bytes, size: int, magic: bytes, secrets: Mapping[int, bytes]) -> bool:
    """``data`` is ``size`` bytes, starts with ``magic`` and its tag verifies under the secret
    of its key id (byte 4). Never raises on any bytes."""
    if len(data) != size or data[:4] != magic:
        return False
    secret = secrets.get(data[4])
    if secret is None:
        return False
    return hmac.compare_digest(_tag(secret, data[:-TAG_BYTES]), data[-TAG_BYTES:])


class PulseResponder:
    """A native thread answering pings on a UDP socket it owns, until :meth:`close`.

    ``start(host, member, secrets)`` binds ``host`` (an address such as "127.0.0.1" or "::1";
    its family decides the socket's) on an ephemeral port, read from :attr:`port`. Use as a
    context manager, or call :meth:`close`; one left open warns (ResourceWarning) when collected.
    """

    def __init__(self, sock: socket.socket, responder: _pulse.Responder) -> None:
        """Use :meth:`start`."""
        self._sock = sock
        self._responder: _pulse.Responder | None = responder
        self._final: dict[str, int] = {}
        self._before: dict[str, int] = {}  # counts of the threads a rekey replaced
        self._member = -1
        self.port: int = sock.getsockname()[1]

    @classmethod
    def start(cls, host: str, member: int, secrets: Mapping[int, bytes]) -> PulseResponder:
        """Bind a UDP socket on ``host``, port 0, and answer pings there for ``member``
        (0..2**64-1) under ``secrets`` (key id 0..255 -> 32-byte secret, at least one).

        Raises PulseUnavailable if the native module is not built; OSError if ``host`` does not
        resolve or bind; TypeError, ValueError or OverflowError on bad ``member`` or ``secrets``.
        """
        if _pulse is None:
            raise PulseUnavailable("the native pulse responder (torchpass_p2p.agent._pulse) is "
                                   "not built: build it with ./scripts/build-native")
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, 0, type=socket.SOCK_DGRAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(address)
            responder = _pulse.Responder(sock.fileno(), member, dict(secrets))
        except BaseException:
            sock.close()
            raise
        started = cls(sock, responder)
        started._member = member
        return started

    def rekey(self, secrets: Mapping[int, bytes]) -> None:
        """Answer under ``secrets`` from now on (a reloaded key file): the thread is stopped
        and a new one serves the same socket, so the port stays what observers looked up and
        pings queued meanwhile are answered. The new thread's replay table starts empty: a
        ping captured before can be answered once more (a pong, no bigger, to the address it
        names). Counts run on. No-op once closed.

        Raises TypeError or ValueError on bad ``secrets`` (the old thread then still serves)."""
        old = self._responder
        if old is None or _pulse is None:
            return
        keys = dict(secrets)  # checked before stopping: a bad mapping keeps the old thread
        for kid, secret in keys.items():
            _check(kid, secret, bytes(NONCE_BYTES))
        if not keys:
            raise ValueError("secrets must hold at least one key")
        old.stop()
        for name, value in old.counts().items():
            self._before[name] = self._before.get(name, 0) + value
        self._responder = _pulse.Responder(self._sock.fileno(), self._member, keys)

    def counts(self) -> dict[str, int]:
        """Datagrams by outcome since start: ``answered``, ``malformed`` (wrong length or
        magic), ``unknown_key``, ``misdirected`` (a ping for another member), ``bad_tag``,
        ``replayed``, ``send_errors``, ``receive_errors``; and ``kernel_dropped`` once the kernel
        dropped any (lost in a full receive buffer before the thread read them:
        :mod:`torchpass_p2p.kernel_drops`). After :meth:`close`, the final counts."""
        if self._responder is None:
            return dict(self._final)
        counts = self._responder.counts()
        for name, value in self._before.items():
            counts[name] = counts.get(name, 0) + value
        dropped = socket_drops(self._sock)
        if dropped:
            counts["kernel_dropped"] = dropped
        return counts

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._responder is None

    def close(self) -> None:
        """Stop the thread (waits for it, typically well under 1 ms), then close the socket.
        Idempotent."""
        if self._responder is not None:
            self._responder.stop()  # no datagram is read after this: the counts are final
            self._final = self.counts()
            self._responder = None
            self._sock.close()

    def __enter__(self) -> PulseResponder:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        # Stop the thread before the socket goes: its descriptor number could be reused.
        if getattr(self, "_responder", None) is not None:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1, source=self)
            self.close()

    def __repr__(self) -> str:
        return f"<PulseResponder port={self.port}{' closed' if self.closed else ''}>"
