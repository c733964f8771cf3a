"""The main job: a training script under ``torchpass-p2p launch``, once without faults and once
with two, then a report.

By default the script is ``examples/torchpass_ddp.py``, an ordinary torchrun DDP script adopted
by torchpass_p2p (``docs/training.md``): 3 epochs of 32 steps, four ranks and two spares (one
per fault). Faults (``--faults``, see :mod:`torchpass_p2p.trainer.faults`), by default: SIGKILL
of rank 1 in the middle of step 40 (epoch 1, its peers already inside the gradient reduction),
and later a SIGSTOP of rank 2 at step 75 before the commit vote, held 8 s (past the 5 s lease),
then SIGCONT. ``--job char_lm`` runs the character-level language model of
``examples/char_lm.py`` instead, a script of the same API with its own step loop (120 steps;
faults at steps 37 and 80).

Prints the loss, one recovery timeline per fault (seconds after the fault: detected, decided,
state transferred, group rebuilt, training resumed), steps lost, and whether every rank's final
state (weights, optimizer, scheduler, scaler, data position: the state fingerprint) is bitwise
equal to the fault-free run. Exit status 1 if it differs, a step was lost or a run failed.

``python -m examples.main_job [--job ddp|char_lm] [--epochs N] [--steps N] [--faults SPEC]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchpass_p2p.agent.lifeline import STACKS_SIGNAL
from torchpass_p2p.launch.children import children_of
from torchpass_p2p.launch.keyfile import remove_run_dir
from torchpass_p2p.trainer.timeline import FaultTimeline, final_states, read_events, recoveries

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "char_lm.py"
DEFAULT_FAULTS = "kill@37:grad:rank=1,stop@80:commit:rank=2:8"
DDP_SCRIPT = REPO / "examples" / "torchpass_ddp.py"
DDP_FAULTS = "kill@40:grad:rank=1,stop@75:commit:rank=2:8"


KILLED_MARK = "\n[main_job] past its deadline: stacks of every child, then SIGKILL\n"
STACKS_WAIT_S = 0.5
"""Between two children's stack dumps, so they do not interleave (each takes milliseconds)."""
READER_TIMEOUT_S = 10.0


@dataclass
class Run:
    """One launch: its exit code, seconds, final states by rank, timeline and output."""

    code: int
    seconds: float
    finals: list[dict[str, Any]]
    events: list[dict[str, Any]]
    output: str

    def diagnosis(self, chars: int = 3000) -> str:
        """What to show when the run failed: the output's last ``chars`` characters, or after
        a launch killed at its deadline, the launcher's lines naming each child's pid, the
        last ``chars`` characters written before it (who exited and how, tracebacks), the
        children's stack dumps and each member's last timeline event."""
        if KILLED_MARK not in self.output:
            return self.output[-chars:]
        last: dict[str, dict[str, Any]] = {}
        for record in self.events:
            last[record["member"]] = record
        before, mark, stacks = self.output.partition(KILLED_MARK)
        tail = before[-chars:]
        started = [line for line in before.splitlines() if "] started " in line]
        head = "".join(f"{line}\n" for line in started if line not in tail)
        return (head + ("...\n" if head else "") + tail + mark + stacks
                + "last timeline event of each member:\n"
                + "".join(f"  {r}\n" for r in sorted(last.values(), key=lambda r: r["t"])))


