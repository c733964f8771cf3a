"""Messages <-> datagrams: the codec (:mod:`.codec`) inside AEAD sealing (:mod:`.seal`).

:class:`Wire` is what a member's host uses: ``seal`` a message for sending, ``open`` whatever
arrived on the socket. ``open`` never raises: a bad datagram is a peer's fault (or an
attacker's), so it is dropped, counted in ``rejected[reason]`` and returns ``None``.

:class:`NullWire` has the same interface and the same datagram layout and size, with a zero tag
instead of encryption and no replay window: the simulator uses it at scale (docs/design.md section
11). Never use it on a real network.

Rejection reasons (keys of ``rejected``):

=====================  ========================================================================
``not_bytes``          ``data`` is not bytes, bytearray or memoryview
``too_large``          longer than ``max_datagram_bytes``
``too_short``          shorter than header + tag (34 bytes)
``bad_version``        header version is not :data:`~.seal.VERSION`
``unknown_key``        no key of the keyring has the header's key id
``from_self``          the header names this member as sender (a reflected datagram)
``stale_incarnation``  the sender's incarnation is older than one already seen
``replay``             counter already seen, or older than the replay window
``auth_failed``        ChaCha20-Poly1305 tag does not verify (forged, corrupt, other cluster)
``decode_<reason>``    authentic but the body does not decode (:class:`.codec.DecodeError`)
=====================  ========================================================================
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torchpass_p2p.core.codec import DecodeError, decode, encode
from torchpass_p2p.core.messages import MAX_INCARNATION, MAX_MEMBER_ID, MemberId, Message
from torchpass_p2p.core.seal import (
    DEFAULT_MAX_SENDERS,
    HEADER,
    HEADER_BYTES,
    MAX_COUNTER,
    OVERHEAD_BYTES,
    TAG_BYTES,
    VERSION,
    Keyring,
    Opener,
    OpenError,
    Sealer,
)

DEFAULT_MAX_DATAGRAM_BYTES = 1400
"""Fits a 1,500-byte Ethernet MTU after IPv6 (40) and UDP (8) headers with room for tunnels
(VXLAN adds 50), so datagrams are never fragmented; memberlist's UDPBufferSize is the same."""
MAX_UDP_PAYLOAD_BYTES = 65507
"""Largest UDP payload over IPv4 (65,535 - 20 - 8)."""


@dataclass(frozen=True, slots=True)
class Opened:
    """An accepted datagram: authenticated ``sender`` and its ``incarnation``, and the message."""

    sender: MemberId
    incarnation: int
    message: Message


def _check_common(cluster: str, member_id: int, max_datagram_bytes: int) -> None:
    if not isinstance(cluster, str) or not cluster:
        raise ValueError("cluster name must be a non-empty str")
    if type(member_id) is not int or not 0 <= member_id <= MAX_MEMBER_ID:
        raise ValueError(f"member id must be a uint64, got {member_id!r}")
    if type(max_datagram_bytes) is not int or not (
        OVERHEAD_BYTES < max_datagram_bytes <= MAX_UDP_PAYLOAD_BYTES
    ):
        raise ValueError(
            f"max_datagram_bytes must be in {OVERHEAD_BYTES + 1}..{MAX_UDP_PAYLOAD_BYTES}"
        )


def _as_bytes(data: object, max_bytes: int) -> bytes | str:
    """``data`` as bytes, or the reason to reject it; sizes are checked before any copy."""
    if type(data) is bytes:
        size = len(data)
    elif isinstance(data, memoryview):
        size = data.nbytes
    elif isinstance(data, (bytes, bytearray)):
        size = len(data)
    else:
        return "not_bytes"
    if size > max_bytes:
        return "too_large"
    return data if type(data) is bytes else bytes(data)  # type: ignore[return-value]


