"""The private run directory, the cluster key file and the status-page bearer token.

The cluster key never appears on a command line or in a child's environment (docs/design.md section
9): children get the *path* of a key file (``TORCHPASS_KEY_FILE``) inside a directory only this user
can read. Key file format (:func:`torchpass_p2p.agent.settings.read_keyring`): 64 hex digits per
line, the primary key first; lines starting with ``#`` are comments.

A launcher removes its run directory when it ends, even on an error; one killed by SIGKILL (or
the OOM killer) cannot, and its key file would stay behind. Each run directory therefore holds a
lock file its launcher keeps locked (``flock(2)``) while it lives; the kernel drops the lock when
the process dies, however it dies, so the next launcher removes every run directory of this user
whose lock it can take (:func:`sweep_run_dirs`).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import stat
import tempfile
from os import PathLike
from pathlib import Path

from torchpass_p2p.agent.http import http_token  # the token the agents' status pages check
from torchpass_p2p.agent.settings import SettingsError, read_keys
from torchpass_p2p.core.seal import KEY_BYTES, key_id

__all__ = [
    "KEY_FILE_NAME",
    "KeyFileError",
    "http_token",
    "make_run_dir",
    "read_primary_key",
    "remove_run_dir",
    "replace_key_file",
    "rotated_keys",
    "sweep_run_dirs",
    "write_key_file",
]

KEY_FILE_NAME = "cluster.key"
RUN_DIR_PREFIX = "torchpass-run-"
LOCK_FILE_NAME = "launcher.lock"
_held_locks: dict[Path, int] = {}
"""Run directory -> the descriptor holding its lock, for the life of this process."""


class KeyFileError(ValueError):
    """A key file that holds no valid primary key; the message names the file."""


def make_run_dir(prefix: str = RUN_DIR_PREFIX, parent: str | PathLike[str] | None = None
                 ) -> Path:
    """A fresh directory under ``parent`` (default: the system temporary directory), mode 0700
    (``mkdtemp``), holding ``launcher.lock`` locked by this process until
    :func:`remove_run_dir`. Raises ``OSError`` when the directory or lock cannot be made."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o700)  # mkdtemp already uses 0700; explicit against an odd umask policy
    # Locked before it gets its name: a sweep never sees the lock file unlocked while we live.
    pending = path / (LOCK_FILE_NAME + ".new")
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(pending, path / LOCK_FILE_NAME)
    _held_locks[path] = fd
    return path


def remove_run_dir(path: str | PathLike[str]) -> None:
    """Delete the run directory and everything in it, then release its lock; a missing
    directory is not an error."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held_locks.pop(Path(path), None)
    if fd is not None:
        os.close(fd)


def sweep_run_dirs(prefix: str = RUN_DIR_PREFIX, parent: str | PathLike[str] | None = None
                   ) -> list[Path]:
    """Remove the run directories under ``parent`` (default: the system temporary directory)
    that this user owns and whose launcher is gone: their lock is free. A directory with no
    lock file (being made, or made by an older version) or another user's is left alone.
    Returns the directories removed."""
    removed = []
    for path in Path(parent or tempfile.gettempdir()).glob(prefix + "*"):
        try:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(path / LOCK_FILE_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its launcher lives
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def write_key_file(path: str | PathLike[str], key: bytes | None = None) -> bytes:
    """Write ``key`` (default: 32 fresh random bytes from :mod:`secrets`) to ``path`` as 64 hex
    digits, creating the file with mode 0600 (never readable by others, even for an instant).

    Returns the key. Raises ``FileExistsError`` if ``path`` exists, ``KeyFileError`` for a key
    that is not 32 bytes.
    """
    if key is None:
        key = secrets.token_bytes(KEY_BYTES)
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"{path}: a cluster key is {KEY_BYTES} bytes")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(key.hex() + "\n")
    return key


def read_primary_key(path: str | PathLike[str]) -> bytes:
    """The primary (first) key of a key file (the agents' reader, :func:`read_keys`).

    Raises:
        KeyFileError: no key, or a key line that is not 64 hex digits.
        OSError: the file cannot be read.
    """
    try:
        return read_keys(path)[0]
    except SettingsError as exc:
        raise KeyFileError(str(exc)) from None


def rotated_keys(keys: list[bytes], *, drop_old: bool = False) -> list[bytes]:
    """The key list after one step of a rotation (``docs/running.md``, "Keys"): a fresh random
    key (from :mod:`secrets`, with a key id no listed key has) first, then ``keys``; or, with
    ``drop_old``, the primary alone.

    Raises:
        KeyFileError: ``drop_old`` and there is no other key to drop.
    """
    if drop_old:
        if len(keys) < 2:
            raise KeyFileError("the key file holds one key only: nothing to drop")
        return keys[:1]
    taken = {key_id(k) for k in keys}
    while True:  # 1 in 256 per listed key: a Keyring refuses two keys with one id
        new = secrets.token_bytes(KEY_BYTES)
        if key_id(new) not in taken:
            return [new, *keys]


def replace_key_file(path: str | PathLike[str], keys: list[bytes]) -> None:
    """Write ``keys`` (primary first, 64 hex digits a line) to ``path`` in one step: a new file
    (mode 0600) in the same directory, synced, then renamed over ``path``, so a process
    reading ``path`` meanwhile reads the old list or the new one, never part of one.

    Raises:
        KeyFileError: no key, or one that is not 32 bytes.
        OSError: the directory cannot be written.
    """
    if not keys or any(len(k) != KEY_BYTES for k in keys):
        raise KeyFileError(f"{path}: a key file holds one or more {KEY_BYTES}-byte keys")
    path = Path(path)
    pending = path.with_name(f".{path.name}.{secrets.token_hex(4)}.new")
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write("".join(k.hex() + "\n" for k in keys))
            f.flush()
            os.fsync(f.fileno())
        os.rename(pending, path)
    except BaseException:
        pending.unlink(missing_ok=True)
        raise
