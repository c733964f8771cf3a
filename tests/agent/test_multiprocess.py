"""Scenarios with real processes under the real launcher (docs/scenarios.md, MP).

Every member is its own Python process started by ``torchpass-p2p launch`` running
``tests/agent/mp_member.py``: an agent in a background thread and a stand-in training loop that
logs its steps, role changes and fencing to ``<member>.jsonl``. Faults are real: SIGSTOP and
SIGCONT, a network namespace without a route, a process holding the GIL, a process without the
key.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.launch.procs import REPO, clean_environ, finish, start_launcher, wait_for
from torchpass_p2p.launch.outcome import EXIT_KEY_REFUSED

MEMBER = str(REPO / "tests" / "agent" / "mp_member.py")


class Run:
    """One launcher with its children, and their logs."""

    def __init__(self, tmp_path: Path, ranks: int, spares: int, *, profile: str = "",
                 **env: str) -> None:
        self.logs = tmp_path / "logs"
        self.logs.mkdir(parents=True)
        environ = clean_environ() | {"MP_LOG_DIR": str(self.logs), "PYTHONPATH": str(REPO)}
        environ |= env
        self.ranks, self.spares = ranks, spares
        args = ["--nproc", str(ranks), "--spares", str(spares), "--grace", "3"]
        if profile:  # protocol parameters (TOML) other than the defaults
            (tmp_path / "profile.toml").write_text(profile)
            args += ["--config", str(tmp_path / "profile.toml")]
        self.launcher = start_launcher([*args, MEMBER], env=environ)

    def records(self) -> dict[str, list[dict]]:
        out = {}
        for path in self.logs.glob("*.jsonl"):
            with open(path) as f:
                out[path.stem] = [json.loads(line) for line in f if line.endswith("\n")]
        return out

    def started(self) -> dict[str, dict]:
        def all_up():
            recs = self.records()
            up = {m: r[0] for m, r in recs.items() if r and r[0]["event"] == "started"}
            return up if len(up) == self.ranks + self.spares else None
        return wait_for(all_up, 30, "every member started")

    def pid_of(self, member: str) -> int:
        status = self.started()[member]["status"]
        return _pid_listening(status[1])

    def stop(self) -> str:
        if self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)
        _, out = finish(self.launcher, 20)
        return out


def _pid_listening(port: int) -> int:
    """The pid owning the TCP socket listening on ``port`` (the member's status page)."""
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":
                inode = fields[9]
    assert inode is not None
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return int(pid)
            except OSError:  # this descriptor closed since the listing: the next one
                continue
    raise AssertionError(f"no process listens on {port}")


def events(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["event"] == kind]


@pytest.mark.slow
def test_s03_a_paused_rank_is_replaced_once_fenced_on_waking_and_never_trains_again(tmp_path):
    run = Run(tmp_path, 8, 2)
    try:
        up = run.started()
        victim = next(m for m, r in up.items() if r["rank"] == 3)
        pid = run.pid_of(victim)
        time.sleep(2)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        spares = [m for m, r in up.items() if r["role"] == "spare"]
        wait_for(lambda: any(events(run.records()[s], "role") for s in spares), 20,
                 "a spare promoted")
        time.sleep(max(0.0, stopped_at + 8.0 - time.time()))  # past the 5 s lease
        # Taken before the signal: the victim may run (and log) on the other core before
        # kill() returns, and nothing it logs after this instant was logged while stopped.
        resumed_at = time.time()
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: events(run.records()[victim], "role"), 15, "the victim learning")
        time.sleep(1.0)
    finally:
        run.stop()
    recs = run.records()
    mine = recs[victim]
    assert [r["role"] for r in events(mine, "role")] == ["removed"]
    assert not [r for r in events(mine, "step") if r["t"] >= stopped_at]  # never trained again
    # On waking it is fenced (or already knows it was removed) before it could train.
    woke = [r for r in mine if r["t"] >= resumed_at and r["event"] in ("fenced", "role")]
    assert woke and (woke[0]["event"] == "fenced" or woke[0]["role"] == "removed")
    promoted = [m for m in spares if events(recs[m], "role")]
    assert len(promoted) == 1  # replaced exactly once
    heir = events(recs[promoted[0]], "role")
    assert [(r["role"], r["rank"], r["config_id"]) for r in heir] == [("rank", 3, 1)]
    assert events(recs[promoted[0]], "step")  # and the heir trains
    survivors = [m for m, r in up.items() if r["role"] == "rank" and m != victim]
    assert all(max(r["config_id"] for r in events(recs[m], "step")) == 1 for m in survivors)
    # Its observers found its pulse silent (the removal owed no refutation window).
    assert sum(last_counter(recs[m], "silences") for m in recs if m != victim) >= 1


