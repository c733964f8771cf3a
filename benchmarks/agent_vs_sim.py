"""Live agents against the simulator: the same core, the same parameters, one crash.

Runs ``--runs`` times a fleet of ``--ranks`` + ``--spares`` live agents on loopback (real UDP and
TCP sockets, real sealing, one event loop), crashes one rank after the fleet settled, and times
crash -> the last survivor holds the decided configuration. The simulator runs the same fleet
(no loss, loopback latency) over ``--seeds`` seeds. Both sides watch pulses (agent/pulse.py)
unless ``--no-pulse``. Prints one JSON object with both medians and their ratio; issue #5's
target is a live median within 25 % of the simulated one. Run it on a quiet machine: a starved
event loop stalls, and a stalled member voids its own probes.

    python -m benchmarks.agent_vs_sim [--ranks 12] [--spares 4] [--runs 5] [--seeds 7]
                                      [--no-pulse]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from sims.scenario import run_scenario, scenario_from_mapping


def simulated_decided_all_p50(ranks: int, spares: int, *, seeds: int = 7,
                              pulse: bool = True) -> float:
    """Median over seeds of the simulator's decided-at-all-members time: ``ranks + spares``
    members, no loss, loopback latency (0.2 ms +- 0.1 ms), one crash after 10 s."""
    scenario = scenario_from_mapping({
        "name": "agent-crash", "members": ranks + spares, "spares": spares,
        "virtual_s": 25.0, "warmup_s": 2.0, "pulse": pulse,
        "link": {"loss": 0.0, "base_latency_s": 0.0002, "jitter_s": 0.0001},
        "faults": [{"kind": "crash", "member": "random", "at": 10.0}]})
    return statistics.median(run_scenario(scenario, seed=s)["decided_all_p50_s"]
                             for s in range(seeds))


async def live_decided_all(ranks: int, spares: int, seed: int, *, pulse: bool = True) -> float:
    """Crash -> every survivor holds configuration 1, seconds, for one live fleet."""
    from tests.agent.cluster import LocalCluster

    cluster = LocalCluster(ranks, spares, seed=seed, pulse=pulse)
    await cluster.start()
    try:
        await cluster.until(lambda: all(  # start() gave every agent its member
            a.member is not None and a.member.counters["probe_acks"] >= 2
            for a in cluster.live()), timeout_s=10)
        await asyncio.sleep(1.0)
        victim = cluster.configuration.ranks[seed % ranks]
        assert victim is not None  # configuration 0 has no vacant rank
        await cluster[victim].stop(leave=False)
        crashed_at = time.monotonic()
        survivors = cluster.live()
        await cluster.until(lambda: all(
            a.configuration.config_id >= 1 for a in survivors), timeout_s=30)
        return max(a.decided_at[1] for a in survivors) - crashed_at
    finally:
        await cluster.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_vs_sim")
    parser.add_argument("--ranks", type=int, default=12)
    parser.add_argument("--spares", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=7)
    parser.add_argument("--no-pulse", dest="pulse", action="store_false",
                        help="neither side watches pulses (detection by probes alone)")
    args = parser.parse_args(argv)
    live = [asyncio.run(live_decided_all(args.ranks, args.spares, seed, pulse=args.pulse))
            for seed in range(args.runs)]
    simulated = simulated_decided_all_p50(args.ranks, args.spares, seeds=args.seeds,
                                          pulse=args.pulse)
    median = statistics.median(live)
    print(json.dumps({
        "members": args.ranks + args.spares, "runs": args.runs, "pulse": args.pulse,
        "live_decided_all_s": [round(x, 3) for x in live],
        "live_decided_all_p50_s": round(median, 3),
        "simulated_decided_all_p50_s": round(simulated, 3),
        "ratio_live_vs_simulated": round(median / simulated, 3),
        "target": "ratio within 0.75..1.25",
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
