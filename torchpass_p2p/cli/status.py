"""``torchpass-p2p status HOST:PORT``: print the cluster as one agent sees it.

Reads ``GET /status`` of an agent's status server (:mod:`torchpass_p2p.agent.http`) and prints a
header line and one row per member; ``--json`` prints the answer as it came. Exit status: 0
printed, 1 the agent answered but not with a status (wrong port?), 2 unreachable (refused, timed
out, bad address).

The ``/status`` document (built by the runtime; the status page at ``/`` draws it)::

    {"member_id": "<16 hex>", "cluster": str, "role": "rank"|"spare"|"joining"|"removed",
     "rank": int|null, "config_id": int, "world_size": int, "step": int, "phase": str,
     "fenced": bool, "draining": bool, "reachable": int, "majority": int,
     "members": [{"member_id": "<16 hex>", "role": str, "rank": int|null,
                  "state": "alive"|"suspect"|"dead"|"left", "incarnation": int,
                  "address": "host:port"}, ...],
     "recent_events": [{"at": float, "type": str, "detail": str}, ...],
     "health": {...}, "counters": {str: int},
     "pulse": {"responder_port": int|null, "watching": int, "silent": ["<16 hex>", ...]},
     "clock": float,
     "configurations": [{"config_id": int, "decided_at": float, "round": int,
                         "world_size": int, "ranks": ["<16 hex>"|null, ...],
                         "spares": [...], "removed": [...], "joined": [...],
                         "assignments": [[rank, "<16 hex>"], ...], "action": str,
                         "resume_step": int|null}, ...],
     "recoveries": [{"config_id": int, "removed": [...], "assignments": [...],
                     "vacant": [int, ...], "action": str, "resume_step": int|null,
                     "detected_at": float|null, "decided_at": float,
                     "transferred_at": float|null, "transferred_by": "received"|"sent"|null,
                     "rebuilt_at": float|null, "resumed_at": float|null}, ...],
     "transfer": {"direction": "receiving"|"sending", "config_id": int|null, "step": int,
                  "done_bytes": int, "total_bytes": int|null, "sources": int|null,
                  "started_at": float, "updated_at": float, "finished_at": float|null}|null,
     "stragglers": [{"rank": int, "member_id": "<16 hex>", "lag_s": float}, ...]|null}

Times (``at``, ``*_at``) are the agent's ``clock`` (monotonic seconds, as ``clock`` itself);
``configurations``, ``recoveries`` and ``transfer`` are what this member saw
(:mod:`torchpass_p2p.agent.history`). ``stragglers`` are the ranks this member names now, by
rank, with ``lag_s`` the seconds their arrival at the gradient collective trails the first
rank's (``docs/stragglers.md``); null on a member that has not trained a step (a spare).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import aiohttp
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text
from yarl import URL

from torchpass_p2p.agent.settings import SettingsError, parse_address

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_STATUS_BYTES", "EXIT_BAD_ANSWER", "EXIT_UNREACHABLE",
           "add_parser", "run"]

DEFAULT_TIMEOUT_S = 5.0
"""Whole-request limit: a live agent answers from memory in milliseconds even under load; a
hung one should not hang the operator's terminal."""
MAX_STATUS_BYTES = 64 << 20
"""Largest answer read. About 150 bytes a member: 16k members plus spares is ~3 MB."""
RECENT_EVENTS_SHOWN = 5

EXIT_BAD_ANSWER = 1
EXIT_UNREACHABLE = 2

_STATE_STYLE = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}
_ROLE_ORDER = {"rank": 0, "spare": 1, "joining": 2, "removed": 3}


