"""Protocol parameters of the membership core, with the source of every default.

All durations are seconds of the monotonic clock the host passes in as ``now``. The defaults are
tuned for a LAN (about 1 ms round trips); ``configs/lan.toml`` lists the same values with one
comment each, and :func:`torchpass_p2p.config.load_params` reads such a file.

Sources quoted below:

* SWIM: Das, Gupta, Motivala, "SWIM: Scalable Weakly-consistent Infection-style Process Group
  Membership Protocol", DSN 2002.
* Lifeguard: Dadgar, Phillips, Currey, "Lifeguard: Local Health Awareness for More Accurate
  Failure Detection", arXiv:1707.00788 (2018).
* Rapid: Suresh et al., "Stable and Consistent Membership at Scale with Rapid", USENIX ATC 2018.
* memberlist: hashicorp/memberlist ``DefaultLANConfig`` (config.go).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class Params:
    """Every tunable of the membership core. Immutable; build a new one to change a value."""

    # --- probing (SWIM section 3.1, with Rapid's fixed observers instead of random targets) ---
    probe_interval_s: float = 1.0
    """Each observer probes each of its subjects once per interval. memberlist LAN: 1 s."""
    probe_timeout_s: float = 0.2
    """Wait for a direct ack before asking relays. Our measurement: loopback RTT < 1 ms;
    memberlist LAN uses 0.5 s for slower networks."""
    round_timeout_s: float = 0.5
    """A probe round (direct + indirect) fails if no ack arrived by then."""
    indirect_probes: int = 3
    """Relays asked per failed direct ping (SWIM's k; memberlist IndirectChecks = 3)."""
    failed_rounds_to_alert: int = 2
    """M: consecutive failed rounds of one observer->subject edge before the observer raises an
    alert. Rapid section 4.1 counts consecutive probe failures per edge; 2 keeps a 1 % lossy link
    (two-round failure odds ~1e-12 with 3 relays) from ever alerting."""

    # --- observers (Rapid section 4.1) ---
    observers: int = 10
    """K: observers per subject, one per pseudo-random ring. Rapid: K = 10."""
    min_alerts_to_confirm: int = 3
    """L: fewer distinct observers' alerts than this never make a member dead, however long the
    suspicion lasts. Rapid ignores fewer than L = 3 of K = 10 reports (about 0.3 K)."""

    # --- suspicion (Lifeguard section IV-B) ---
    suspicion_min_s: float = 1.0
    """Suspicion timeout once all expected observers confirmed. Chosen so a member whose loop
    stalls for 2 s can refute: first alert after >= 1.5 s, dead no sooner than 2.5 s."""
    suspicion_max_s: float = 6.0
    """Suspicion timeout with a single accuser. Lifeguard: beta = 6 times the minimum."""
    start_grace_s: float = 30.0
    """Start-up grace: a member of the configuration an observer started in that it has not
    heard from yet is not accused (failed probe rounds, pulse silences, unreachable reports)
    until this long after its process was started, as its host was told (the launcher's
    record, ``Member``'s ``started``; the observer's own start where it was not). A training
    script imports torch and builds its model before its agent answers: 2-10 s on a loaded
    host, where a rank whose process started 2.9 s after the others' was convicted 2.55 s
    into their probing, before its script ran. Bounded, so a member that never starts is
    still convicted, this much later; its launcher reports a process that exits at once
    (``report_exited``, no grace). Ours."""

    # --- local health (Lifeguard section IV-A) ---
    max_health_multiplier: int = 8
    """S: the local health multiplier saturates at this value (Lifeguard: S = 8)."""
    stall_tolerance_s: float = 0.25
    """A timer that fires this much late means our own loop stalled: void open rounds."""
    self_suspect_after_s: float = 1.0
    """No ack and no relay's nack from anyone for this long while probing >= 2 subjects: suspect
    ourselves, accuse nobody (docs/design.md section 4). Shorter than the M failed rounds an alert
    needs, so an isolated member always knows it before it could accuse; a healthy member hears
    an ack every probe_interval / subjects, or nacks from relays when its subjects are dead, so
    a false self-suspicion (which only silences us) is rare."""

    # --- dissemination (SWIM section 4.1, memberlist) ---
    retransmit_mult: int = 4
    """lambda: each update is piggybacked up to lambda * ceil(log10(N + 1)) times.
    memberlist LAN RetransmitMult = 4."""
    gossip_interval_s: float = 0.2
    """Periodic push of pending updates. memberlist LAN GossipInterval = 200 ms."""
    gossip_fanout: int = 3
    """Members per push. memberlist LAN GossipNodes = 3."""
    max_piggyback: int = 24
    """Updates per datagram; keeps a sealed datagram under 1,400 bytes (codec limit)."""

    # --- anti-entropy (memberlist push/pull, made digest-first) ---
    sync_interval_s: float = 10.0
    """Mean time between digest exchanges with one random peer (jittered +-50 %).
    memberlist LAN PushPullInterval = 30 s; ours only sends a 30-byte digest."""
    sync_page_entries: int = 32
    """Entries per SyncState page."""

    # --- agreement (Rapid section 4.2 and 5; Fast Paxos) ---
    alerts_to_remove: int = 9
    """H: alerts from this many of a subject's observers make it part of a cut on their own, once
    ``suspicion_min_s`` has passed since the first (Rapid: H = K - 1 = 9)."""
    cut_settle_s: float = 0.6
    """A member votes only for a cut that has not changed for this long and has nothing
    unstable, so failures that begin together become one change; it also bounds how soon after
    a conviction anyone votes. With M = 2 failed rounds (>= 1.5 s after a member stops
    answering) and ``suspicion_min_s`` (1 s), no vote comes sooner than 3.1 s into a loop stall,
    so a member blocked for up to 3 s (scenario S01) refutes first, unless an observer carried
    a failed round over from an earlier stall. Ours; it costs 0.5 s of decision latency."""
    exit_settle_s: float = 0.2
    """``cut_settle_s`` for a cut that only removes members that left or whose process exited
    (their launcher reaped it: certain, and owed no refutation window): exits that happen
    together still become one change, for the siblings that report them hear of them within
    milliseconds and gossip carries them together, but a killed rank is replaced ~0.4 s
    sooner. Ours; measured in the simulator (4 ranks + 2 spares, two ranks killed up to
    0.1 s apart, launcher reports): see ``tests/sims/test_s09_s12_recovery_plan.py``. Also
    for members whose observers found their whole process silent (``Membership.report_silent``):
    equally owed no window, and silences that begin together are reported within a pulse."""
    refutation_window_s: float = 1.6
    """Nobody votes to remove a member sooner than this after it first heard it accused: the
    time a member whose loop stalled has to wake and refute (scenario S01). M = 2 failed rounds
    take at least ``round_timeout_s + probe_interval_s`` = 1.5 s after a member stops
    answering, so no vote comes sooner than 1.5 + 1.6 = 3.1 s into a stall: a member blocked
    for up to 3 s refutes first. Ours; a crash is decided about as fast, since the first alert
    reaches everyone ~1 s before the conviction does. Not owed (nor ``suspicion_min_s``) by a
    member whose observers found its process silent: a stalled loop still answers its pulses,
    so that floor only holds for members without a pulse responder."""
    vote_push_interval_s: float = 0.01
    """Shortest gap between two eager pushes of changed vote bitmaps by one member (ours: one
    member still does not send a push per received vote). Pushes only run while a change is
    undecided, so a shorter gap buys a faster decision for no more bytes. Measured
    (``benchmarks.agreement --set``, ``sims run crash_16k``), 1 % loss: 1,000 members, 10
    simultaneous crashes, 6 seeds: p50 3.528 -> 3.403 s against 25 ms; 16,384 members, one
    crash: decided 3.372 -> 3.147 s, 4,037 -> 3,901 bytes per member per second."""
    vote_resend_s: float = 0.5
    """While undecided, every member sends all its tallies to one random peer this often (anti-
    entropy for lost pushes)."""
    classic_timeout_s: float = 1.5
    """No decision this long after this member voted (or saw a vote): start a classic round
    (Rapid falls back to classic Paxos on a timeout, section 5). Ours: fast rounds finish in
    under 1 s at 16k members."""
    classic_spread_s: float = 1.0
    """Classic rounds start after ``classic_timeout_s`` plus a delay spread uniformly over this
    by a hash of (config_id, attempt, member), so coordinators rarely collide."""
    lease_s: float = 5.0
    """A member that believes fewer than a majority of its configuration reachable for this
    long stops training on its own (docs/design.md section 5, fencing)."""
    join_retry_s: float = 1.0
    """A joining process re-sends its Join to the next seed this often until admitted."""
    certificate_log: int = 16
    """Decisions kept to let lagging members catch up."""
    max_pending_joins: int = 64
    """Joiners remembered while their admission is pending."""

    # --- bounds ---
    max_events: int = 65_536
    """Events held for the host; beyond it the oldest is dropped and counted."""
    max_outbox: int = 65_536
    """Datagrams held for the host; beyond it the oldest is dropped and counted."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"parameter {f.name} must be a positive number, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"parameter {f.name} must be finite, got {value!r}")
        if self.probe_timeout_s >= self.round_timeout_s:
            raise ValueError("probe_timeout_s must be shorter than round_timeout_s")
        if self.round_timeout_s > self.probe_interval_s:
            raise ValueError("round_timeout_s must not exceed probe_interval_s")
        if self.alerts_to_remove < self.min_alerts_to_confirm:
            raise ValueError("alerts_to_remove must be at least min_alerts_to_confirm")
        if self.suspicion_min_s > self.suspicion_max_s:
            raise ValueError("suspicion_min_s must not exceed suspicion_max_s")
        if self.exit_settle_s > self.cut_settle_s:
            raise ValueError("exit_settle_s must not exceed cut_settle_s")

    def transmit_limit(self, members: int) -> int:
        """Times one update is piggybacked: ``retransmit_mult * ceil(log10(members + 1))``
        (memberlist ``retransmitLimit``; SWIM section 4.1 shows lambda*log(N) suffices for
        large N), with the logarithm at least 2. Below 10 members memberlist's formula gives 4
        sends in all; in a 6-member job that lost 2 members at once, an alert then missed a
        live member in 3 of 1,000 simulated runs (the cut waited for it until the next
        configuration), and in none with 8."""
        return self.retransmit_mult * max(2, math.ceil(math.log10(members + 1)))

    def suspicion_timeout_s(self, confirmations: int, expected: int) -> float:
        """Lifeguard section IV-B: ``max(min, max - (max - min) * log(C + 1) / log(K + 1))``.

        ``confirmations`` (C) counts independent alerts after the first; ``expected`` (K) is how
        many confirmations can arrive at all. Returns seconds since the suspicion started.
        """
        if expected < 1:
            return self.suspicion_min_s
        frac = math.log(confirmations + 1) / math.log(expected + 1)
        span = self.suspicion_max_s - self.suspicion_min_s
        return max(self.suspicion_min_s, self.suspicion_max_s - span * frac)
