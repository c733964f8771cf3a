"""AgentMetrics: its own registry, exact sample values, counters synced from the runtime."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from torchpass_p2p.agent.metrics import (
    CONTENT_TYPE,
    DETECTION_BUCKETS_S,
    MAX_LABEL_VALUES,
    OTHER,
    SYNCED,
    AgentMetrics,
)


def samples(metrics: AgentMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, from the rendered text."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: AgentMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


def test_fresh_metrics_export_every_fixed_series_at_zero() -> None:
    m = AgentMetrics()
    s = samples(m)
    for state in ("alive", "suspect", "dead", "left"):
        assert s[("torchpass_members", (("state", state),))] == 0
    for role in ("rank", "spare"):
        assert s[("torchpass_members_by_role", (("role", role),))] == 0
    for path in ("fast", "classic"):
        assert s[("torchpass_configuration_changes_total", (("path", path),))] == 0
    assert s[("torchpass_config_id", ())] == 0
    assert s[("torchpass_step", ())] == 0
    assert s[("torchpass_fenced", ())] == 0
    assert s[("torchpass_decisions_total", ())] == 0
    assert s[("torchpass_hang_watchdog_fired_total", ())] == 0
    assert s[("torchpass_detection_latency_seconds_count", ())] == 0
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_gauges() -> None:
    m = AgentMetrics()
    m.set_members({"alive": 7, "suspect": 1}, {"rank": 4, "spare": 3, "joining": 1})
    m.set_config(12)
    m.set_step(345)
    m.set_fenced(True)
    assert value(m, "torchpass_members", state="alive") == 7
    assert value(m, "torchpass_members", state="suspect") == 1
    assert value(m, "torchpass_members", state="dead") == 0
    assert value(m, "torchpass_members_by_role", role="rank") == 4
    assert value(m, "torchpass_members_by_role", role="joining") == 1
    assert value(m, "torchpass_config_id") == 12
    assert value(m, "torchpass_step") == 345
    assert value(m, "torchpass_fenced") == 1
    # a state or role absent from the next call drops to 0 (its series stays)
    m.set_members({"alive": 6, "dead": 1}, {"rank": 4, "spare": 2})
    assert value(m, "torchpass_members", state="suspect") == 0
    assert value(m, "torchpass_members", state="dead") == 1
    assert value(m, "torchpass_members_by_role", role="joining") == 0
    m.set_fenced(False)
    assert value(m, "torchpass_fenced") == 0


def test_decisions_by_path() -> None:
    m = AgentMetrics()
    m.decided("fast")
    m.decided("fast")
    m.decided("classic")
    assert value(m, "torchpass_decisions_total") == 3
    assert value(m, "torchpass_configuration_changes_total", path="fast") == 2
    assert value(m, "torchpass_configuration_changes_total", path="classic") == 1
    with pytest.raises(ValueError, match="fast"):
        m.decided("slow")
    assert value(m, "torchpass_decisions_total") == 3


def test_detection_histogram_buckets() -> None:
    m = AgentMetrics()
    for seconds in (0.05, 0.3, 1.2, 4.0, 45.0):
        m.observe_detection(seconds)
    name = "torchpass_detection_latency_seconds"
    assert value(m, name + "_count") == 5
    assert value(m, name + "_sum") == pytest.approx(50.55)
    assert value(m, name + "_bucket", le="0.1") == 1
    assert value(m, name + "_bucket", le="0.5") == 2
    assert value(m, name + "_bucket", le="1.5") == 3
    assert value(m, name + "_bucket", le="5.0") == 4
    assert value(m, name + "_bucket", le="30.0") == 4
    assert value(m, name + "_bucket", le="+Inf") == 5
    assert DETECTION_BUCKETS_S[0] == 0.1 and DETECTION_BUCKETS_S[-1] == 30.0
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            m.observe_detection(bad)
    assert value(m, name + "_count") == 5


def test_hang_watchdog() -> None:
    m = AgentMetrics()
    m.hang_fired()
    m.hang_fired()
    assert value(m, "torchpass_hang_watchdog_fired_total") == 2


def test_sync_raises_to_totals_without_double_counting() -> None:
    m = AgentMetrics()
    rejected: Counter[str] = Counter()
    rejected["auth_failed"] += 3
    rejected["too_short"] += 1
    m.sync_rejected(rejected)
    m.sync_rejected(rejected)  # same totals: nothing added
    assert value(m, "torchpass_rejected_datagrams_total", reason="auth_failed") == 3
    assert value(m, "torchpass_rejected_datagrams_total", reason="too_short") == 1
    rejected["auth_failed"] += 2
    rejected["replay"] += 5
    m.sync_rejected(rejected)
    assert value(m, "torchpass_rejected_datagrams_total", reason="auth_failed") == 5
    assert value(m, "torchpass_rejected_datagrams_total", reason="replay") == 5
    # a total that goes down (a replaced counter) is ignored: Prometheus counters never fall
    m.sync_rejected({"auth_failed": 1})
    assert value(m, "torchpass_rejected_datagrams_total", reason="auth_failed") == 5
    m.sync_rejected({"auth_failed": 6})
    assert value(m, "torchpass_rejected_datagrams_total", reason="auth_failed") == 6


def test_every_synced_family() -> None:
    m = AgentMetrics()
    m.sync_rejected_frames({"too_large": 2})
    m.sync_counters("bytes", {"sent": 1000, "received": 2500})
    m.sync_counters("datagrams", {"sent": 10, "received": 25})
    m.sync_counters("events", {"suspected": 2, "decided": 1})
    m.sync_counters("health_faults", {"xid": 1})
    m.sync_counters("http_rejected", {"bad_token": 4})
    m.sync_counters("pulse", {"pings": 30, "responder_answered": 29})
    m.sync_counters("rejected_datagrams", {"replay": 9})
    m.sync_counters("transfer_refused", {"bad_frame": 3, "kernel_dropped": 40})
    m.sync_counters("keys", {"reloads": 2, "refusals_sent": 5})
    assert value(m, "torchpass_keys_total", event="reloads") == 2
    assert value(m, "torchpass_keys_total", event="refusals_sent") == 5
    assert value(m, "torchpass_rejected_frames_total", reason="too_large") == 2
    assert value(m, "torchpass_bytes_total", direction="sent") == 1000
    assert value(m, "torchpass_bytes_total", direction="received") == 2500
    assert value(m, "torchpass_datagrams_total", direction="received") == 25
    assert value(m, "torchpass_events_total", type="suspected") == 2
    assert value(m, "torchpass_health_faults_total", kind="xid") == 1
    assert value(m, "torchpass_http_rejected_total", reason="bad_token") == 4
    assert value(m, "torchpass_rejected_datagrams_total", reason="replay") == 9
    assert value(m, "torchpass_pulse_total", kind="responder_answered") == 29
    assert value(m, "torchpass_transfer_refused_total", reason="bad_frame") == 3
    assert value(m, "torchpass_transfer_refused_total", reason="kernel_dropped") == 40
    assert set(SYNCED) == {"rejected_datagrams", "rejected_frames", "bytes", "datagrams",
                           "events", "health_faults", "http_rejected", "pulse",
                           "transfer_refused", "keys"}
    with pytest.raises(KeyError):
        m.sync_counters("nonsense", {"a": 1})


def test_label_values_are_capped() -> None:
    m = AgentMetrics()
    m.sync_counters("events", {f"type{i:03d}": 1 for i in range(MAX_LABEL_VALUES + 3)})
    s = samples(m)
    types = {dict(labels)["type"] for (name, labels) in s if name == "torchpass_events_total"}
    assert len(types) == MAX_LABEL_VALUES + 1
    assert value(m, "torchpass_events_total", type=OTHER) == 3
    # a folded label keeps its own running total: growth still reaches "other"
    m.sync_counters("events", {f"type{MAX_LABEL_VALUES + 2:03d}": 4})
    assert value(m, "torchpass_events_total", type=OTHER) == 6


def test_two_agents_in_one_process_do_not_collide() -> None:
    before = {m.name for m in REGISTRY.collect()}
    a, b = AgentMetrics(), AgentMetrics()
    a.set_step(10)
    b.set_step(20)
    a.decided("fast")
    a.sync_rejected({"replay": 3})
    assert value(a, "torchpass_step") == 10
    assert value(b, "torchpass_step") == 20
    assert value(a, "torchpass_decisions_total") == 1
    assert value(b, "torchpass_decisions_total") == 0
    assert ("torchpass_rejected_datagrams_total", (("reason", "replay"),)) not in samples(b)
    # nothing went into the process-global registry
    after = {m.name for m in REGISTRY.collect()}
    assert after == before
    assert not any(name.startswith("torchpass_") for name in after)


def test_stragglers_have_a_count_and_a_lag_series_while_named() -> None:
    m = AgentMetrics()
    m.set_stragglers(None)
    assert value(m, "torchpass_stragglers") == 0
    m.set_stragglers([{"rank": 1, "member_id": "00000000000000aa", "lag_s": 0.203},
                      {"rank": 3, "member_id": "00000000000000bb", "lag_s": 0.5}])
    assert value(m, "torchpass_stragglers") == 2
    assert value(m, "torchpass_straggler_lag_seconds", rank="1",
                 member="00000000000000aa") == 0.203
    assert value(m, "torchpass_straggler_lag_seconds", rank="3",
                 member="00000000000000bb") == 0.5
    m.set_stragglers([{"rank": 3, "member_id": "00000000000000bb", "lag_s": 0.25}])
    lags = {k: v for k, v in samples(m).items() if k[0] == "torchpass_straggler_lag_seconds"}
    assert lags == {("torchpass_straggler_lag_seconds",
                     (("member", "00000000000000bb"), ("rank", "3"))): 0.25}
    assert value(m, "torchpass_stragglers") == 1
