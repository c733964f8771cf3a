"""Placing a launcher from Slurm's environment (:mod:`torchpass_p2p.launch.slurm`) without a
cluster: the host list parser (checked against ``scontrol show hostnames`` where Slurm's
clients are installed), the step's variables, and which options win."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.launch.slurm_cluster import slurm_or_skip
from torchpass_p2p.launch.slurm import (
    SlurmError,
    expand_hostlist,
    place,
    read_step,
    resolve_address,
)

LISTS = {
    "n1": ["n1"],
    "n[1-3]": ["n1", "n2", "n3"],
    "gpu[08-11,3]": ["gpu08", "gpu09", "gpu10", "gpu11", "gpu3"],
    "a[1-2],login,b[7]": ["a1", "a2", "login", "b7"],
    "r[1-2]n[01-02]": ["r1n01", "r1n02", "r2n01", "r2n02"],
    "rack[1-2]-b[3-4]": ["rack1-b3", "rack1-b4", "rack2-b3", "rack2-b4"],
    "a[1-2],,b": ["a1", "a2", "b"],
    "node[0099-0101]": ["node0099", "node0100", "node0101"],
}


@pytest.mark.parametrize(("text", "names"), sorted(LISTS.items()))
def test_a_host_list_expands_in_slurms_order(text, names):
    assert expand_hostlist(text) == names


@pytest.fixture
def scontrol() -> str:
    """Slurm's ``scontrol``: installed in CI as the Slurm job test does (a collection-time
    skip would read the host before that test installed it, and never run here)."""
    slurm_or_skip()
    path = shutil.which("scontrol")
    assert path is not None
    return path


@pytest.mark.parametrize("text", sorted(LISTS))
def test_the_parser_agrees_with_scontrol(text, tmp_path, scontrol):
    conf = tmp_path / "slurm.conf"  # scontrol reads one before it expands anything
    conf.write_text("ClusterName=test\nSlurmctldHost=nowhere\n")
    done = subprocess.run([scontrol, "show", "hostnames", text], capture_output=True,
                          text=True, check=True, timeout=30, env={"SLURM_CONF": str(conf)})
    assert done.stderr == "" and expand_hostlist(text) == done.stdout.split()


@pytest.mark.parametrize("text", ["a[1-2", "a]1", "a[[1]]", "a[]", "a[3-1]", "a[x]",
                                  "a[1-]"])
def test_a_malformed_host_list_is_refused(text):
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(text)


def step_env(nodelist="127.0.0.[1-2]", nodes=2, node_id=1, tasks=2, **more):
    env = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3", "SLURM_STEP_NODELIST": nodelist,
           "SLURM_JOB_NODELIST": "127.0.0.[1-4]", "SLURM_STEP_NUM_NODES": str(nodes),
           "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": str(node_id),
           "SLURM_STEP_NUM_TASKS": str(tasks)}
    return env | more


def test_outside_slurm_nothing_is_filled():
    assert read_step({}) is None
    placed = place({"PATH": "/bin"}, run_id=None)
    assert (placed.nodes, placed.node_rank, placed.run_id, placed.sources) == ((), 0, "", ())


def test_a_step_over_two_nodes_fills_every_option_and_says_so():
    placed = place(step_env(), scontrol="")
    assert placed.nodes == ("127.0.0.1", "127.0.0.2")
    assert placed.node_rank == 1 and placed.run_id == "slurm-42.3"
    assert placed.sources == (
        "--run-id slurm-42.3 (SLURM_JOB_ID, SLURM_STEP_ID)",
        "--nodes 127.0.0.1,127.0.0.2 (SLURM_STEP_NODELIST=127.0.0.[1-2]; node names resolved)",
        "--node-rank 1 (SLURM_NODEID; node 127.0.0.2)")


def test_explicit_options_win():
    placed = place(step_env(), nodes=("10.1.0.1", "10.1.0.2"), node_rank=0, run_id="mine",
                   scontrol="")
    assert (placed.nodes, placed.node_rank, placed.run_id, placed.sources) == (
        ("10.1.0.1", "10.1.0.2"), 0, "mine", ())
    placed = place(step_env(), run_id="mine", scontrol="")
    assert placed.run_id == "mine" and placed.node_rank == 1
    assert [s.split()[0] for s in placed.sources] == ["--nodes", "--node-rank"]


def test_a_step_of_one_node_launches_as_on_one_host():
    placed = place(step_env("127.0.0.1", nodes=1, node_id=0, tasks=1), scontrol="")
    assert (placed.nodes, placed.node_rank, placed.run_id) == ((), 0, "slurm-42.3")


def test_the_job_list_serves_when_the_step_has_none():
    env = step_env()
    del env["SLURM_STEP_NODELIST"], env["SLURM_STEP_NUM_NODES"], env["SLURM_NNODES"]
    env["SLURM_STEP_NUM_TASKS"] = "4"
    step = read_step(env)
    assert step is not None and step.nodelist_from == "SLURM_JOB_NODELIST"
    assert place(env, scontrol="").nodes == tuple(f"127.0.0.{i}" for i in range(1, 5))


@pytest.mark.parametrize(("env", "message"), [
    ({"SLURM_STEP_NUM_TASKS": "4"}, "4 tasks on 2 nodes"),
    ({"SLURM_STEP_NUM_NODES": "3"}, "names 2 nodes, Slurm says 3"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 outside"),
    ({"SLURM_NODEID": "x"}, "not a number"),
    ({"SLURM_STEP_NODELIST": "127.0.0.[1-2],127.0.0.1", "SLURM_STEP_NUM_NODES": "3",
      "SLURM_STEP_NUM_TASKS": "3"}, "names a node twice"),
    ({"SLURM_STEP_NODELIST": "127.0.0.[1-"}, "unbalanced"),
])
def test_an_inconsistent_step_is_refused(env, message):
    with pytest.raises(SlurmError, match=message):
        place(step_env() | env, scontrol="")


def test_the_batch_script_of_a_multi_node_job_is_told_to_use_srun():
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "127.0.0.[1-2]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0"}
    with pytest.raises(SlurmError, match="srun --ntasks-per-node=1"):
        place(env, scontrol="")
    assert place(env, nodes=("127.0.0.1", "127.0.0.2"), scontrol="").run_id == "slurm-42"


def test_a_node_name_that_resolves_to_loopback_is_refused():
    # "localhost" stands for a host whose own name /etc/hosts maps to 127.0.1.1: the other
    # hosts would put another address for it in configuration 0.
    with pytest.raises(SlurmError, match="loopback"):
        place(step_env("localhost,127.0.0.2", node_id=0), scontrol="")


def test_addresses_are_resolved_to_ip_literals():
    assert resolve_address("127.0.0.3") == "127.0.0.3"
    assert resolve_address("::1") == "::1"
    assert resolve_address("localhost") in ("127.0.0.1", "::1")
    with pytest.raises(SlurmError, match="node no-such-host.invalid"):
        resolve_address("no-such-host.invalid")


def test_a_list_scontrol_calls_invalid_is_refused_though_it_exits_0(tmp_path, scontrol):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=test\nSlurmctldHost=nowhere\n")
    env = step_env("x[1-2]y") | {"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"}
    with pytest.raises(SlurmError, match="Invalid hostlist: x"):
        place(env, scontrol=scontrol)
