"""Test utilities for the launcher: run ``torchpass-p2p launch`` as a real process and read
what its children report.

Child scripts write their environment (plus their pid) as ``<member id>.json`` into an output
directory given as their first argument; the test then inspects the live processes and files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

ENV_DUMP = '''
import json, os, sys
from pathlib import Path

def dump(out: Path, **extra):
    me = os.environ["TORCHPASS_MEMBER_ID"]
    env = {k: v for k, v in os.environ.items()
           if k.startswith("TORCHPASS_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                  "LOCAL_WORLD_SIZE")}
    env["pid"] = os.getpid()
    env.update(extra)
    tmp = out / f"{me}.tmp"
    tmp.write_text(json.dumps(env))
    tmp.rename(out / f"{me}.json")
    return env


async def serve(env, method, path, handler):
    # handler(request) answers method path at this child's status address, as an agent's
    # page would; runs until the child's loop ends or the returned runner is cleaned up.
    from aiohttp import web

    app = web.Application()
    app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    host, port = env["TORCHPASS_STATUS"].rsplit(":", 1)
    await web.TCPSite(runner, host, int(port)).start()
    return runner

async def serve_status(env, answer):
    # GET /status answers answer() (a JSON-able dict).
    from aiohttp import web

    async def status(request):
        return web.json_response(answer())

    return await serve(env, "GET", "/status", status)
'''


def socket_inodes(pid: int) -> dict[int, str]:
    """The sockets process ``pid`` holds: descriptor -> inode, from ``/proc/<pid>/fd``."""
    out = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)  # "socket:[123]" for a socket
        if target.startswith("socket:["):
            out[int(fd.name)] = target[8:-1]
    return out


def write_script(directory: Path, name: str, body: str) -> Path:
    """``directory/name`` holding :data:`ENV_DUMP` followed by ``body``."""
    path = directory / name
    path.write_text(ENV_DUMP + body)
    return path


def clean_environ() -> dict[str, str]:
    """The test's environment without any launcher contract variable."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return {k: v for k, v in os.environ.items()
            if not k.startswith("TORCHPASS_") and k not in drop}


def start_launcher(args: Sequence[str], *, env: dict[str, str] | None = None,
                   ) -> subprocess.Popen[bytes]:
    """``python -m torchpass_p2p.cli.main launch ARGS`` in the repository root."""
    return subprocess.Popen(
        [sys.executable, "-m", "torchpass_p2p.cli.main", "launch", *args],
        cwd=REPO, env=clean_environ() if env is None else env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(launcher: subprocess.Popen[bytes], timeout_s: float = 10.0) -> tuple[int, str]:
    """Wait for the launcher (kill it after ``timeout_s``); its exit code and output."""
    try:
        out, _ = launcher.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        launcher.kill()
        out, _ = launcher.communicate()
        raise AssertionError(f"launcher did not exit:\n{out.decode()}") from None
    return launcher.returncode, out.decode()


def wait_for(check: Callable[[], Any], timeout_s: float = 8.0, what: str = "condition") -> Any:
    """Poll ``check`` every 20 ms until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def reports(out: Path, count: int, timeout_s: float = 8.0) -> list[dict[str, Any]]:
    """The environments of ``count`` children, once that many have reported."""
    def ready() -> list[Path] | None:
        files = sorted(out.glob("*.json"))
        return files if len(files) >= count else None
    files = wait_for(ready, timeout_s, f"{count} child reports in {out}")
    return [json.loads(f.read_text()) for f in files]


def gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def free_ports_block(count: int, hosts: Sequence[str]) -> int:
    """A base port ``p`` such that ``p .. p + count - 1`` are free for UDP and TCP on every
    host of ``hosts`` right now (a launcher with ``--base-port`` binds exactly those). The
    block lies below the kernel's ephemeral range, so that no ``bind(0)`` or ``connect()`` of
    another process takes one of them before that launcher does."""
    import random
    import socket

    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, max(10001, ephemeral_low - count))
        held = []
        try:
            for host in hosts:
                for port in range(base, base + count):
                    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                        s = socket.socket(socket.AF_INET, kind)
                        held.append(s)
                        s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise OSError("no free block of ports")
