"""``torchpass-p2p drain HOST:PORT``: ask one agent to leave the job gracefully (its rank, if it
holds one, goes to a spare) by ``POST /drain`` to its status page. Prints the agent's JSON reply.

Exit code (as ``torchpass-p2p status``): 0 when the agent accepted, 1 when it refused (an HTTP
error, or ``"draining": false``, such as ``no_spare`` when no spare could take the rank) or
answered something that is not JSON, 2 when it could not be reached, for a usage error or an
unreadable key.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from torchpass_p2p.agent.settings import SettingsError, parse_address
from torchpass_p2p.cli import plain
from torchpass_p2p.launch.childspec import format_address
from torchpass_p2p.launch.keyfile import KeyFileError, http_token, read_primary_key

__all__ = ["EXIT_REFUSED", "EXIT_UNREACHABLE", "DrainError", "add_parser", "drain", "run"]

DEFAULT_TIMEOUT_S = 5.0
"""Deadline of the request: an agent answers at once and drains in the background."""
MAX_REPLY_BYTES = 1 << 20
"""Largest reply read: a drain reply is a few hundred bytes of JSON."""
EXIT_REFUSED = 1
EXIT_UNREACHABLE = 2


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register this command's parser (``set_defaults(func=run)``) and return it."""
    p = subparsers.add_parser(
        "drain", help="ask one agent to leave gracefully (POST /drain)",
        description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address", metavar="HOST:PORT", help="the agent's status page")
    p.add_argument("--key-file", metavar="F",
                   help="cluster key file (default: $TORCHPASS_KEY_FILE, else $TORCHPASS_KEY)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"request deadline (default: {DEFAULT_TIMEOUT_S:g})")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        address = parse_address(args.address, where="HOST:PORT")
        key = _key(args.key_file)
    except (SettingsError, KeyFileError, OSError) as exc:
        print(f"torchpass-p2p drain: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        reply = drain(format_address(address), key, timeout_s=args.timeout)
    except DrainError as exc:
        print(f"torchpass-p2p drain: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE if exc.unreachable else EXIT_REFUSED
    print(json.dumps(reply, indent=1, sort_keys=True))
    if isinstance(reply, dict) and reply.get("draining") is False:  # e.g. ``no_spare``
        print(f"torchpass-p2p drain: refused: {reply.get('detail') or reply.get('reason')}",
              file=sys.stderr)
        return EXIT_REFUSED
    return 0


class DrainError(Exception):
    """The agent refused the drain or could not be reached (``unreachable``); the message says
    which."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def drain(address: str, key: bytes, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """``POST http://<address>/drain`` with the bearer token of ``key``; the decoded JSON reply.

    Raises:
        DrainError: no connection, a timeout, a reply other than 2xx, or a reply that is not JSON.
    """
    request = urllib.request.Request(
        f"http://{address}/drain", data=b"{}", method="POST",
        headers={"Authorization": f"Bearer {http_token(key)}",
                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read(MAX_REPLY_BYTES)
    except urllib.error.HTTPError as exc:
        detail = exc.read(MAX_REPLY_BYTES).decode(errors="replace").strip()
        raise DrainError(f"{address} refused: HTTP {exc.code} {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DrainError(f"{address} unreachable: {reason}", unreachable=True) from None
    try:
        return json.loads(body)
    except ValueError:
        raise DrainError(f"{address} replied with something that is not JSON") from None


def _key(path: str | None) -> bytes:
    path = path or os.environ.get("TORCHPASS_KEY_FILE") or None
    if path is not None:
        return read_primary_key(path)
    text = os.environ.get("TORCHPASS_KEY", "").strip()
    if not text:
        raise KeyFileError("no cluster key: --key-file, TORCHPASS_KEY_FILE or TORCHPASS_KEY")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise KeyFileError("TORCHPASS_KEY: 64 hex digits")
    return key
