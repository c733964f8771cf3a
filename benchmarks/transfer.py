"""State-transfer throughput between processes on loopback.

Run ``python -m benchmarks.transfer [--json] [--gib 1.0] [--repeats 5] [--cases a,b]``. Starts
two source processes that each hold the same ``--gib`` GiB state (16 float32 tensors) and serve
it in each way below; the receiver (this process) measures, in interleaved rounds, the median of
``repeats`` runs of:

* ``gb_per_s``: :func:`torchpass_p2p.transfer.fetch` from one source, received in place, every
  byte of every chunk authenticated on the receiver as it lands (``chunkmac``: GMAC inner tags
  under a per-snapshot key, keyed-BLAKE3 tags under the session key), over ``streams``
  connections (the client's ``STREAMS``, 2); ``one_stream_gb_per_s``: the same over one;
* ``two_sources_gb_per_s``: ``fetch`` striped over both sources (one connection each);
* ``zero_copy_source_gb_per_s``: ``fetch`` from one source whose server passes chunk pages to
  the socket by reference (``zero_copy=True``; by default a server does that only for receivers
  on other hosts, so the cases above copy; ``zero_copy`` in the output says whether this
  machine allows it);
* ``raw_socket_gb_per_s``: a plain blocking-socket loop, ``sendall`` in 4 MiB pieces /
  ``recv_into`` with ``MSG_WAITALL`` in pieces of the client's ``RECV_PIECE_BYTES`` (1 MiB,
  the transfer's own receive call) of the same bytes into a preallocated buffer, no
  protocol and no integrity checks (same 4 MiB kernel socket buffers as the transfer client);
* ``raw_socket_4mib_gb_per_s``: the same loop receiving in 4 MiB pieces without
  ``MSG_WAITALL`` (this benchmark's raw loop before: ~0.75 of the one above here);
* ``raw_socket_mac_gb_per_s``: the raw loop with every piece fed to a GMAC as it lands, as
  the client does, and nothing else (no protocol, no tags): the most any transfer that
  authenticates every byte with this MAC can reach here; ``mac_ceiling_vs_raw`` is its rate
  over the raw loop's, the ceiling of ``ratio_vs_raw`` on this host;
* ``torch_save_gb_per_s``: ``torch.save`` into memory, send, receive, ``torch.load``;
* ``pg_gb_per_s``, ``pg_two_sources_gb_per_s``: the process-group transport
  (:class:`~torchpass_p2p.transfer.pg_transport.PgTransport`) over a gloo group of the two
  sources and this process, from one source and from both (xxh3 chunk digests, no MACs: the
  group's data plane is not authenticated); ``pg_staged_gb_per_s``: from one source with every
  chunk staged through buffers (``device="cpu"``), the path NCCL takes with CUDA buffers: here
  it only adds two host copies;

with ``ratio_vs_raw`` = ``gb_per_s / raw_socket_gb_per_s`` (``pg_ratio_vs_raw`` the same for
``pg_gb_per_s``; each ``*_paired``: the median over rounds of that round's ratio, the two
cases having run in the same round). ``--cases a,b`` runs only those cases.

The sources above share the loopback and the receiver's cores: once one source runs at the
loopback's speed, a second one only adds CPU contention. ``--link-gbit G`` (root, iproute2) also
runs each source in its own network namespace behind a veth link limited to ``G`` Gbit/s
(:mod:`benchmarks.links`), as if on another host, and reports under ``links`` the medians of
``one_source_gb_per_s`` and ``two_sources_gb_per_s`` over those links (servers pass pages by
reference there, as to any receiver on another host).
GB = 1e9 bytes. A source's one-time costs per published snapshot, paid before the timed runs
(wall seconds, 1 GiB): ``source_digest_s`` (xxh3 chunk digests, for the fingerprint) and
``source_chunk_mac_s`` (the inner chunk MACs). ``receiver_cpu_s_per_gb`` and
``source_cpu_s_per_gb`` (medians, user + system CPU of the receiving process and of the serving
source per GB moved) say where the time goes; on a shared machine they vary less than the
rates. ``mac_gb_per_s``: one core's rate of the receiver's per-byte MAC (GMAC) on this CPU,
with ``cpu_model`` and ``cpu_has_vpclmulqdq``; where the MAC is slow, ``ratio_vs_raw`` is lower
(0.59-0.79 on AMD EPYCs with GMAC at 4-6 GB/s, against 0.97-0.99 on a host where it ran at
14-21 GB/s).
Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import io
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from benchmarks import links
from torchpass_p2p.transfer import Snapshot, TransferKeys, TransferServer, chunkmac, fetch
from torchpass_p2p.transfer.client import RECV_PIECE_BYTES, STREAMS
from torchpass_p2p.transfer.frames import set_buffers
from torchpass_p2p.transfer.pg_transport import PgTransport
from torchpass_p2p.transfer.snapshot import DEFAULT_CHUNK_BYTES, byte_view
from torchpass_p2p.transfer.state_transport import TransferPlan

N_TENSORS = 16
PIECE = 4 << 20
PG_RECEIVER = 2
"""The receiver's rank in the gloo group (sources are ranks 0 and 1)."""
PG_TIMEOUT_S = 120.0


