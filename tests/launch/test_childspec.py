"""Pure parts of the launcher: plan, outcome, key file and ports."""

from __future__ import annotations

import itertools
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from torchpass_p2p.core.messages import Topology
from torchpass_p2p.launch.childspec import (
    ChildSpec,
    RunContext,
    child_environment,
    configuration_zero,
    format_address,
    initial_children,
    new_member_ids,
    parse_topology,
)
from torchpass_p2p.launch.keyfile import (
    KeyFileError,
    make_run_dir,
    read_primary_key,
    remove_run_dir,
    sweep_run_dirs,
    write_key_file,
)
from torchpass_p2p.launch.outcome import (
    EXIT_DRAINED,
    EXIT_KEY_REFUSED,
    EXIT_REMOVED,
    EXIT_STOPPED,
    ChildExit,
    Verdict,
    decide,
    describe_exit,
    exit_code,
    is_error,
    is_failure,
    no_majority_left,
    script_failed,
)
from torchpass_p2p.launch.ports import reserve_ports

RUN = RunContext("c", "/run/key", "/run", Topology("h", "d"), 2, configuration="/run/c0.json")


def children() -> list[ChildSpec]:
    return initial_children([10, 11, 12], "10.0.0.5", [100, 101, 102], [200, 201, 202], 2)


def test_process_i_holds_rank_i_then_spares_follow() -> None:
    specs = children()
    assert [(c.role, c.rank) for c in specs] == [("rank", 0), ("rank", 1), ("spare", None)]
    config = configuration_zero(specs, Topology("h", "d"), observers=4)
    assert (config.config_id, config.ranks, config.spares, config.observers) == (0, (10, 11),
                                                                                  (12,), 4)
    assert dict(config.addresses) == {10: ("10.0.0.5", 100), 11: ("10.0.0.5", 101),
                                      12: ("10.0.0.5", 102)}
    assert all(config.topology_of(m) == Topology("h", "d") for m in (10, 11, 12))
    joining = initial_children([1, 2], "h", [1, 2], [3, 4], 2, joining=True)
    assert [(c.role, c.rank) for c in joining] == [("spare", None), ("spare", None)]
    with pytest.raises(ValueError):
        initial_children([1, 2], "h", [1], [3, 4], 1)


def test_member_ids_are_fresh_and_distinct() -> None:
    draws = itertools.chain([5, 5, 7, 9, 9, 11], itertools.count(100))
    assert new_member_ids(3, taken=[7], randbits=lambda _bits: next(draws)) == [5, 9, 11]
    assert len(set(new_member_ids(100))) == 100


def test_environment_of_a_rank_and_of_a_spare() -> None:
    rank, _, spare = children()
    inherited = {"PATH": "/bin", "RANK": "9", "TORCHPASS_KEY": "ab" * 32,
                 "TORCHPASS_SEEDS": "x:1", "TORCHPASS_POLICY": "shrink",
                 "TORCHPASS_BIND_FDS": "3,4", "TORCHPASS_STATUS_FD": "5",
                 "TORCHPASS_STARTED": "000000000000000a@1.0"}
    env = child_environment(rank, RUN, base=inherited)
    assert env == {
        "PATH": "/bin", "TORCHPASS_POLICY": "shrink",
        "TORCHPASS_CLUSTER": "c", "TORCHPASS_KEY_FILE": "/run/key",
        "TORCHPASS_MEMBER_ID": "000000000000000a", "TORCHPASS_BIND": "10.0.0.5:100",
        "TORCHPASS_STATUS": "127.0.0.1:200", "TORCHPASS_TOPOLOGY": "h/d",
        "TORCHPASS_ROLE": "rank", "TORCHPASS_RUN_DIR": "/run",
        "TORCHPASS_CONFIGURATION": "/run/c0.json",
        "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
    }
    env = child_environment(spare, RUN, seeds=[("10.0.0.5", 100), ("::1", 7)], base=inherited,
                            bind_fds=(5, 6), status_fd=7)
    assert env["TORCHPASS_ROLE"] == "spare" and env["TORCHPASS_SEEDS"] == "10.0.0.5:100,[::1]:7"
    assert (env["TORCHPASS_BIND_FDS"], env["TORCHPASS_STATUS_FD"]) == ("5,6", "7")
    assert not {"RANK", "TORCHPASS_CONFIGURATION", "TORCHPASS_KEY"} & set(env)
    env = child_environment(rank, RUN, started={10: 12.5, 12: 13.0})
    assert env["TORCHPASS_STARTED"] == "000000000000000a@12.500,000000000000000c@13.000"
    with pytest.raises(ValueError, match="neither configuration 0 nor seeds"):
        child_environment(spare, RunContext("c", "k", "r", Topology(), 1))


