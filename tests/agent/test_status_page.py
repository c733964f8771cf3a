"""The status page in headless Chromium against a status server whose document holds markup in
every string a peer or a driver could fill: the page draws every section, shows those strings
as text and runs none of them, and redraws live when the document changes."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.agent.browser import Browser
from tests.agent.test_http import TOKEN
from torchpass_p2p.agent.http import StatusServer
from torchpass_p2p.agent.metrics import AgentMetrics

HOSTILE_ID = '<img src=x onerror="document.title=\'owned\'">'
HOSTILE_ADDRESS = "<script>document.title='owned'</script>"
HOSTILE_DETAIL = "</li><b id=injected>bold</b><iframe src=/status></iframe>"
HOSTILE_ERROR = "<svg onload=\"document.title='owned'\"></svg>"
ME = "00000000000000a1"

DOCUMENT: dict[str, Any] = {
    "member_id": ME, "cluster": "<i>cluster</i>", "role": "rank", "rank": 0, "config_id": 3,
    "world_size": 3, "step": 120, "phase": "compute", "fenced": False, "draining": False,
    "clock": 1000.0,
    "members": [
        {"member_id": ME, "role": "rank", "rank": 0, "state": "alive", "incarnation": 0,
         "address": "127.0.0.1:40001"},
        {"member_id": HOSTILE_ID, "role": "rank", "rank": 1, "state": "suspect",
         "incarnation": 2, "address": HOSTILE_ADDRESS},
        {"member_id": "00000000000000c3", "role": "rank", "rank": 2, "state": "alive",
         "incarnation": 0, "address": "127.0.0.1:40003"},
        {"member_id": "00000000000000d4", "role": "spare", "rank": None, "state": "alive",
         "incarnation": 0, "address": "127.0.0.1:40004"},
    ],
    "recent_events": [{"at": 998.5, "type": "HealthFault", "detail": HOSTILE_DETAIL}],
    "health": {"enabled": True, "state": "degraded", "last_error": HOSTILE_ERROR},
    "counters": {"rejected_bad_mac": 3, "datagrams_sent": 10},
    "pulse": {"responder_port": 40100, "watching": 2, "silent": []},
    "configurations": [
        {"config_id": 3, "decided_at": 990.0, "round": 0, "world_size": 3,
         "ranks": [ME, HOSTILE_ID, "00000000000000c3"], "spares": ["00000000000000d4"],
         "removed": ["00000000000000b2"], "joined": [], "assignments": [[1, HOSTILE_ID]],
         "action": "continue", "resume_step": 100}],
    "recoveries": [
        {"config_id": 3, "removed": ["00000000000000b2"], "assignments": [[1, HOSTILE_ID]],
         "vacant": [], "action": "continue", "resume_step": 100, "detected_at": 989.5,
         "decided_at": 990.0, "transferred_at": 990.4, "transferred_by": "sent",
         "rebuilt_at": 990.6, "resumed_at": None}],
    "transfer": {"direction": "sending", "config_id": None, "step": 100, "done_bytes": 1 << 20,
                 "total_bytes": 4 << 20, "sources": None, "started_at": 990.1,
                 "updated_at": 990.4, "finished_at": None},
    "stragglers": [{"rank": 1, "member_id": HOSTILE_ID, "lag_s": 0.2}],
}


class Source:
    def __init__(self) -> None:
        self.document = copy.deepcopy(DOCUMENT)

    def status(self) -> dict[str, Any]:
        return self.document

    async def drain(self) -> dict[str, Any]:
        return {}

    def report_unreachable(self, member_id: int, reason: str, exited: bool = False) -> bool:
        return False


DOM = """(() => {
  const rows = [...document.querySelectorAll('#members tbody tr')];
  return {
    updates: Number(document.body.dataset.updates || 0),
    title: document.title,
    config: document.getElementById('summary').dataset.configId,
    cluster: document.getElementById('cluster').textContent,
    members: rows.map((r) => [...r.cells].map((c) => c.textContent)),
    roles: rows.map((r) => r.dataset.role),
    phases: [...document.querySelectorAll('.recovery .phase')].map(
        (p) => [p.dataset.phase, p.classList.contains('seen'), p.textContent]),
    recovery: document.querySelector('.recovery h3')?.textContent,
    transfer: document.getElementById('transfer').textContent,
    progress: [document.querySelector('#transfer progress')?.value,
               document.querySelector('#transfer progress')?.max],
    configurations: [...document.querySelectorAll('#configurations tbody tr')].map(
        (r) => [...r.cells].map((c) => c.textContent)),
    stragglers: [...document.querySelectorAll('#stragglers td')].map((c) => c.textContent),
    health: document.getElementById('health').textContent,
    events: [...document.querySelectorAll('#events li')].map((li) => li.textContent),
    injected: document.querySelectorAll(
        'img, svg, iframe, b, i, #injected, script:not([src])').length,
    scripts: [...document.scripts].map((s) => s.getAttribute('src')),
    error: document.getElementById('error').hidden ? null
        : document.getElementById('error').textContent,
  };
})()"""


@pytest.mark.timeout(900)  # the first browser test may install Chromium (CI)
async def test_every_section_is_drawn_as_text_and_redrawn_live(browser: Browser) -> None:
    source = Source()
    server = StatusServer(source, AgentMetrics(), token=TOKEN,
                          stream_options={"interval_s": 0.05})
    host, port = await server.start()
    try:
        page = await browser.open(f"http://{host}:{port}/")
        await page.wait_for("Number(document.body.dataset.updates || 0) >= 1", timeout_s=60)
        dom = await page.evaluate(DOM)
        assert dom["error"] is None
        # Nothing in the data became markup, and nothing of it ran.
        assert dom["injected"] == 0
        assert dom["scripts"] == ["/page.js"]
        assert dom["title"] == "torchpass_p2p status"
        assert dom["cluster"] == "<i>cluster</i>"
        assert dom["config"] == "3"
        assert dom["members"] == [
            ["0", ME, "rank", "alive", "0", "127.0.0.1:40001"],
            ["1", HOSTILE_ID, "rank", "suspect", "2", HOSTILE_ADDRESS],
            ["2", "00000000000000c3", "rank", "alive", "0", "127.0.0.1:40003"],
            ["\u2014", "00000000000000d4", "spare", "alive", "0", "127.0.0.1:40004"],
        ]
        assert dom["recovery"] == f"configuration 3: rank 1 \u2192 {HOSTILE_ID}"
        assert dom["phases"] == [
            ["detected", True, "detected+0.00 s"], ["decided", True, "decided+0.50 s"],
            ["transferred", True, "transferred (sent)+0.90 s"],
            ["rebuilt", True, "rebuilt+1.10 s"], ["resumed", False, "resumed\u2014"]]
        assert dom["progress"] == [1 << 20, 4 << 20]
        assert "1.00 MiB of 4.00 MiB (25 %)" in dom["transfer"]
        assert dom["configurations"] == [[
            "3", "10.0 s ago", "fast", f"0: {ME}1: {HOSTILE_ID}2: 00000000000000c3",
            "00000000000000d4", "00000000000000b2", "\u2014", "100", "continue"]]
        assert dom["stragglers"] == ["1", HOSTILE_ID, "0.2"]
        assert HOSTILE_ERROR in dom["health"] and "rejected_bad_mac3" in dom["health"]
        assert dom["events"] == [f"1.5 s agoHealthFault{HOSTILE_DETAIL}"]

        # Live: a change reaches the open page without a reload.
        source.document = json.loads(json.dumps(DOCUMENT))
        source.document.update(config_id=4, stragglers=[])
        source.document["members"][1]["state"] = "dead"
        before = dom["updates"]
        dom = await page.wait_for(
            f"(() => {{ const d = {DOM}; return d.config === '4' ? d : null; }})()",
            timeout_s=60)
        assert dom["updates"] > before
        assert dom["members"][1][3] == "dead"
        assert dom["stragglers"] == []
        assert "None named" in await page.evaluate(
            "document.getElementById('stragglers').textContent")
        assert dom["injected"] == 0 and dom["title"] == "torchpass_p2p status"
    finally:
        await server.stop()
