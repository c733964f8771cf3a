"""``srun torchpass-p2p launch`` on a real Slurm cluster: two virtual nodes on this host
(:class:`tests.launch.slurm_cluster.SlurmCluster`), one launcher per node.

Must hold: each launcher takes ``--nodes`` (each node's NodeAddr), ``--node-rank``
(``SLURM_NODEID``) and ``--run-id`` (``slurm-<job>.<step>``) from the step's environment and
says so; a step with two tasks on a node is refused; and ``examples/slurm.sbatch`` running the
adopted DDP script (through ``srun``), with rank 1 (on the second node) SIGKILLed inside step
8's gradient reduction, finishes every step and ends with the model, optimizer, scheduler,
scaler and data position of a fault-free run on one host, bit for bit, its own snapshot too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from examples.main_job import Run, launch
from tests.ddp.states import bitwise_equal, events, flat
from tests.launch.procs import REPO, clean_environ, free_ports_block
from tests.launch.slurm_cluster import SlurmCluster, slurm_or_skip
from torchpass_p2p.launch.keyfile import write_key_file
from torchpass_p2p.launch.slurm import place
from torchpass_p2p.trainer.timeline import read_events

SCRIPT = REPO / "examples" / "torchpass_ddp.py"
SBATCH = REPO / "examples" / "slurm.sbatch"
SCRIPT_ARGS = ("--epochs", "1", "--samples", "1024")  # 2 ranks, batches of 32: 16 steps
STEPS = 16
FAULT = "kill@8:grad:rank=1"
RUN_TIMEOUT_S = 150.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    slurm_or_skip()
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2) as running:
        yield running


def srun(cluster: SlurmCluster, args: list[str], env: dict[str, str],
         timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, str, float]:
    """``srun ARGS`` from the repository root: exit code, output, seconds. Past ``timeout_s``
    srun is killed (the cluster's teardown cancels the job) and the test fails."""
    t0 = time.monotonic()
    try:
        done = subprocess.run(["srun", *args], cwd=REPO, env=cluster.env(env),
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else ""
        raise AssertionError(f"srun did not finish in {timeout_s} s:\n{out[-4000:]}\n"
                             f"{cluster.logs()}") from None
    return done.returncode, done.stdout + done.stderr, time.monotonic() - t0


@pytest.mark.timeout(900)  # the first test may install Slurm (CI)
def test_each_task_of_a_step_is_placed_from_its_environment(cluster: SlurmCluster,
                                                           tmp_path: Path) -> None:
    dump = ("import json, os, sys; "
            "json.dump(dict(os.environ), open(sys.argv[1] + os.environ['SLURM_NODEID'], 'w'))")
    code, out, _ = srun(cluster, ["--nodes=2", "--ntasks-per-node=1", sys.executable, "-c",
                                  dump, str(tmp_path / "env-")], clean_environ(), timeout_s=60)
    assert code == 0, out
    environs = {n: json.loads((tmp_path / f"env-{n}").read_text()) for n in (0, 1)}
    job = environs[0]["SLURM_JOB_ID"]
    for task, environ in environs.items():
        placed = place(environ)
        assert placed.nodes == tuple(cluster.addresses)
        assert placed.node_rank == task and environ["SLURMD_NODENAME"] == cluster.names[task]
        assert placed.run_id == f"slurm-{job}.0"
        # Explicit options win; the node rank still comes from Slurm.
        mine = place(environ, nodes=("10.0.0.1", "10.0.0.2"), run_id="mine")
        assert (mine.nodes, mine.node_rank, mine.run_id) == (("10.0.0.1", "10.0.0.2"), task,
                                                             "mine")
        assert mine.sources == (f"--node-rank {task} (SLURM_NODEID)",)


def test_two_launchers_on_one_node_are_refused(cluster: SlurmCluster, tmp_path: Path) -> None:
    key = tmp_path / "key"
    write_key_file(key)
    code, out, _ = srun(cluster, ["--nodes=2", "--ntasks-per-node=2", sys.executable, "-m",
                                  "torchpass_p2p.cli.main", "launch", "--base-port", "20000",
                                  "--key-file", str(key), str(SCRIPT)],
                        clean_environ() | {"PYTHONPATH": str(REPO)}, timeout_s=60)
    assert code == 2, out  # srun's code: its tasks' highest
    lines = [x for x in out.splitlines() if "error:" in x and "one launcher per node" in x]
    assert len(lines) == 4 and all("4 tasks on 2 nodes" in x for x in lines), out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_sbatch_example_with_a_killed_rank_ends_bitwise_like_a_fault_free_run(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    work = tmp_path / "slurm"
    (work / "logs").mkdir(parents=True)
    (work / "bin").mkdir()
    shim = work / "bin" / "torchpass-p2p"  # the command an installed package puts on PATH
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m torchpass_p2p.cli.main "$@"\n')
    shim.chmod(0o755)
    snapshot = work / "snapshot.pt"
    base = free_ports_block(2, cluster.addresses)  # a rank and a spare on each node
    env = clean_environ() | {
        "PATH": f"{work / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
        "NPROC": "1", "SPARES": "1", "BASE_PORT": str(base),
        "TORCHPASS_LOG_DIR": str(work / "logs"), "TORCHPASS_FAULTS": FAULT}
    t0 = time.monotonic()
    job = subprocess.run(
        ["sbatch", "--parsable", f"--output={work / 'job.out'}", str(SBATCH), str(SCRIPT),
         *SCRIPT_ARGS, "--snapshot", str(snapshot)],
        cwd=work, env=cluster.env(env), capture_output=True, text=True, timeout=60, check=True)
    state, code = cluster.wait(job.stdout.strip().split(";")[0], RUN_TIMEOUT_S)
    out = (work / "job.out").read_text(errors="replace") if (work / "job.out").exists() else ""
    faulty = Run(code, time.monotonic() - t0, [], read_events(work / "logs"), out)
    assert (state, code) == ("COMPLETED", 0), f"{out[-4000:]}\n{cluster.logs()}"
    assert not list(work.glob(".torchpass-*.key"))  # the job's key is gone with it

    # Each launcher said what it took from Slurm, and ran its node's part.
    placed = [x for x in out.splitlines() if "from Slurm:" in x]
    assert len(placed) == 2
    assert all(f"--nodes {','.join(cluster.addresses)} (SLURM_STEP_NODELIST=" in x
               for x in placed)
    assert sorted(x.split("--node-rank ")[1][0] for x in placed) == ["0", "1"]
    [run_id] = {x.split("--run-id ")[1].split()[0] for x in placed}
    assert re.fullmatch(r"slurm-\d+\.0", run_id)

    # The fault fired in rank 1 on the second node, and every step was committed once.
    assert [(r["kind"], r["step"], r["rank"]) for r in events(faulty, "fault")] == [
        ("kill", 8, 1)]
    by_member: dict[str, list[int]] = {}
    for r in events(faulty, "step"):
        by_member.setdefault(r["member"], []).append(r["step"])
    assert all(steps == sorted(set(steps)) for steps in by_member.values())
    assert set().union(*map(set, by_member.values())) == set(range(STEPS))

    # The same final state as a fault-free run of two ranks on one host, bit for bit.
    free_snapshot = tmp_path / "free" / "snapshot.pt"
    free = launch(tmp_path / "free", SCRIPT, (*SCRIPT_ARGS, "--snapshot", str(free_snapshot)),
                  nproc=2, spares=0, timeout_s=RUN_TIMEOUT_S)
    assert free.code == 0, free.diagnosis()
    [reference] = {r["fingerprint"] for r in events(free, "finished")}
    finished = events(faulty, "finished")
    assert len(finished) == 2 and {r["step"] for r in finished} == {STEPS}
    assert {r["fingerprint"] for r in finished} == {reference}
    mine, theirs = flat(torch.load(snapshot)), flat(torch.load(free_snapshot))
    assert mine.keys() == theirs.keys() and len(mine) > 20
    assert all(bitwise_equal(mine[k], theirs[k]) for k in mine)