def test_addresses_and_topology_labels() -> None:
    assert format_address(("::1", 5)) == "[::1]:5" and format_address(("a", 5)) == "a:5"
    assert parse_topology("h") == Topology("h") and parse_topology("h/d") == Topology("h", "d")
    for bad in ("", "/d", "x" * 65):
        with pytest.raises(ValueError):
            parse_topology(bad)


def gone(member: int, code: int, *, rank: bool = True, by_launcher: bool = False) -> ChildExit:
    return ChildExit(member, rank, code, by_launcher)


def test_decide() -> None:
    assert decide([], running=3, running_ranks=2, joining=False)[0] is Verdict.RUN
    # Clean: the ranks finish, the idle spare is stopped at once.
    assert decide([gone(1, 0)], running=2, running_ranks=1, joining=False)[0] is Verdict.RUN
    verdict, reason = decide([gone(1, 0), gone(2, 0)], running=1, running_ranks=0,
                             joining=False)
    assert (verdict, reason) == (Verdict.STOP,
                                 "every rank exited 0; 1 process(es) left, started as spare(s)")
    # After a failure any process may hold a rank: wait for an exit 0, then let the rest finish.
    failed = [gone(1, -9)]
    assert decide(failed, running=2, running_ranks=1, joining=False)[0] is Verdict.RUN
    assert decide([*failed, gone(2, 0)], running=1, running_ranks=0,
                  joining=False)[0] is Verdict.FINISH
    assert decide([gone(3, 0, rank=False)], running=2, running_ranks=0,
                  joining=True)[0] is Verdict.FINISH
    assert decide(failed, running=0, running_ranks=0, joining=False)[0] is Verdict.DONE
    # A spare that exits 0 held a rank: one started as a rank (paused past its lease and
    # replaced, no exit seen) may hold none, so the rest get the grace instead of being waited
    # for as ranks.
    verdict, reason = decide([gone(1, 0), gone(3, 0, rank=False)], running=1,
                             running_ranks=1, joining=False)
    assert (verdict, reason) == (Verdict.FINISH, "0000000000000001 exited 0: job complete; 1 "
                                                 "process(es) may still be finishing")


def test_failures_are_what_the_launcher_reports() -> None:
    assert [is_failure(c) for c in (0, EXIT_DRAINED, EXIT_STOPPED, EXIT_REMOVED, 1, -9)] == [
        False, False, False, True, True, True]


def test_exit_code() -> None:
    assert exit_code([]) == (1, "no process exited 0")
    assert exit_code([gone(1, 3), gone(2, 0), gone(3, -15, by_launcher=True)])[0] == 0
    assert exit_code([gone(1, 0), gone(2, 1)]) == (
        1, "0000000000000002 exited with 1 after the job completed")
    # A removed member (EXIT_REMOVED) that learns it only after the job completed is no failure.
    assert exit_code([gone(1, 0), gone(2, EXIT_REMOVED)]) == (0, "job complete")
    assert exit_code([gone(1, 0), gone(2, EXIT_DRAINED)]) == (0, "job complete")
    # Finished ranks go silent without leaving: spares that outnumber them may agree on a stop.
    assert exit_code([gone(1, 0), gone(2, EXIT_STOPPED)]) == (0, "job complete")
    # The job stopped because it cannot go on: exit code and reason say so (resume it).
    assert exit_code([gone(1, -9), gone(2, EXIT_STOPPED)]) == (
        EXIT_STOPPED, "a member stopped the job: the agreement left a rank nobody can fill "
        "(every holder of its state is gone, or no spare is left under policy 'stop'), no "
        "majority of its configuration was left for its give-up time, or the ranks' states "
        "diverged (the members' lines say which); the job stops: resume it from its last "
        "checkpoint")
    lost = no_majority_left(0, 1, 3, "reachable")
    assert lost == ("no majority of configuration 0 is left: 1 of its 3 members is reachable "
                    "and a majority is 2")
    assert exit_code([gone(1, -9), gone(2, EXIT_STOPPED)], gave_up=lost) == (
        EXIT_STOPPED, f"{lost}; the job stops: resume it from its last checkpoint")
    assert no_majority_left(4, 2, 5, "exited") == (
        "no majority of configuration 4 is left: 2 of its 5 members exited and a majority is 3")
    assert no_majority_left(4, 2, 5, "reachable").endswith(": 2 of its 5 members are reachable "
                                                           "and a majority is 3")
    assert exit_code([gone(1, 0)], stopped_by=15) == (143, "stopped by SIGTERM")
    # Reaped together after the launcher was stopped: whether the death came before the job
    # completed is unknown, so it is not a failure after completion; reaped later, it is.
    late = ChildExit(2, True, -9, unordered=True)
    assert exit_code([ChildExit(1, True, 0, unordered=True), late]) == (0, "job complete")
    assert exit_code([gone(1, 0), late]) == (
        1, "0000000000000002 exited with signal SIGKILL after the job completed")
    assert describe_exit(-9) == "exited with signal SIGKILL" and describe_exit(2) == "exited with 2"