def _state(total_bytes: int, fill: bool) -> dict[str, torch.Tensor]:
    n = total_bytes // 4 // N_TENSORS
    out = {}
    for k in range(N_TENSORS):
        t = torch.empty(n, dtype=torch.float32)
        if fill:
            t.copy_(torch.arange(n, dtype=torch.float32)).mul_(1.0 + k)
        out[f"w{k}"] = t
    return out


def _raw_server(lsock: socket.socket, views: list[memoryview]) -> None:
    while True:
        try:
            c, _ = lsock.accept()
        except OSError:
            return
        with c:
            set_buffers(c)
            c.recv(1)
            for v in views:
                for p in range(0, len(v), PIECE):
                    c.sendall(v[p:p + PIECE])


def _save_server(lsock: socket.socket, state: dict[str, torch.Tensor]) -> None:
    while True:
        try:
            c, _ = lsock.accept()
        except OSError:
            return
        with c:
            c.recv(1)
            buf = io.BytesIO()
            torch.save(state, buf)
            data = buf.getbuffer()
            c.sendall(struct.pack(">Q", len(data)))
            c.sendall(data)


def _pg_plan(sources: list[int]) -> TransferPlan:
    return TransferPlan(sources=tuple(sources), config_id=1, receiver=PG_RECEIVER,
                        progress_timeout_s=PG_TIMEOUT_S)


def _source_main(pipe, total_bytes: int, key: bytes, host: str = "127.0.0.1",
                 pg: tuple[int, int] | None = None) -> None:
    """Serve a ``total_bytes`` state over TCP; with ``pg`` (rank, store port) also join the
    gloo group and provide over it whenever the receiver sends ``(sources, device)``."""
    state = _state(total_bytes, fill=True)
    snap = Snapshot.capture({"model": state}, step=1)
    views = [byte_view(t) for t in snap.tensors]
    socks = []
    for target, arg in ((_raw_server, views), (_save_server, state)):
        ls = socket.create_server(("127.0.0.1", 0))
        socks.append(ls)
        threading.Thread(target=target, args=(ls, arg), daemon=True).start()

    async def serve() -> None:
        t0 = time.perf_counter()
        snap.digests("xxh3")
        t1 = time.perf_counter()
        snap.chunk_macs()
        t2 = time.perf_counter()
        async with TransferServer(TransferKeys(key), lambda: 1, host=host) as server, \
                TransferServer(TransferKeys(key), lambda: 1, host=host, zero_copy=True) as by_ref:
            server.publish(snap)
            by_ref.publish(snap)
            pipe.send({"transfer": server.port, "by_reference": by_ref.port,
                       "zero_copy": by_ref.zero_copy, "raw": socks[0].getsockname()[1],
                       "save": socks[1].getsockname()[1], "digest_s": t1 - t0,
                       "chunk_mac_s": t2 - t1, "pid": os.getpid()})
            loop = asyncio.get_running_loop()
            if pg is not None:
                _join_pg(*pg)
            while (msg := await loop.run_in_executor(None, pipe.recv)) != "stop":
                sources, device = msg
                if pg is not None and pg[0] in sources:
                    await PgTransport(device=device).provide(snap, _pg_plan(sources))

    asyncio.run(serve())


