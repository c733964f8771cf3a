"""``python -m sims COMMAND``: the simulator's command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "sims.demo", "run": "sims.run_cli", "report": "sims.report"}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m sims {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
