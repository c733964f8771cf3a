"""Cost of the wire per datagram: encode + seal and open + decode, against plain msgpack.

Run ``python -m benchmarks.wire [--number N] [--repeats R]``. Prints one JSON object: for each
message shape, the median over ``repeats`` runs of the per-datagram time in microseconds of

* ``seal_encode_us``: :meth:`Wire.seal` (validate, msgpack, ChaCha20-Poly1305);
* ``open_decode_us``: :meth:`Wire.open` (replay window, ChaCha20-Poly1305, msgpack, validate,
  dataclasses), the updates already seen before, as gossip delivers each one about
  ``retransmit_mult * log10(N + 1)`` times to every member;
* ``open_decode_cold_us``: the same with every update new (decode cache empty for them);
* ``encode_us`` / ``decode_us``: the codec alone;
* ``baseline_encode_us`` / ``baseline_decode_us``: ``msgpack.packb`` of the prebuilt nested tuple
  and ``msgpack.unpackb`` of the body: no validation, no dataclasses, no sealing;

and the ratios of the first two to their baselines, and the datagram and body sizes in bytes.
Shapes: the hot path (a ping with 4 piggybacked updates, a gossip push of 24) and one agreement
message, a vote carrying a full 256-byte bitmap segment for a cut of 8 removals and one joiner
(no updates, so its hot and cold figures are the same work). Figures only: nothing here asserts a
time.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import cryptography
import msgpack

from torchpass_p2p.core import codec
from torchpass_p2p.core.messages import (
    Alert,
    Alive,
    Cut,
    Dead,
    Gossip,
    Joiner,
    Message,
    Ping,
    Topology,
    Update,
    Vote,
)
from torchpass_p2p.core.seal import Keyring
from torchpass_p2p.core.wire import Wire

TARGET_US = 30.0
"""Budget per datagram each way: a member handles a few hundred datagrams a second."""


def _updates(rng: random.Random, count: int) -> tuple[Update, ...]:
    """A realistic mix: mostly alerts and alive refutations, some deaths; random 64-bit ids."""
    out: list[Update] = []
    for i in range(count):
        member = rng.getrandbits(64)
        kind = i % 4
        if kind == 0:
            out.append(Alive(member, rng.randrange(1, 8)))
        elif kind == 3:
            out.append(Dead(member, rng.randrange(0, 8), rng.getrandbits(64)))
        else:
            out.append(Alert(rng.getrandbits(64), member, rng.randrange(0, 8)))
    return tuple(out)


def _vote(rng: random.Random) -> Vote:
    """One host of 8 ranks removed, one spare joining, a full segment of bits."""
    removed = tuple(sorted(rng.getrandbits(64) for _ in range(8)))
    joiner = Joiner(rng.getrandbits(64), "10.1.7.23", 29500, Topology("node-0117", "nvl72-3"))
    return Vote(rng.getrandbits(64), 0, Cut(removed, (joiner,)), rng.randrange(8),
                rng.randbytes(codec.SEGMENT_BYTES), rng.randrange(1 << 20))


def _shapes(rng: random.Random) -> dict[str, Callable[[], Message]]:
    return {
        "ping_4_updates": lambda: Ping(rng.getrandbits(32), _updates(rng, 4)),
        "gossip_24_updates": lambda: Gossip(_updates(rng, 24)),
        "vote_cut_8_1_full_segment": lambda: _vote(rng),
    }


def _median_us(run: Callable[[int], None], number: int, repeats: int) -> float:
    """Median over ``repeats`` of ``run(repeat)``'s time divided by ``number``, in us. The
    garbage collector is off while timing, as in ``timeit``."""
    times = []
    for repeat in range(repeats):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            run(repeat)
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return statistics.median(times) / number * 1e6


def _measure(make: Callable[[], Message], number: int, repeats: int) -> dict[str, float | int]:
    keyring = Keyring(bytes(range(32)))
    message = make()
    sender = Wire("bench", keyring, 1)
    array = codec.to_array(message)
    body = codec.encode(message)

    def seal_encode(_: int) -> None:
        seal = sender.seal
        for _ in range(number):
            seal(message, 0)

    # Opening needs fresh counters (a repeat would be a replay): seal them all beforehand.
    hot = [[sender.seal(message, 0) for _ in range(number)] for _ in range(repeats)]
    cold_messages = [make() for _ in range(number * repeats)]
    cold = [
        [sender.seal(m, 0) for m in cold_messages[r * number : (r + 1) * number]]
        for r in range(repeats)
    ]
    receiver, cold_receiver = Wire("bench", keyring, 2), Wire("bench", keyring, 3)

    def open_hot(repeat: int) -> None:
        open_ = receiver.open
        for datagram in hot[repeat]:
            open_(datagram)

    def open_cold(repeat: int) -> None:
        open_ = cold_receiver.open
        for datagram in cold[repeat]:
            open_(datagram)

    def encode(_: int) -> None:
        for _ in range(number):
            codec.encode(message)

    def decode(_: int) -> None:
        for _ in range(number):
            codec.decode(body)

    def baseline_encode(_: int) -> None:
        packb = msgpack.packb
        for _ in range(number):
            packb(array)

    def baseline_decode(_: int) -> None:
        unpackb = msgpack.unpackb
        for _ in range(number):
            unpackb(body)

    codec._update_cache.clear()
    open_cold_us = _median_us(open_cold, number, repeats)
    codec.decode(body)  # the hot case: this message's updates were decoded before
    result: dict[str, float | int] = {
        "datagram_bytes": len(hot[0][0]),
        "body_bytes": len(body),
        "seal_encode_us": _median_us(seal_encode, number, repeats),
        "open_decode_us": _median_us(open_hot, number, repeats),
        "open_decode_cold_us": open_cold_us,
        "encode_us": _median_us(encode, number, repeats),
        "decode_us": _median_us(decode, number, repeats),
        "baseline_encode_us": _median_us(baseline_encode, number, repeats),
        "baseline_decode_us": _median_us(baseline_decode, number, repeats),
    }
    opened = receiver.accepted + cold_receiver.accepted
    assert opened == 2 * number * repeats, (receiver.rejected, cold_receiver.rejected)
    result["seal_encode_ratio"] = result["seal_encode_us"] / result["baseline_encode_us"]
    result["open_decode_ratio"] = result["open_decode_us"] / result["baseline_decode_us"]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--number", type=int, default=2000, help="datagrams per repeat")
    parser.add_argument("--repeats", type=int, default=7, help="repeats; the median is reported")
    args = parser.parse_args(argv)
    rng = random.Random(20240611)
    report: dict[str, object] = {
        "python": platform.python_version(),
        "msgpack": ".".join(map(str, msgpack.version)),
        "cryptography": cryptography.__version__,
        "number": args.number,
        "repeats": args.repeats,
        "target_us": TARGET_US,
    }
    for name, make in _shapes(rng).items():
        report[name] = _measure(make, args.number, args.repeats)
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