def run_job(work: Path, *, nproc: int, spares: int, steps: int, faults: str = "",
            script_args: tuple[str, ...] = (), timeout_s: float = 600.0,
            launch_args: tuple[str, ...] = (), settings: dict[str, str] | None = None) -> Run:
    """Launch ``char_lm.py`` in ``work`` (``out/`` and ``logs/`` are created there;
    ``launch_args``: more launcher options, e.g. ``--respawn``; ``settings``: agent settings
    by environment variable, e.g. ``{"TORCHPASS_POLICY": "stop"}``). A launch
    still running after ``timeout_s`` seconds is killed (code -9) after its children printed
    their stacks into ``output`` (:meth:`Run.diagnosis`).

    Each final state (``final-<member>.json``: rank, steps, weights digest, losses) gets the
    ``fingerprint`` of the whole state its member held at the end (model, optimizer,
    scheduler, data position, tracked objects) from that member's ``finished`` record, or
    None if it logged none."""
    return launch(work, SCRIPT, ("--out", str(work / "out"), "--log-dir", str(work / "logs"),
                                 "--steps", str(steps), *script_args),
                  nproc=nproc, spares=spares, faults=faults, timeout_s=timeout_s,
                  launch_args=launch_args, settings=settings)


def launch(work: Path, script: Path, script_args: tuple[str, ...], *, nproc: int, spares: int,
           faults: str = "", timeout_s: float = 600.0, launch_args: tuple[str, ...] = (),
           settings: dict[str, str] | None = None) -> Run:
    """Launch ``script`` under ``torchpass-p2p launch`` in ``work``: its members' timelines go
    to ``work/logs`` (``TORCHPASS_LOG_DIR``), ``final-*.json`` files it writes to
    ``work/out`` are read back, each with its member's ``fingerprint`` from the timelines.
    Otherwise as :func:`run_job`."""
    (work / "logs").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHPASS_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["TORCHPASS_LOG_DIR"] = str(work / "logs")
    if faults:
        env["TORCHPASS_FAULTS"] = faults
    env.update(settings or {})
    cmd = [sys.executable, "-m", "torchpass_p2p.cli.main", "launch", "--nproc", str(nproc),
           "--spares", str(spares), "--grace", "3", *launch_args, str(script), *script_args]
    t0 = time.monotonic()
    chunks: list[bytes] = []
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        reader = threading.Thread(target=_read_all, args=(proc.stdout, chunks), daemon=True)
        reader.start()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _stacks_then_kill(proc, chunks)
        reader.join(READER_TIMEOUT_S)  # EOF once the children are gone too
    events = read_events(work / "logs")
    finals = final_states(work / "out")
    # Each final state gets the fingerprint its member logged as it finished (None if none).
    prints = {r["member"]: r["fingerprint"] for r in events if r["event"] == "finished"}
    for final in finals:
        final["fingerprint"] = prints.get(final["member"])
    return Run(proc.returncode, time.monotonic() - t0, finals, events,
               b"".join(chunks).decode(errors="replace"))


def _read_all(stream: io.BufferedReader, chunks: list[bytes]) -> None:
    # A Popen pipe is buffered by default: it has read1 (Popen.stdout's IO[bytes] has not).
    while data := stream.read1(1 << 16):
        chunks.append(data)


def _stacks_then_kill(proc: subprocess.Popen[bytes], chunks: list[bytes]) -> None:
    """A launch past its deadline: each child in turn prints its threads' stacks (into the
    launcher's output: :mod:`torchpass_p2p.agent.lifeline`) under a line naming its pid; then
    the launcher is SIGKILLed, which takes its children with it, and its run directory is
    removed."""
    chunks.append(KILLED_MARK.encode())
    for pid in children_of(proc.pid):
        chunks.append(f"--- stacks of pid {pid} ---\n".encode())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACKS_SIGNAL)
        time.sleep(STACKS_WAIT_S)
    proc.kill()
    proc.wait()
    # A killed launcher cannot remove its run directory (the cluster key is in it).
    output = b"".join(chunks).decode(errors="replace")
    if found := re.search(r" in (\S+)/configuration-0\.json", output):
        remove_run_dir(found.group(1))