def test_s07_a_member_whose_sends_fail_suspects_itself_and_is_replaced(tmp_path):
    # The victim's agent starts in the empty namespace: nobody ever hears it, as if it had not
    # started, so under the default 30 s start-up grace (Params.start_grace_s, exact in
    # tests/core/test_start_grace.py) its replacement would wait that out. This scenario is a
    # member losing its network: a 1 s grace.
    run = Run(tmp_path, 3, 1, profile="[suspicion]\nstart_grace_s = 1.0\n", MP_UNSHARE_RANK="2")
    try:
        up = run.started()
        victim = next(m for m, r in up.items() if r["rank"] == 2)
        spare = next(m for m, r in up.items() if r["role"] == "spare")
        wait_for(lambda: events(run.records()[spare], "role"), 20, "the spare promoted")
        wait_for(lambda: events(run.records()[victim], "fenced"), 15, "the victim fencing")
        status = up[victim]["status"]
    finally:
        out = run.stop()
    recs = run.records()
    assert [(r["rank"], r["config_id"]) for r in events(recs[spare], "role")] == [(2, 1)]
    assert status is not None, out
    # The others never heard it: no step of the victim happened after it was fenced.
    fenced_at = events(recs[victim], "fenced")[0]["t"]
    assert not [r for r in events(recs[victim], "step") if r["t"] > fenced_at]


@pytest.mark.slow
def test_s01_members_holding_the_gil_in_bursts_are_never_removed(tmp_path):
    # Every member holds its GIL for 0.8-3 s chunks, half the time, for 40 s: their agents
    # stall, their peers must not remove anyone (S01, MP version, shortened from 10 minutes).
    run = Run(tmp_path, 4, 1, MP_GIL_BURSTS="0.8,3.0,0.5", MP_STEPS="100000")
    try:
        run.started()
        time.sleep(40)
    finally:
        run.stop()
    recs = run.records()
    assert all(not events(r, "role") for r in recs.values())  # nobody removed or promoted
    assert all(events(r, "step") for m, r in recs.items() if r[0]["role"] == "rank")
    # The bursts really stalled the agents (else this test proves nothing).
    stalls = [last_counter(r, "stalls") for r in recs.values()]
    assert sum(s > 0 for s in stalls) >= 3
    # Their pulse responders answered through the bursts: nobody found anyone silent.
    assert all(last_counter(r, "answered") > 0 for r in recs.values())
    assert all(last_counter(r, "silences") == 0 for r in recs.values())


def last_counter(records: list[dict], name: str) -> int:
    return max((c[name] for c in events(records, "counters")), default=0)


ROGUE = """
import asyncio, json, socket, sys
import torchpass_p2p
from torchpass_p2p.agent.api import AgentError
from torchpass_p2p.agent.transport import Transport, Kind, TransportError
from torchpass_p2p.core.codec import encode
from torchpass_p2p.core.messages import Cut, Join, Joiner, Vote
from torchpass_p2p.core.seal import Keyring, Sealer

targets = [tuple(a) for a in json.loads(sys.argv[1])]
key = bytes(range(32))  # not the cluster's
outcome = {}
sealer = Sealer("torchpass", Keyring(key), 0xBAD)
vote = Vote(0, 0, Cut(removed=()), 0, bytes([255, 255]), 5)  # votes for everyone
join = Join(Joiner(0xBAD, "127.0.0.1", 1), 0)
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    for t in targets:
        for m in (vote, join):
            s.sendto(sealer.seal(encode(m), 0), t)

async def claim():  # ask for the configuration over TCP, as a joiner would
    tr = Transport("torchpass", Keyring(key), 0xBAD, on_message=print,
                   on_send_error=print, on_request=lambda k, b: None)
    try:
        await tr.request(targets[0], Kind.CONFIG_REQUEST, b"", timeout_s=2)
        return "answered"
    except TransportError:
        return "refused"
outcome["claim"] = asyncio.run(claim())
print(json.dumps(outcome), flush=True)
try:  # join as a spare through the members: refused, the process exits 6 in start()
    torchpass_p2p.start(key=key, seeds=tuple(targets), status=None, health=False,
                        member_id=0xBAD, bind=("127.0.0.1", 0), join_timeout_s=2.0)
    print("join accepted")
except AgentError as exc:
    print(f"join failed otherwise: {exc}")
"""