def test_a_script_failing_on_every_rank_is_reported_as_such_whatever_the_timing() -> None:
    # Every rank crashed on a bug (exit 1) while a spare lived: whether the launcher then found
    # no majority left (and stopped the spare) or the spare went on its own, the outcome is
    # the same: exit 1 naming the first rank that failed, never advice to resume.
    ranks = [ChildExit(i, True, 1, name=f"rank {i - 1} (000000000000000{i})") for i in (1, 2, 3)]
    spare_stopped = ChildExit(4, False, -15, by_launcher=True)
    lost = no_majority_left(0, 3, 4, "exited")
    expected = (1, "the script failed: every rank exited with an error, rank 0 "
                   "(0000000000000001) first (exited with 1): its stderr above shows why; fix "
                   "the script (a resume would fail the same way)")
    assert exit_code([*ranks, spare_stopped], gave_up=lost) == expected
    assert exit_code([*ranks, spare_stopped]) == expected
    assert exit_code([ranks[1], spare_stopped, ranks[0], ranks[2]], gave_up=lost)[1].startswith(
        "the script failed: every rank exited with an error, rank 1 (0000000000000002) first")
    assert exit_code([*ranks, ChildExit(4, False, EXIT_STOPPED)]) == expected
    assert script_failed([*ranks, spare_stopped]) == expected[1]
    # Without a name the member id names the rank.
    assert script_failed([gone(1, 2)]) == (
        "the script failed: every rank exited with an error, 0000000000000001 first (exited "
        "with 2): its stderr above shows why; fix the script (a resume would fail the same way)")


def test_a_job_that_cannot_go_on_is_no_script_failure() -> None:
    lost = no_majority_left(0, 2, 4, "exited")
    # A rank still alive when the launcher stopped it: a majority died, the script may be fine.
    assert exit_code([gone(1, 1), gone(2, 1), gone(3, -15, by_launcher=True),
                      gone(4, -15, rank=False, by_launcher=True)], gave_up=lost) == (
        EXIT_STOPPED, f"{lost}; the job stops: resume it from its last checkpoint")
    # Deaths by a signal are faults, not script errors; nor are the trainer's own codes.
    for code in (-9, EXIT_REMOVED, EXIT_DRAINED, EXIT_STOPPED, EXIT_KEY_REFUSED):
        assert script_failed([gone(1, 1), gone(2, code)]) is None
    assert [is_error(c) for c in (0, 1, 2, 255, -9, EXIT_REMOVED, EXIT_DRAINED, EXIT_STOPPED,
                                  EXIT_KEY_REFUSED)] == [False, True, True, True, False, False,
                                                         False, False, False]
    # Some process finished: a completed job, or a failure after it, as before.
    assert script_failed([gone(1, 1), gone(2, 0)]) is None
    assert exit_code([gone(1, 0), gone(2, 1)])[0] == 1
    # Only spares exited (joining through seeds): no rank failed.
    assert script_failed([gone(1, 1, rank=False)]) is None
    assert exit_code([gone(1, 1, rank=False)]) == (1, "no process exited 0")
    # A rank refused twice at its join: stopped, and no resume advised (it would be refused).
    why = "rank 2 (x) and then spare (y), which replaced it, were refused at their join: ..."
    assert exit_code([gone(3, EXIT_STOPPED), gone(4, EXIT_STOPPED, rank=False),
                      gone(1, -15, by_launcher=True)], mismatch=why) == (EXIT_STOPPED, why)
    assert exit_code([gone(3, EXIT_STOPPED), gone(1, 0)], mismatch=why) == (0, "job complete")