def loss_curve(finals: list[dict[str, Any]], points: int = 8, rank: int = 0) -> str:
    """``points`` steps of the loss of rank ``rank``'s batches: merged over the finals of
    that rank, as a spare that took the rank logged only the steps after it joined (a member
    that died wrote none: its steps are missing)."""
    by_step = {int(k): v for final in finals if final["rank"] == rank
               for k, v in final["losses"].items()}
    if not by_step:
        return "(none)"
    steps = sorted(by_step)
    n = len(steps)
    marks = sorted({round(i * (n - 1) / (points - 1)) for i in range(points)})
    return "  ".join(f"step {steps[i]}: {by_step[steps[i]]:.3f}" for i in marks)


def _s(v: float | None) -> str:
    return "   -  " if v is None else f"{v:6.2f}"


def timeline_lines(faulty: Run) -> tuple[list[str], list[FaultTimeline]]:
    """The recovery timeline's lines, one per fault, and the timelines."""
    timelines: list[FaultTimeline] = recoveries(faulty.events)
    lines = ["recovery timeline, seconds after the fault:",
             "  fault                      config  detected  decided  transferred  "
             "rebuilt  resumed  resume_step  rule          steps_lost"]
    for f in timelines:
        lines.append(f"  {f.kind:4} rank {f.rank} step {f.step:3} {f.point:7}  {f.config_id!s:>5}"
                     f"    {_s(f.detected_s)}   {_s(f.decided_s)}    {_s(f.transferred_s)}"
                     f"     {_s(f.rebuilt_s)}   {_s(f.resumed_s)}   {f.resume_step!s:>5}"
                     f"      {','.join(f.action):12}  {f.steps_lost}")
    return lines, timelines


def report(clean: Run, faulty: Run, steps: int) -> tuple[list[str], bool]:
    """The report's lines for ``char_lm``, and whether everything held."""
    lines, ok = [], True
    for name, run in (("fault-free", clean), ("with faults", faulty)):
        lines.append(f"{name}: launcher exit {run.code}, {run.seconds:.1f} s, "
                     f"{len(run.finals)} ranks finished")
        ok &= run.code == 0 and len(run.finals) > 0
    if clean.finals:
        lines.append("loss of rank 0's batches (fault-free): " + loss_curve(clean.finals))
    if faulty.finals:
        lines.append("loss of rank 0's batches (with faults): " + loss_curve(faulty.finals))
    more, timelines = timeline_lines(faulty)
    lines += more
    lost = sum(f.steps_lost for f in timelines)
    finished_all = all(r["steps"] == steps for r in clean.finals + faulty.finals)
    lines.append(f"steps lost: {lost}; every rank finished {steps} steps: {finished_all}")
    ok &= lost == 0 and finished_all and len(timelines) > 0
    ok &= all(f.resumed_s is not None for f in timelines)
    prints = {r["fingerprint"] for r in clean.finals} | {r["fingerprint"] for r in faulty.finals}
    weights = ({r["weights_sha256"] for r in clean.finals}
               | {r["weights_sha256"] for r in faulty.finals})
    equal = (len(prints) == 1 and None not in prints and len(weights) == 1
             and bool(clean.finals) and bool(faulty.finals))
    lines.append("final state (model, optimizer, scheduler, data position) bitwise equal to "
                 f"the fault-free run on every rank: {equal} "
                 f"(fingerprints {sorted(str(p)[:16] for p in prints)}, weights sha256 "
                 f"{sorted(w[:16] for w in weights)})")
    ok &= equal
    return lines, ok