def _join_pg(rank: int, store_port: int) -> None:
    store = dist.TCPStore("127.0.0.1", store_port, PG_RECEIVER + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=PG_RECEIVER + 1,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


CASES = ("gb_per_s", "raw_socket_gb_per_s", "one_stream_gb_per_s", "raw_socket_4mib_gb_per_s",
         "raw_socket_mac_gb_per_s", "two_sources_gb_per_s", "zero_copy_source_gb_per_s",
         "torch_save_gb_per_s", "pg_gb_per_s", "pg_two_sources_gb_per_s", "pg_staged_gb_per_s")
"""Every case, in the order each round runs them."""

KEY_VARIABLE = "TORCHPASS_BENCH_KEY"
"""Environment variable carrying the hex key to a source started with ``--serve``."""


class _StdioPipe:
    """``_source_main``'s pipe over stdout (one JSON line) and stdin (EOF: stop), for a source
    started as a command (in a network namespace)."""

    def send(self, obj: object) -> None:
        print(json.dumps(obj), flush=True)

    def recv(self) -> str:
        sys.stdin.read()
        return "stop"


def _fetch_s(sources: list[tuple[str, int]], keys: TransferKeys, into: Snapshot,
             streams: int = STREAMS) -> float:
    """Seconds of one :func:`fetch` from ``sources`` over ``streams`` connections into
    ``into``, which must need no allocation and see no failure."""
    t0 = time.perf_counter()
    res = asyncio.run(fetch(sources, keys, 1, into=into, streams=streams))
    dt = time.perf_counter() - t0
    assert res.allocated_bytes == 0 and not res.failures
    return dt


def _linked(gib: float, total: int, key: bytes, keys: TransferKeys, into: Snapshot,
            gbit: float, repeats: int) -> dict[str, object]:
    """Two sources, each behind its own ``gbit`` Gbit/s link: one source, then both."""
    why = links.unavailable()
    if why:
        return {"ran": False, "reason": why}
    with links.source_links(2, gbit) as made:
        env = {**os.environ, KEY_VARIABLE: key.hex()}
        procs = [subprocess.Popen(
            link.argv([sys.executable, "-m", "benchmarks.transfer", "--serve", "--gib",
                       str(gib)]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            for link in made]
        try:
            ports = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
            src = [(link.address, port["transfer"]) for link, port in zip(made, ports,
                                                                           strict=True)]
            cases = {"one_source_gb_per_s": src[:1], "two_sources_gb_per_s": src}
            rates: dict[str, list[float]] = {k: [] for k in cases}
            for sources in cases.values():  # warm-up
                _fetch_s(sources, keys, into)
            for _ in range(repeats):
                for k, sources in cases.items():
                    rates[k].append(total / _fetch_s(sources, keys, into) / 1e9)
        finally:
            for p in procs:
                p.stdin.close()  # type: ignore[union-attr]
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    out: dict[str, object] = {"gbit_per_source": gbit, "zero_copy": ports[0]["zero_copy"]}
    for k, rs in rates.items():
        out[k] = round(statistics.median(rs), 3)
    out["two_sources_vs_one"] = round(
        out["two_sources_gb_per_s"] / out["one_source_gb_per_s"], 3)  # type: ignore[operator]
    out["all_gb_per_s"] = {k: [round(r, 3) for r in rs] for k, rs in rates.items()}
    return out


def _paired(base: list[float], case: list[float]) -> float:
    """Median over rounds of ``case``'s rate over ``base``'s (``base`` / ``case`` seconds)."""
    return round(statistics.median(b / c for b, c in zip(base, case, strict=True)), 3)


def _cpu_s(source_pids: list[int]) -> tuple[float, float]:
    """(this process's CPU seconds, the sources' together): user + system, all threads."""
    t = os.times()
    tck = os.sysconf("SC_CLK_TCK")
    src = 0.0
    for pid in source_pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        src += (int(fields[11]) + int(fields[12])) / tck
    return t.user + t.system, src


def _raw_recv(port: int, views: list[memoryview], piece: int = RECV_PIECE_BYTES,
              flags: int = socket.MSG_WAITALL, mac: bool = False) -> None:
    """The raw loop; with ``mac``, every piece also fed to a GMAC as it lands (a new one,
    under its own key, every ``DEFAULT_CHUNK_BYTES``), as the transfer client does."""
    key = chunkmac.new_key() if mac else b""
    gmac, index, in_chunk = None, 0, 0
    with socket.create_connection(("127.0.0.1", port)) as c:
        set_buffers(c)  # the same kernel buffers as the transfer client asks for
        c.sendall(b"g")
        for v in views:
            pos = 0
            while pos < len(v):
                n = c.recv_into(v[pos:pos + piece], 0, flags)
                if n == 0:
                    raise ConnectionError("closed")
                if mac:
                    if gmac is None:
                        gmac = chunkmac.Gmac(chunkmac.chunk_key(key, index))
                    gmac.update(v[pos:pos + n])
                    in_chunk += n
                    if in_chunk >= DEFAULT_CHUNK_BYTES:
                        gmac.digest()
                        gmac, index, in_chunk = None, index + 1, 0
                pos += n
        if gmac is not None:
            gmac.digest()


def _mac_gb_per_s(repeats: int = 7, pieces: int = 256) -> float:
    """One core's rate (GB/s, median of ``repeats``) of the receiver's per-byte authentication:
    GMAC (``chunkmac.Gmac``) over a cached ``RECV_PIECE_BYTES`` piece, as the client feeds it.
    Its inverse is about what the MAC adds to ``receiver_cpu_s_per_gb`` over the raw loop."""
    piece = memoryview(bytearray(os.urandom(RECV_PIECE_BYTES)))
    rates = []
    for _ in range(repeats):
        mac = chunkmac.Gmac(chunkmac.new_key())
        t0 = time.perf_counter()
        for _ in range(pieces):
            mac.update(piece)
        mac.digest()
        rates.append(pieces * len(piece) / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def _cpu() -> dict[str, object]:
    """The CPU's model name and whether it has VPCLMULQDQ (vector carry-less multiply, with
    which OpenSSL's GHASH, so GMAC, runs ~3x faster: 13.7-21 GB/s per core against ~5)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return {"cpu_model": platform.processor(), "cpu_has_vpclmulqdq": None}
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), "")
    return {"cpu_model": model, "cpu_has_vpclmulqdq": " vpclmulqdq" in info}


def _save_recv(port: int) -> dict[str, torch.Tensor]:
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"g")
        hdr = bytearray(8)
        memoryview(hdr)[:] = c.recv(8, socket.MSG_WAITALL)
        (n,) = struct.unpack(">Q", hdr)
        buf = bytearray(n)
        mv, pos = memoryview(buf), 0
        while pos < n:
            k = c.recv_into(mv[pos:])
            if k == 0:
                raise ConnectionError("closed")
            pos += k
    return torch.load(io.BytesIO(buf), weights_only=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default: 1)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="rounds, each running every case once in turn; figures are medians "
                         "(default: 5)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--cases", default=None,
                    help=f"comma-separated keys of the cases to run, of: {', '.join(CASES)} "
                         "(default: all)")
    ap.add_argument("--link-gbit", type=float, default=None,
                    help="also run sources behind links of this many Gbit/s (root)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    chosen = args.cases.split(",") if args.cases else list(CASES)
    if set(chosen) - set(CASES):
        ap.error(f"unknown cases {sorted(set(chosen) - set(CASES))}; known: {', '.join(CASES)}")
    total = int(args.gib * (1 << 30)) // (4 * N_TENSORS) * 4 * N_TENSORS
    if args.serve:  # a source started by _linked, inside its namespace
        _source_main(_StdioPipe(), total, bytes.fromhex(os.environ[KEY_VARIABLE]), "0.0.0.0")
        return 0
    key = os.urandom(32)
    keys = TransferKeys(key)
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, PG_RECEIVER + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
                          wait_for_workers=False)
    procs, pipes, ports = [], [], []
    for rank in range(2):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_source_main,
                        args=(b, total, key, "127.0.0.1", (rank, store.port)), daemon=True)
        p.start()
        procs.append(p)
        pipes.append(a)
    for a in pipes:
        if not a.poll(300):
            raise SystemExit("source did not start")
        ports.append(a.recv())
    dist.init_process_group("gloo", store=store, rank=PG_RECEIVER, world_size=PG_RECEIVER + 1,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    target = _state(total, fill=False)
    into = Snapshot.capture({"model": target}, step=0)
    views = [byte_view(t) for t in into.tensors]
    src = [("127.0.0.1", p["transfer"]) for p in ports]

    def run_fetch(sources, streams=STREAMS):
        return _fetch_s(sources, keys, into, streams)

    def run_raw(piece: int = RECV_PIECE_BYTES, flags: int = socket.MSG_WAITALL,
                mac: bool = False):
        t0 = time.perf_counter()
        _raw_recv(ports[0]["raw"], views, piece, flags, mac)
        return time.perf_counter() - t0

    def run_pg(sources: list[int], device: str | None = None) -> float:
        for a in pipes:
            a.send((sources, device))
        t0 = time.perf_counter()
        res = asyncio.run(PgTransport(device=device).receive(_pg_plan(sources), into=into))
        dt = time.perf_counter() - t0
        assert res.allocated_bytes == 0 and not res.failures
        return dt

    def run_save():
        t0 = time.perf_counter()
        _save_recv(ports[0]["save"])
        return time.perf_counter() - t0

    cases = {
        "gb_per_s": lambda: run_fetch(src[:1]),
        "raw_socket_gb_per_s": run_raw,
        "one_stream_gb_per_s": lambda: run_fetch(src[:1], streams=1),
        "raw_socket_4mib_gb_per_s": lambda: run_raw(PIECE, 0),
        "raw_socket_mac_gb_per_s": lambda: run_raw(mac=True),
        "two_sources_gb_per_s": lambda: run_fetch(src),
        "zero_copy_source_gb_per_s": lambda: run_fetch([("127.0.0.1",
                                                          ports[0]["by_reference"])]),
        "torch_save_gb_per_s": run_save,
        "pg_gb_per_s": lambda: run_pg([0]),
        "pg_two_sources_gb_per_s": lambda: run_pg([0, 1]),
        "pg_staged_gb_per_s": lambda: run_pg([0], "cpu"),
    }
    assert list(cases) == list(CASES)
    cases = {k: f for k, f in cases.items() if k in chosen}
    times: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
    pids = [p["pid"] for p in ports]
    for f in cases.values():  # warm-up: page in buffers, first connections
        f()
    for _ in range(args.repeats):
        for k, f in cases.items():
            c0 = _cpu_s(pids)
            times[k].append(f())
            c1 = _cpu_s(pids)
            cpu[k].append((c1[0] - c0[0], c1[1] - c0[1]))
    out: dict[str, object] = {"bytes": total, "repeats": args.repeats}
    for k, ts in times.items():
        out[k] = round(total / statistics.median(ts) / 1e9, 3)
    for name, case, base in (("ratio_vs_raw", "gb_per_s", "raw_socket_gb_per_s"),
                             ("pg_ratio_vs_raw", "pg_gb_per_s", "raw_socket_gb_per_s"),
                             ("mac_ceiling_vs_raw", "raw_socket_mac_gb_per_s",
                              "raw_socket_gb_per_s"),
                             ("two_sources_vs_one", "two_sources_gb_per_s", "gb_per_s"),
                             ("streams_vs_one_stream", "gb_per_s", "one_stream_gb_per_s")):
        if case in times and base in times:
            out[name] = round(out[case] / out[base], 3)  # type: ignore[operator]
            # The same ratio within each round, then the median: less exposed to the
            # machine's load changing between rounds.
            out[f"{name}_paired"] = _paired(times[base], times[case])
    out["streams"] = STREAMS
    out["zero_copy"] = ports[0]["zero_copy"]
    out["all_gb_per_s"] = {k: [round(total / t / 1e9, 3) for t in ts] for k, ts in times.items()}
    gb = total / 1e9
    out["receiver_cpu_s_per_gb"] = {k: round(statistics.median(c[0] for c in cs) / gb, 3)
                                    for k, cs in cpu.items()}
    out["source_cpu_s_per_gb"] = {k: round(statistics.median(c[1] for c in cs) / gb, 3)
                                  for k, cs in cpu.items()}
    out["source_digest_s"] = round(ports[0]["digest_s"], 3)
    out["source_chunk_mac_s"] = round(ports[0]["chunk_mac_s"], 3)
    out["mac_gb_per_s"] = round(_mac_gb_per_s(), 2)
    out.update(_cpu())
    if args.link_gbit:
        out["links"] = _linked(args.gib, total, key, keys, into, args.link_gbit, args.repeats)
    out["loadavg_1min_after"] = round(os.getloadavg()[0], 2)
    out["python"] = platform.python_version()
    out["torch"] = torch.__version__
    out["cpus"] = os.cpu_count()
    for a in pipes:
        a.send("stop")
    dist.destroy_process_group()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>24}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