def test_s16_a_process_without_the_key_cannot_join_vote_or_claim(tmp_path):
    import subprocess
    import sys
    import urllib.request

    run = Run(tmp_path, 3, 1)
    try:
        up = run.started()
        targets = [r["address"] for r in up.values()]
        rogue = subprocess.run(
            [sys.executable, "-c", ROGUE, json.dumps(targets)], cwd=REPO, capture_output=True,
            text=True, timeout=60, env=clean_environ() | {"PYTHONPATH": str(REPO)})
        assert json.loads(rogue.stdout.splitlines()[0]) == {"claim": "refused"}
        # Its join is refused by every seed: one line naming key ids (never keys), exit 6.
        assert rogue.returncode == EXIT_KEY_REFUSED, rogue.stdout + rogue.stderr
        assert rogue.stdout.splitlines()[1:] == [], rogue.stdout
        [line] = [ln for ln in rogue.stderr.splitlines() if "key not accepted" in ln]
        assert line.startswith("torchpass_p2p: member 0000000000000bad: key not accepted: ")
        assert line.endswith(f"exit code {EXIT_KEY_REFUSED}"), line
        time.sleep(1.0)
        statuses, metrics = [], []
        for r in up.values():
            host, port = r["status"]
            with urllib.request.urlopen(f"http://{host}:{port}/status", timeout=5) as f:
                statuses.append(json.load(f))
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as f:
                metrics.append(f.read().decode())
    finally:
        run.stop()
    assert all(s["config_id"] == 0 and len(s["members"]) == 4 for s in statuses)
    for doc in statuses:
        counters = doc["counters"]
        # the vote and the join datagrams, and the joiner's requests: all refused, counted
        assert counters.get("rejected_unknown_key", 0) + counters.get("rejected_auth_failed",
                                                                       0) >= 2
    assert any(doc["counters"].get("rejected_frame_unknown_key", 0)
               + doc["counters"].get("rejected_frame_auth_failed", 0) >= 1 for doc in statuses)
    assert all("torchpass_rejected_datagrams_total" in m for m in metrics)


def test_a_sigkilled_rank_is_reported_by_the_launcher_and_replaced(tmp_path):
    import urllib.request

    run = Run(tmp_path, 3, 1)
    try:
        up = run.started()
        victim = next(m for m, r in up.items() if r["rank"] == 1)
        spare = next(m for m, r in up.items() if r["role"] == "spare")
        time.sleep(1.0)
        os.kill(run.pid_of(victim), signal.SIGKILL)
        killed_at = time.time()
        wait_for(lambda: events(run.records()[spare], "role"), 20, "the spare promoted")
        promoted_at = events(run.records()[spare], "role")[0]["t"]
        counters = []
        for m, r in up.items():
            if m != victim:
                host, port = r["status"]
                with urllib.request.urlopen(f"http://{host}:{port}/status", timeout=5) as f:
                    counters.append(json.load(f)["counters"])
    finally:
        run.stop()
    # The launcher saw the exit and told the siblings at once, as certain evidence.
    assert sum(c.get("exits_reported", 0) for c in counters) >= 2
    print(f"killed -> spare holds the rank: {promoted_at - killed_at:.2f} s")
    assert [(r["rank"], r["config_id"]) for r in events(run.records()[spare], "role")] \
        == [(1, 1)]


def test_a_wrapper_must_pass_the_handed_sockets_on(tmp_path):
    # The launcher hands each child its ports as bound sockets. A wrapper that passes them on
    # to the real script works; one that closes them (subprocess's default) still holds the
    # ports, and the script's agent says why it cannot start.
    run = Run(tmp_path / "pass", 2, 1, MP_WRAP="pass", MP_STEPS="20")
    try:
        up = run.started()
        wait_for(lambda: all(events(run.records()[m], "step") for m, r in up.items()
                             if r["role"] == "rank"), 20, "both ranks training")
    finally:
        run.stop()
    assert sorted(r["members"] for r in up.values()) == [3, 3, 3]

    run = Run(tmp_path / "close", 2, 1, MP_WRAP="close")
    code, out = finish(run.launcher, 30)
    assert code == 1
    # (the number names nothing, a file the member opened since, or a socket of its own: the
    # agent's second message. In one CI run only two of the three members' errors matched the
    # first; the output is shown on failure)
    assert len(re.findall(r"AgentError: the agent failed to start: NotInherited\('descriptor "
                          r"\d+: (?:not an open socket \([^)]*\)|not a SOCK_\w+ socket bound "
                          r"to port \d+); the launcher hands its child these sockets, bound; a "
                          r"wrapper process must pass them on", out)) == 3, out


SNIPPET = """
import torch, torchpass_p2p
from torchpass_p2p.trainer import Trainer
agent = torchpass_p2p.start()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
trainer = Trainer(model, optimizer, agent=agent, seed=0)
def loss_fn(step, rank):
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randn(16, 8, generator=g)
    return ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
trainer.run(loss_fn, steps=40)
"""


def test_a_script_that_never_stops_its_agent_exits_cleanly(tmp_path):
    # The README's training snippet ends without agent.stop(): the process exits with its pulse
    # responder still answering. libcrypto frees its state at exit(); a ping answered after
    # that crashed the process (SIGSEGV in every run of 2 ranks, before the responders were
    # stopped at exit).
    script = tmp_path / "train.py"
    script.write_text(SNIPPET)
    launcher = start_launcher(["--nproc", "2", "--spares", "1", "--grace", "3", str(script)],
                              env=clean_environ() | {"PYTHONPATH": str(REPO)})
    code, out = finish(launcher, 120)
    assert "SIGSEGV" not in out, out
    assert re.findall(r"rank (\d) \(\w+\) exited with (\S+)", out) in (
        [("0", "0"), ("1", "0")], [("1", "0"), ("0", "0")]), out
    assert code == 0, out
