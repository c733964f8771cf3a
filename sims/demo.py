"""A live in-process cluster on the virtual clock: crash one member, stall another, print what
every member saw and what they agreed.

The membership protocol alone, in seconds (the main job, ``./scripts/main-job``, trains
through a fault with real processes): the real protocol core, real sealed datagrams (encoded,
AEAD-sealed, opened and decoded for every hop), a lossy virtual network, one crash and one
member whose loop keeps stalling. It exits non-zero if a live member never learned of the
crash, never held a decided configuration without it, a spare did not take its rank, or a
healthy member was convicted or removed.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from torchpass_p2p.cli import plain
from torchpass_p2p.core import events as ev
from torchpass_p2p.core import format_member_id

from .cluster import Cluster
from .network import LinkModel
from .recorder import DetectionRecorder
from .safety import SafetyChecker


def run_demo(members: int, seed: int, loss: float, crash_at_s: float, horizon_s: float,
             sealed: bool) -> int:
    cluster = Cluster(members, spares=max(1, members // 16), seed=seed,
                      link=LinkModel(loss=loss), sealed=sealed, keep_events=False)
    config = cluster.configuration
    recorder = DetectionRecorder(cluster)
    safety = SafetyChecker(cluster)
    # All of them: configuration 0 has no vacant rank (the filter only narrows the type).
    ranks = [m for m in config.ranks if m is not None]
    victim, busy = (cluster.by_id[m] for m in cluster.rng.sample(ranks, 2))
    timeline: list[tuple[float, str]] = []
    announced: set[int] = set()
    ready: list[ev.PlanReady] = []

    def name(member_id: int) -> str:
        rank = config.rank_of(member_id)
        role = f"rank {rank}" if rank is not None else "spare"
        return f"{format_member_id(member_id)} ({role})"

    def on_event(sm, event) -> None:
        kind = type(event)
        if kind is ev.AlertRaised and event.subject == victim.id and sm.id == event.observer:
            timeline.append((event.at, f"observer {name(event.observer)} raises an alert"))
        elif kind is ev.MemberDead and sm.id == event.confirmer:
            timeline.append((event.at, f"{name(sm.id)} confirms {name(event.member)} dead"))
        elif kind is ev.SelfRefuted and sm is busy:
            timeline.append((event.at, f"stalled {name(sm.id)} refutes, incarnation "
                                       f"{event.incarnation}"))
        elif kind is ev.ConfigurationDecided and event.plan.config_id not in announced:
            announced.add(event.plan.config_id)  # the first member to decide it
            plan = event.plan
            moves = ", ".join(f"rank {r} <- {name(m)}" for r, m in plan.assignments) or "none"
            path = "fast round" if event.round == 0 else f"classic round {event.round}"
            timeline.append((event.at, f"{name(sm.id)} decides configuration {plan.config_id} "
                                       f"({path}, {event.votes} votes): {moves}"))
        elif kind is ev.PlanReady and not ready:
            ready.append(event)
            timeline.append((event.at, f"plan {event.plan.hash:016x} ready: resume at step "
                                       f"{event.plan.resume_step}"))

    cluster.listeners.append(on_event)

    def crash() -> None:
        timeline.append((cluster.now, f"CRASH {name(victim.id)}"))
        recorder.fault(victim)
        cluster.crash(victim)

    def stall() -> None:
        timeline.append((cluster.now, f"STALL {name(busy.id)} for 2.0 s (loop blocked)"))
        cluster.block(busy, 2.0)
        if cluster.now + 10.0 < horizon_s:
            cluster.at(cluster.now + 10.0, stall)

    cluster.at(crash_at_s, crash)
    cluster.at(crash_at_s - 6.0, stall)
    cluster.run(horizon_s)

    rec = recorder.faults[victim.id]
    live = recorder.live_ids()
    print(f"{members} members ({len(config.ranks)} ranks, {len(config.spares)} spares), "
          f"{loss:.0%} loss, seed {seed}, datagrams {'sealed' if sealed else 'as objects'}, "
          f"{horizon_s:.0f} virtual s, {cluster.engine.events} events")
    print("timeline (virtual seconds):")
    for at, text in sorted(timeline, key=lambda x: x[0]):
        print(f"  t={at:8.3f}  {text}")
    knew = [rec.dead_known[m] - rec.at for m in live if m in rec.dead_known]
    all_know = rec.all_know_s(live)
    print(f"crash -> first alert     {rec.first_alert - rec.at:6.3f} s" if rec.first_alert else
          "crash -> first alert     never")
    print(f"crash -> first confirmed {rec.first_dead - rec.at:6.3f} s" if rec.first_dead else
          "crash -> first confirmed never")
    if knew:
        print(f"crash -> known dead      p50 {statistics.median(knew):.3f} s, "
              f"all {len(knew)}/{len(live)} live members by "
              f"{'never' if all_know is None else f'{all_know:.3f} s'}")
    held = [m for m in live if m in rec.decided]
    decided_all = rec.all_decided_s(live)
    print(f"crash -> new config held by {len(held)}/{len(live)} live members by "
          f"{'never' if decided_all is None else f'{decided_all:.3f} s'}")
    final = cluster.by_id[live[0]].core.configuration
    replaced = final.ranks[config.ranks.index(victim.id)]
    print(f"rank {config.ranks.index(victim.id)} is now held by "
          f"{'nobody' if replaced is None else name(replaced)} (configuration "
          f"{final.config_id}); safety violations: {safety.count}")
    print(f"stalled member: {busy.core.counters['stalls']} stalls, "
          f"{busy.core.counters['refutations']} refutations, removed: {busy.core.removed}")
    print(f"false removals: {len(recorder.false_removals)}")
    rejected = cluster.counters["rejected"]
    if sealed:
        print(f"datagrams rejected by the wire: {rejected}")
    ok = (all_know is not None and decided_all is not None and replaced in config.spares
          and safety.ok and not recorder.false_removals and not busy.core.removed)
    print("RESULT:", "ok" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sims demo", description=plain(__doc__))
    parser.add_argument("--members", type=int, default=64, help="cluster size (default 64)")
    parser.add_argument("--seed", type=int, default=1, help="seed of every random choice")
    parser.add_argument("--loss", type=float, default=0.01,
                        help="probability a datagram is lost (default 0.01)")
    parser.add_argument("--crash-at", type=float, default=30.0,
                        help="virtual seconds before one member crashes (default 30)")
    parser.add_argument("--horizon", type=float, default=60.0,
                        help="virtual seconds simulated (default 60)")
    parser.add_argument("--objects", action="store_true",
                        help="hand message objects instead of sealed datagrams (faster)")
    args = parser.parse_args(argv)
    return run_demo(args.members, args.seed, args.loss, args.crash_at, args.horizon,
                    sealed=not args.objects)


if __name__ == "__main__":
    sys.exit(main())
