"""``python -m sims run SCENARIO``: run one scenario file and print its metrics.

SCENARIO is a path to a TOML file or a bare name looked up in ``sims/scenarios/NAME.toml``.
``--json`` prints exactly one JSON object on stdout (see :func:`sims.metrics.scenario_metrics`
for what each key means); without it a short table. A progress bar advances on stderr, in
virtual seconds, when stderr is a terminal and the run lasts over a second.

Exit status: 0; 1 if the run broke a safety invariant; 2 for a bad scenario or option.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torchpass_p2p.cli import plain

from .scenario import ScenarioError, load_scenario, run_scenario

_TABLE: tuple[tuple[str, str], ...] = (
    ("members", ""),
    ("spares", ""),
    ("seed", ""),
    ("virtual_s", "s"),
    ("loss", ""),
    ("events", ""),
    ("wall_s", "s"),
    ("events_per_s", "events/s"),
    ("faults", ""),
    ("detected_by_all", "faults"),
    ("detect_first_p50_s", "s"),
    ("detect_first_p99_s", "s"),
    ("detect_all_p50_s", "s"),
    ("detect_all_p99_s", "s"),
    ("detect_member_p50_s", "s"),
    ("detect_member_p99_s", "s"),
    ("decided_all_p50_s", "s"),
    ("decided_all_p99_s", "s"),
    ("decisions", "changes"),
    ("fast_path_fraction", ""),
    ("empty_changes", "changes"),
    ("safety_violations", ""),
    ("false_removals", "members"),
    ("restarts", "processes"),
    ("rejoined", "processes"),
    ("rejoin_p50_s", "s"),
    ("rejoin_p99_s", "s"),
    ("suspicions", ""),
    ("refutations", ""),
    ("live_members", ""),
    ("bytes_per_member_per_s", "B/s sent"),
    ("recv_bytes_per_member_per_s", "B/s received"),
    ("steady_bytes_per_member_per_s", "B/s sent, median second"),
    ("packets_per_member_per_s", "packets/s sent"),
    ("views_final", "distinct views"),
    ("views_max", "distinct views"),
    ("fenced_final", "members"),
    ("reachable_min", "members"),
    ("reachable_max", "members"),
    ("invariant_violations", ""),
)
"""Rows of the human-readable table: key, unit."""


def format_table(result: dict[str, Any]) -> str:
    """The run's figures as aligned ``key  value unit`` lines (``never`` for a null latency)."""
    lines = [f"scenario {result['scenario']}"]
    width = max(len(key) for key, _ in _TABLE)
    for key, unit in _TABLE:
        value = result.get(key)
        if value is None:
            never = ((key.startswith(("detect_", "decided_")) and result.get("faults"))
                     or (key.startswith("rejoin_") and result.get("restarts")))
            text = "never" if never else "-"
            unit = ""
        elif isinstance(value, float):
            text = f"{value:,.3f}" if abs(value) < 1e6 else f"{value:,.0f}"
        elif isinstance(value, int) and not isinstance(value, bool):
            text = f"{value:,}"
        else:
            text = str(value)
        lines.append(f"  {key:<{width}}  {text:>14} {unit}".rstrip())
    lines.extend(f"  ! {text}" for text in result.get("invariant_examples", ()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sims run", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", help="a scenario file or a name in sims/scenarios/")
    parser.add_argument("--members", type=int, help="override the member count")
    parser.add_argument("--seed", type=int, help="override the seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--series", metavar="FILE",
                        help="also write the metrics with per-second series to FILE (JSON), "
                             "for python -m sims report --series")
    parser.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    args = parser.parse_args(argv)
    try:
        scenario = load_scenario(args.scenario)
        result = run_scenario(scenario, members=args.members, seed=args.seed,
                              progress=not args.no_progress and sys.stderr.isatty(),
                              series=args.series is not None)
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.series is not None:
        with open(args.series, "w") as f:
            json.dump(result, f)
            f.write("\n")
        result.pop("series")
    print(json.dumps(result) if args.json else format_table(result))
    return 1 if result["invariant_violations"] or result["safety_violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
