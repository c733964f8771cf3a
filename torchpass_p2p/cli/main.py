"""``torchpass-p2p``: one entry point, one subcommand per module (``launch``, ``drain``,
``status``, ``rotate-key``). Each subcommand module exposes ``add_parser(subparsers)``, which
registers its parser with ``set_defaults(func=run)``, and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import drain, launch, rotate_key, status

_COMMANDS = (launch, drain, status, rotate_key)

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchpass-p2p",
        description="Keep PyTorch training jobs running through faults.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in _COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the subcommand; returns its exit code
    (argparse exits with 2 on a usage error)."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
