"""``python -m sims COMMAND``: the simulator's command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "sims.demo", "run": "sims.run_cli", "report": "sims.report",
                "jobmodel": "sims.fleetmodel.cli"}
    usage = (f"usage: python -m sims {{{','.join(commands)}}} [options]\n"
             "  demo    a simulated crash among 64 members, in a few seconds\n"
             "  run     run one scenario (TOML) and print its metrics\n"
             "  report  PNG plots of a scenario over several seeds (report jobmodel: the\n"
             "          job-level model's plots)\n"
             "  jobmodel  time to train over weeks: checkpoint-restart, replica groups, ours\n"
             "python -m sims COMMAND --help: that command's options")
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not argv or argv[0] not in commands:
        print(usage, file=sys.stderr)
        return 2
    import importlib
    from pathlib import Path

    from torchpass_p2p._native import refusal, stale_extensions

    stale = stale_extensions(str(Path(__file__).resolve().parents[1]))
    if stale:  # the figures of old compiled code under a new source's name
        print(f"python -m sims: {refusal(stale)}", file=sys.stderr)
        return 2
    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