class _BadAnswer(Exception):
    pass


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``status HOST:PORT [--json] [--timeout S]``; sets ``func=run``."""
    p = subparsers.add_parser(
        "status",
        help="print the cluster as one agent sees it",
        description="Ask an agent's status server (GET /status) and print the cluster table.",
    )
    p.add_argument("address", metavar="HOST:PORT", help="the agent's status server")
    p.add_argument("--json", action="store_true", help="print the status document as JSON")
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
        help=f"seconds to wait for the answer (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Fetch and print; returns the exit status (0, :data:`EXIT_BAD_ANSWER`,
    :data:`EXIT_UNREACHABLE`). Blocks: runs its own event loop."""
    try:
        host, port = parse_address(args.address, where="HOST:PORT")
    except SettingsError as exc:
        print(f"torchpass-p2p status: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if not args.timeout > 0:
        print("torchpass-p2p status: --timeout must be positive", file=sys.stderr)
        return EXIT_UNREACHABLE
    url = URL.build(scheme="http", host=host, port=port, path="/status")
    try:
        status = asyncio.run(_fetch(url, args.timeout))
    except TimeoutError:  # before OSError, its base class
        print(f"torchpass-p2p status: no answer from {args.address} within {args.timeout:g} s",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    except (aiohttp.ClientConnectionError, OSError) as exc:
        print(f"torchpass-p2p status: cannot reach {args.address}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (_BadAnswer, aiohttp.ClientError) as exc:
        print(f"torchpass-p2p status: {args.address} did not answer with a status: {exc}",
              file=sys.stderr)
        return EXIT_BAD_ANSWER
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    try:
        _print_table(status)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        print(f"torchpass-p2p status: {args.address} sent a malformed status: {exc!r}",
              file=sys.stderr)
        return EXIT_BAD_ANSWER
    return 0


async def _fetch(url: URL, timeout_s: float) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url, headers={"Accept": "application/json"}) as resp:
            if resp.status != 200:
                raise _BadAnswer(f"HTTP {resp.status}")
            body = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > MAX_STATUS_BYTES:
                    raise _BadAnswer(f"answer over {MAX_STATUS_BYTES} bytes")
    try:
        status = json.loads(body)
    except ValueError as exc:
        raise _BadAnswer(f"not JSON ({exc})") from None
    if not isinstance(status, dict) or not isinstance(status.get("members"), list):
        raise _BadAnswer("no members list")
    return status


def _print_table(status: dict[str, Any]) -> None:
    console = Console(file=sys.stdout, markup=False, highlight=False,
                      width=None if sys.stdout.isatty() else 200)
    me = str(status.get("member_id", "?"))
    rank = status.get("rank")
    mine = f"{status.get('role', '?')}" + ("" if rank is None else f" {rank}")
    header = Text.assemble(
        ("cluster ", "dim"), str(status.get("cluster", "?")),
        ("  config_id ", "dim"), str(status.get("config_id", "?")),
        ("  world_size ", "dim"), str(status.get("world_size", "?")),
        ("  step ", "dim"), str(status.get("step", "?")),
        ("  member ", "dim"), f"{me} ({mine})",
    )
    pulse = status.get("pulse")
    if isinstance(pulse, dict):
        header.append("  pulse ", style="dim")
        header.append("on" if pulse.get("responder_port") else "off")
        silent = pulse.get("silent")
        if isinstance(silent, list) and silent:
            header.append(f"  silent {' '.join(map(str, silent))}", style="bold yellow")
    if status.get("fenced"):
        header.append("  FENCED", style="bold red")
        reachable, majority = status.get("reachable"), status.get("majority")
        if isinstance(reachable, int) and isinstance(majority, int):
            header.append(f" ({reachable} of {len(status['members'])} reachable, a majority "
                          f"is {majority})", style="bold red")
    console.print(header)

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("member", no_wrap=True)
    table.add_column("role")
    table.add_column("rank", justify="right")
    table.add_column("state")
    table.add_column("incarnation", justify="right")
    table.add_column("address", no_wrap=True)
    for m in sorted(status["members"], key=_member_order):
        state = str(m.get("state", "?"))
        table.add_row(
            str(m["member_id"]),
            str(m.get("role", "?")),
            "-" if m.get("rank") is None else str(m["rank"]),
            Text(state, style=_STATE_STYLE.get(state, "")),
            str(m.get("incarnation", "?")),
            str(m.get("address", "?")),
            style="bold" if m["member_id"] == me else None,
        )
    console.print(table)

    stragglers = status.get("stragglers")
    if isinstance(stragglers, list) and stragglers:
        console.print(Text("stragglers (arrival after the first rank's)", style="bold yellow"))
        for s in stragglers:
            lag = s.get("lag_s")
            console.print(f"  rank {s.get('rank', '?')}  {s.get('member_id', '?')}  "
                          + (f"{lag:.3f} s" if isinstance(lag, (int, float)) else "?"))

    events = status.get("recent_events") or []
    if events:
        console.print(Text("recent events", style="dim"))
        for e in events[-RECENT_EVENTS_SHOWN:]:
            console.print(f"  {_when(e.get('at'))}  {e.get('type', '?')}  {e.get('detail', '')}")


def _member_order(m: dict[str, Any]) -> tuple[int, int, str]:
    rank = m.get("rank")
    return (
        _ROLE_ORDER.get(str(m.get("role")), len(_ROLE_ORDER)),
        rank if isinstance(rank, int) else -1,
        str(m["member_id"]),
    )


def _when(at: Any) -> str:
    if not isinstance(at, (int, float)):
        return "?"
    if at > 1e9:  # wall-clock seconds since the epoch
        return time.strftime("%H:%M:%S", time.localtime(at)) + f".{int(at * 1000) % 1000:03d}"
    return f"{at:.3f}"