def report_ddp(clean: Run, faulty: Run, nproc: int) -> tuple[list[str], bool]:
    """The report's lines for the adopted DDP script, and whether everything held: the
    members' ``finished`` events carry the step count and the fingerprint of the whole
    tracked state."""
    lines, ok = [], True
    finished = {}
    for name, run in (("fault-free", clean), ("with faults", faulty)):
        done = [r for r in run.events if r["event"] == "finished"]
        finished[name] = done
        lines.append(f"{name}: launcher exit {run.code}, {run.seconds:.1f} s, "
                     f"{len(done)} ranks finished")
        ok &= run.code == 0 and len(done) == nproc
        losses = [line for line in run.output.splitlines() if line.startswith("rank 0 epoch")]
        lines += [f"  {line}" for line in losses]
    more, timelines = timeline_lines(faulty)
    lines += more
    lost = sum(f.steps_lost for f in timelines)
    steps = {r["step"] for done in finished.values() for r in done}
    lines.append(f"steps lost: {lost}; every rank finished at step {sorted(steps)}")
    ok &= lost == 0 and len(steps) == 1 and len(timelines) > 0
    ok &= all(f.resumed_s is not None for f in timelines)
    prints = {r["fingerprint"] for done in finished.values() for r in done}
    equal = len(prints) == 1 and all(finished.values())
    lines.append("final state (model, optimizer, scheduler, scaler, data position) bitwise "
                 f"equal to the fault-free run on every rank: {equal} (fingerprints "
                 f"{sorted(p[:16] for p in prints)})")
    ok &= equal
    return lines, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", choices=("ddp", "char_lm"), default="ddp",
                    help="the adopted DDP script (default) or the character-level LM")
    ap.add_argument("--epochs", type=int, default=3, help="epochs of the DDP script")
    ap.add_argument("--device", default="cpu",
                    help="the DDP script's device: cpu, or cuda (every process shares it)")
    ap.add_argument("--steps", type=int, default=120, help="training steps of char_lm")
    ap.add_argument("--nproc", type=int, default=4, help="ranks")
    ap.add_argument("--spares", type=int, default=2, help="hot spares (one per fault)")
    ap.add_argument("--faults", help="KIND@STEP:POINT:rank=R[:N],... with KIND kill, stop, "
                    "orphan or reset and POINT compute, grad, commit, enter or serve (the "
                    f"spec: torchpass_p2p/trainer/faults.py); default: {DDP_FAULTS!r} "
                    f"(char_lm: {DEFAULT_FAULTS!r})")
    ap.add_argument("--keep", help="directory to keep the runs' logs in")
    ap.add_argument("--state-transport", choices=("auto", "tcp", "pg"), default="auto",
                    help="how the spares get the state (char_lm)")
    ap.add_argument("--pulse", choices=("on", "off"), default="on",
                    help="the agents' pulse responders and probers (TORCHPASS_PULSE; the "
                         "launched processes see no other TORCHPASS_* variable of yours)")
    args = ap.parse_args()
    settings = {"TORCHPASS_PULSE": args.pulse}
    faults = args.faults or (DDP_FAULTS if args.job == "ddp" else DEFAULT_FAULTS)
    with tempfile.TemporaryDirectory(prefix="torchpass-main-job-") as tmp:
        work = Path(args.keep or tmp)
        runs = []
        for name, spec in (("fault-free run", ""), (f"run with faults {faults!r}", faults)):
            print(f"{name}: {args.nproc} ranks + {args.spares} spares", flush=True)
            if args.job == "ddp":
                where = work / ("faults" if spec else "clean")
                runs.append(launch(where, DDP_SCRIPT, (
                    "--epochs", str(args.epochs), "--snapshot", str(where / "snapshot.pt"),
                    "--device", args.device),
                    nproc=args.nproc, spares=args.spares, faults=spec, settings=settings))
            else:
                runs.append(run_job(work / ("faults" if spec else "clean"), nproc=args.nproc,
                                    spares=args.spares, steps=args.steps, faults=spec,
                                    script_args=("--state-transport", args.state_transport),
                                    settings=settings))
        clean, faulty = runs
        lines, ok = (report_ddp(clean, faulty, args.nproc) if args.job == "ddp"
                     else report(clean, faulty, args.steps))
        print("\n".join(lines))
        if not ok:
            for name, run in (("fault-free", clean), ("with faults", faulty)):
                print(f"--- {name} launcher output (last 40 lines) ---")
                print("\n".join(run.output.splitlines()[-40:]))
        print("RESULT:", "OK" if ok else "FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