def test_key_file_is_private_and_round_trips(tmp_path: Path) -> None:
    run_dir = make_run_dir()
    try:
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        path = run_dir / "k"
        key = write_key_file(path)
        assert len(key) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text() == key.hex() + "\n" and read_primary_key(path) == key
        with pytest.raises(FileExistsError):
            write_key_file(path)
    finally:
        remove_run_dir(run_dir)
    assert not run_dir.exists()
    ring = tmp_path / "ring"
    ring.write_text(f"# rotated\n\n{'11' * 32}\n{'22' * 32}\n")
    assert read_primary_key(ring) == b"\x11" * 32
    for text, error in (("", "no key"), ("abc\n", "64 hex digits")):
        ring.write_text(text)
        with pytest.raises(KeyFileError, match=error):
            read_primary_key(ring)


KILLED_LAUNCHER = """
import os, signal, sys
from torchpass_p2p.launch.keyfile import make_run_dir, write_key_file
path = make_run_dir(parent=sys.argv[1])
write_key_file(path / "cluster.key")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_launchers_run_dir_is_swept_and_a_live_ones_is_not(tmp_path: Path) -> None:
    live = make_run_dir(parent=tmp_path)
    old = tmp_path / "torchpass-run-old"  # no lock file: an older launcher, perhaps alive
    old.mkdir()
    (tmp_path / "torchpass-run-file").write_text("")  # not a directory
    killed = subprocess.run([sys.executable, "-c", KILLED_LAUNCHER, str(tmp_path)], timeout=60)
    assert killed.returncode == -signal.SIGKILL
    dead = sorted(set(tmp_path.glob("torchpass-run-*")) - {live, old,
                                                            tmp_path / "torchpass-run-file"})
    assert len(dead) == 1 and (dead[0] / "cluster.key").exists()
    try:
        assert sweep_run_dirs(parent=tmp_path) == dead
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [live.name, "torchpass-run-old", "torchpass-run-file"])
        assert (live / "launcher.lock").exists() and sweep_run_dirs(parent=tmp_path) == []
    finally:
        remove_run_dir(live)
    assert sweep_run_dirs(parent=tmp_path) == [] and not live.exists()


def test_reserved_ports_are_distinct_and_held_for_udp_and_tcp_until_closed() -> None:
    held = reserve_ports(8)
    ports = [r.port for r in held]
    assert len(set(ports)) == 8
    for r in held:
        udp, tcp = r.sockets
        assert (udp.type, tcp.type) == (socket.SOCK_DGRAM, socket.SOCK_STREAM)
        assert udp.getsockname()[1] == tcp.getsockname()[1] == r.port
        assert r.fds == (udp.fileno(), tcp.fileno())
        for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
            with socket.socket(socket.AF_INET, kind) as other, pytest.raises(OSError):
                other.bind(("127.0.0.1", r.port))
    for r in held:
        r.close()
    for port in ports:  # released
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u, socket.socket() as t:
            u.bind(("127.0.0.1", port))
            t.bind(("127.0.0.1", port))


def test_reserving_a_given_port_that_is_taken_fails_and_holds_nothing() -> None:
    [taken] = reserve_ports(1)
    [free] = reserve_ports(1)
    free.close()
    with pytest.raises(OSError, match=f"UDP port {taken.port} on 127.0.0.1"):
        reserve_ports(2, ports=[free.port, taken.port])
    taken.close()
    again = reserve_ports(2, ports=[free.port, taken.port])  # the first try let go of free.port
    assert [r.port for r in again] == [free.port, taken.port]
    for r in again:
        r.close()
    [status] = reserve_ports(1, udp=False)
    assert [s.type for s in status.sockets] == [socket.SOCK_STREAM]
    with pytest.raises(ValueError, match="2 distinct ports"):
        reserve_ports(2, udp=False, ports=[status.port, status.port])
    status.close()
