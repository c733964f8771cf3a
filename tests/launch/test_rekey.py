"""The key file steps of a rotation, the launcher's checks and ``torchpass-p2p rotate-key``
(``docs/running.md``, "Keys")."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from torchpass_p2p.agent.http import http_token
from torchpass_p2p.agent.settings import read_keys
from torchpass_p2p.cli.main import main
from torchpass_p2p.core.seal import Keyring, key_id
from torchpass_p2p.launch.keyfile import (
    KeyFileError,
    replace_key_file,
    rotated_keys,
    write_key_file,
)
from torchpass_p2p.launch.outcome import EXIT_KEY_REFUSED, ChildExit, exit_code
from torchpass_p2p.launch.rekey import check_rotation, shared_token

K1, K2, K3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


def test_rotated_keys_puts_a_fresh_key_first_then_drops_the_rest() -> None:
    step1 = rotated_keys([K1])
    assert step1[1:] == [K1] and len(step1[0]) == 32 and key_id(step1[0]) != key_id(K1)
    assert rotated_keys(step1, drop_old=True) == step1[:1]
    with pytest.raises(KeyFileError, match="nothing to drop"):
        rotated_keys([K1], drop_old=True)


def test_replace_key_file_is_atomic_and_private(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    write_key_file(path, K1)
    replace_key_file(path, [K2, K1])
    assert read_keys(path) == [K2, K1]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.key"]
    with pytest.raises(KeyFileError):
        replace_key_file(path, [])
    assert read_keys(path) == [K2, K1]


def test_a_rotation_must_keep_a_shared_key_and_is_asked_for_with_its_token() -> None:
    old, step1, step2 = Keyring(K1), Keyring(K2, [K1]), Keyring(K2)
    assert check_rotation(old, step1) is None and check_rotation(step1, step2) is None
    refused = check_rotation(old, Keyring(K3))
    assert refused is not None and "shares no key" in refused
    # Every agent holds the old ring while it is asked: the token of a key in both.
    assert shared_token(old, step1) == http_token(K1)
    assert shared_token(step1, step2) == http_token(K2)
    with pytest.raises(ValueError):
        shared_token(old, Keyring(K3))


def test_a_launcher_whose_children_were_refused_exits_6() -> None:
    code, reason = exit_code([ChildExit(1, False, EXIT_KEY_REFUSED)])
    assert code == EXIT_KEY_REFUSED and "refused the key" in reason
    assert exit_code([ChildExit(1, True, 0), ChildExit(2, False, EXIT_KEY_REFUSED)])[0] == 1


def test_rotate_key_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cluster.key"
    write_key_file(path, K1)
    assert main(["rotate-key", str(path)]) == 0
    new, old = read_keys(path)
    assert old == K1
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"{path}: primary key id {key_id(new)}, accepted key ids {key_id(new)}, {key_id(K1)} "
        f"(were {key_id(K1)})",
        "send SIGHUP to the launcher(s) using this file (kill -HUP PID) to reload it"]
    assert new.hex() not in out and K1.hex() not in out
    # A launcher stand-in that records the SIGHUP it gets.
    marker = tmp_path / "hup"
    proc = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time, pathlib\n"
        f"signal.signal(signal.SIGHUP, lambda *a: (pathlib.Path({str(marker)!r}).touch(),"
        " sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n")], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        assert main(["rotate-key", str(path), "--drop-old", "--launcher", str(proc.pid)]) == 0
        assert proc.wait(10) == 0 and marker.exists()
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert read_keys(path) == [new]
    assert main(["rotate-key", str(path), "--drop-old"]) == 1
    assert "nothing to drop" in capsys.readouterr().err
    assert main(["rotate-key", str(tmp_path / "missing")]) == 2
