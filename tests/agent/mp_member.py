"""A member process for the multi-process tests: an agent plus a stand-in training loop.

Started by ``torchpass-p2p launch`` (the environment names the member). It "trains" one step
every ``MP_STEP_S`` seconds while it holds a rank and is not fenced, reports each committed step
to its agent and appends one JSON line per step and per role change to
``$MP_LOG_DIR/<member id>.jsonl``. Knobs (environment):

* ``MP_STEPS``: exit 0 after this many steps (default 1000).
* ``MP_UNSHARE_RANK``: the rank that moves into an empty network namespace before starting
  (its sends fail with ENETUNREACH: scenario S07).
* ``MP_GIL_BURSTS``: ``min,max,duty``: a thread holds the GIL for ``min..max`` seconds at a time,
  about ``duty`` of the time (scenario S01).
* ``MP_WRAP``: run the member as a subprocess of this one, as a wrapper script would: ``close``
  (``subprocess``'s default: the sockets the launcher handed over are closed in the member,
  though the environment still names them) or ``pass`` (``close_fds=False``).
A removed member exits with code 3: it may only come back as a new spare.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import subprocess
import sys
import threading
import time

import torchpass_p2p

CLONE_NEWNET = 0x40000000
REMOVED_EXIT = 3


def log(path: str, **record) -> None:
    record["t"] = time.time()
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def hold_gil_in_bursts(low: float, high: float, duty: float, seed: int) -> None:
    rng = random.Random(seed)
    while True:
        burst = rng.uniform(low, high)
        time.sleep(burst * (1 - duty) / duty)
        # A long switch interval lets this thread keep the GIL for the whole burst, as a
        # C extension that never releases it would.
        sys.setswitchinterval(burst)
        end = time.perf_counter() + burst
        while time.perf_counter() < end:
            pass
        sys.setswitchinterval(0.005)


def main() -> int:
    if wrap := os.environ.pop("MP_WRAP", None):
        return subprocess.run([sys.executable, __file__], close_fds=wrap == "close",
                              check=False).returncode
    rank = os.environ.get("RANK")
    if rank is not None and os.environ.get("MP_UNSHARE_RANK") == rank:
        if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
        # The sockets the launcher bound live in the old namespace and would still work:
        # close them, so that the agent binds its own in the empty one.
        for name in ("TORCHPASS_BIND_FDS", "TORCHPASS_STATUS_FD"):
            for fd in os.environ.pop(name).split(","):
                os.close(int(fd))
    path = os.path.join(os.environ["MP_LOG_DIR"], os.environ["TORCHPASS_MEMBER_ID"] + ".jsonl")
    bursts = os.environ.get("MP_GIL_BURSTS")
    agent = torchpass_p2p.start()
    log(path, event="started", role=agent.role, rank=agent.rank, status=agent.status_address,
        address=agent.address, members=len(agent.configuration.members),
        env={k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                             "LOCAL_WORLD_SIZE")})
    if bursts:
        low, high, duty = (float(x) for x in bursts.split(","))
        threading.Thread(target=hold_gil_in_bursts, args=(low, high, duty, agent.member_id),
                         daemon=True).start()
    steps, step_s = int(os.environ.get("MP_STEPS", "1000")), float(os.environ.get("MP_STEP_S",
                                                                                  "0.1"))
    step, role, fenced = 0, agent.role, False
    counters_at = time.monotonic() + 2.0
    while step < steps:
        if time.monotonic() >= counters_at:  # what the agent saw, for the tests to check
            counters_at = time.monotonic() + 2.0
            c = agent.status()["counters"]
            log(path, event="counters", stalls=c.get("stalls", 0),
                alerts=c.get("alerts_raised", 0), refuted=c.get("refutations", 0),
                silences=c.get("silences_reported", 0),
                answered=c.get("pulse_responder_answered", 0))
        if agent.role != role:
            role = agent.role
            log(path, event="role", role=role, rank=agent.rank, config_id=agent.config_id)
        if role == "removed":
            agent.stop(leave=False)
            return REMOVED_EXIT
        if agent.fenced != fenced:
            fenced = agent.fenced
            log(path, event="fenced" if fenced else "unfenced", config_id=agent.config_id)
        if role != "rank" or fenced:
            time.sleep(0.02)
            continue
        time.sleep(step_s)
        if agent.fenced:  # checked again at the commit point, as the trainer does
            continue
        step += 1
        agent.report_progress(step)
        log(path, event="step", step=step, config_id=agent.config_id, rank=agent.rank)
    log(path, event="done", step=step)
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