class Wire:
    """Seals messages from ``member_id`` and opens datagrams for it, within one ``cluster``.

    * ``rejected``: ``Counter`` of dropped datagrams by reason (module table).
    * ``accepted``: number of datagrams ``open`` returned.
    * ``seal_count``: number of datagrams ``seal`` produced (also the next counter).

    ``bind_receiver``: open only datagrams sealed ``to`` this member (a live agent's setting;
    the simulator, which nobody replays into, leaves it off).

    Raises ``ValueError`` on construction for an empty cluster name, a member id that is not a
    uint64, or ``max_datagram_bytes`` outside 35..65,507.
    """

    __slots__ = (
        "cluster",
        "member_id",
        "max_datagram_bytes",
        "rejected",
        "accepted",
        "_sealer",
        "_opener",
    )

    def __init__(
        self,
        cluster: str,
        keyring: Keyring,
        member_id: int,
        max_datagram_bytes: int = DEFAULT_MAX_DATAGRAM_BYTES,
        *,
        max_senders: int = DEFAULT_MAX_SENDERS,
        bind_receiver: bool = False,
    ) -> None:
        _check_common(cluster, member_id, max_datagram_bytes)
        self.cluster = cluster
        self.member_id = member_id
        self.max_datagram_bytes = max_datagram_bytes
        self.rejected: Counter[str] = Counter()
        self.accepted = 0
        self._sealer = Sealer(cluster, keyring, member_id)
        self._opener = Opener(cluster, keyring, member_id, max_senders,
                              bind_receiver=bind_receiver)

    @property
    def seal_count(self) -> int:
        """Datagrams sealed so far (the next datagram's counter)."""
        return self._sealer.counter

    def rekey(self, keyring: Keyring) -> None:
        """Seal and open under ``keyring`` from now on (a reloaded key file), keeping the
        datagram counter and the replay windows (:meth:`.seal.Sealer.rekey`)."""
        self._sealer.rekey(keyring)
        self._opener.rekey(keyring)

    def seal(self, message: Message, incarnation: int, to: int | None = None,
             kid: int | None = None) -> bytes:
        """The datagram (bytes, ``len(encode(message)) + 34``) carrying ``message`` from this
        member at ``incarnation``; ``to`` binds it to its receiver (receivers built with
        ``bind_receiver`` need it, see :meth:`.seal.Sealer.seal`); ``kid`` seals it under that
        key of the ring instead of the primary.

        Raises ``ValueError`` if the message is invalid (:func:`.codec.encode`), the datagram
        would exceed ``max_datagram_bytes``, or ``incarnation`` is below an earlier one;
        ``OverflowError`` when the datagram counter is exhausted (restart as a new member).
        """
        body = encode(message)
        if len(body) + OVERHEAD_BYTES > self.max_datagram_bytes:
            raise ValueError(
                f"{type(message).__name__} of {len(body) + OVERHEAD_BYTES} bytes exceeds "
                f"max_datagram_bytes={self.max_datagram_bytes}: send fewer updates"
            )
        return self._sealer.seal(body, incarnation, to, kid)

    def open(self, data: bytes) -> Opened | None:
        """The message in datagram ``data``, or ``None`` (counted in ``rejected``). Never
        raises."""
        raw = _as_bytes(data, self.max_datagram_bytes)
        if isinstance(raw, str):
            self.rejected[raw] += 1
            return None
        try:
            sender, incarnation, body = self._opener.open(raw)
            message = decode(body)
        except OpenError as exc:
            self.rejected[exc.reason] += 1
            return None
        except DecodeError as exc:
            self.rejected["decode_" + exc.reason] += 1
            return None
        self.accepted += 1
        return Opened(sender, incarnation, message)


_NULL_TAG = bytes(TAG_BYTES)


class NullWire:
    """:class:`Wire` without cryptography, for the simulator at scale: same interface, same
    datagram layout and length (key id 0, the tag all zero bytes, the body in clear), no
    authentication and no replay window. Rejection reasons: ``not_bytes``, ``too_large``,
    ``too_short``, ``bad_version``, ``from_self``, ``decode_<reason>``.

    ``keyring`` is accepted and ignored so the two classes construct alike.
    """

    __slots__ = (
        "cluster",
        "member_id",
        "max_datagram_bytes",
        "rejected",
        "accepted",
        "seal_count",
        "_incarnation",
    )

    def __init__(
        self,
        cluster: str,
        keyring: Keyring | None,
        member_id: int,
        max_datagram_bytes: int = DEFAULT_MAX_DATAGRAM_BYTES,
        *,
        max_senders: int = DEFAULT_MAX_SENDERS,
    ) -> None:
        del keyring, max_senders
        _check_common(cluster, member_id, max_datagram_bytes)
        self.cluster = cluster
        self.member_id = member_id
        self.max_datagram_bytes = max_datagram_bytes
        self.rejected: Counter[str] = Counter()
        self.accepted = 0
        self.seal_count = 0
        self._incarnation = 0

    def seal(self, message: Message, incarnation: int) -> bytes:
        """As :meth:`Wire.seal`, unencrypted. Raises the same errors."""
        body = encode(message)
        if len(body) + OVERHEAD_BYTES > self.max_datagram_bytes:
            raise ValueError(
                f"{type(message).__name__} of {len(body) + OVERHEAD_BYTES} bytes exceeds "
                f"max_datagram_bytes={self.max_datagram_bytes}: send fewer updates"
            )
        if self.seal_count > MAX_COUNTER:
            raise OverflowError("datagram counter exhausted: restart under a new member id")
        if type(incarnation) is not int or not self._incarnation <= incarnation <= MAX_INCARNATION:
            raise ValueError(f"incarnation {incarnation!r} is not a uint32 >= {self._incarnation}")
        self._incarnation = incarnation
        header = HEADER.pack(VERSION, 0, self.member_id, incarnation, self.seal_count)
        self.seal_count += 1
        return header + body + _NULL_TAG

    def open(self, data: bytes) -> Opened | None:
        """As :meth:`Wire.open`, without authentication or replay checks. Never raises."""
        raw = _as_bytes(data, self.max_datagram_bytes)
        if isinstance(raw, str):
            self.rejected[raw] += 1
            return None
        if len(raw) < OVERHEAD_BYTES:
            self.rejected["too_short"] += 1
            return None
        version, _kid, sender, incarnation, _counter = HEADER.unpack_from(raw)
        if version != VERSION:
            self.rejected["bad_version"] += 1
            return None
        if sender == self.member_id:
            self.rejected["from_self"] += 1
            return None
        try:
            message = decode(raw[HEADER_BYTES:-TAG_BYTES])
        except DecodeError as exc:
            self.rejected["decode_" + exc.reason] += 1
            return None
        self.accepted += 1
        return Opened(sender, incarnation, message)
