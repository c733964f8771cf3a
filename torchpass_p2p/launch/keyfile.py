"""The private run directory, the cluster key file and the status-page bearer token.

The cluster key never appears on a command line or in a child's environment (DESIGN section 9):
children get the *path* of a key file (``TORCHPASS_KEY_FILE``) inside a directory only this user
can read. Key file format (:func:`torchpass_p2p.agent.settings.read_keyring`): 64 hex digits per
line, the primary key first; lines starting with ``#`` are comments.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from os import PathLike
from pathlib import Path

from torchpass_p2p.agent.http import http_token  # the token the agents' status pages check
from torchpass_p2p.agent.settings import SettingsError, read_keys
from torchpass_p2p.core.seal import KEY_BYTES

__all__ = [
    "KEY_FILE_NAME",
    "KeyFileError",
    "http_token",
    "make_run_dir",
    "read_primary_key",
    "remove_run_dir",
    "write_key_file",
]

KEY_FILE_NAME = "cluster.key"


class KeyFileError(ValueError):
    """A key file that holds no valid primary key; the message names the file."""


def make_run_dir(prefix: str = "torchpass-run-") -> Path:
    """A fresh directory under the system temporary directory, mode 0700 (``mkdtemp``)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(path, 0o700)  # mkdtemp already uses 0700; explicit against an odd umask policy
    return path


def remove_run_dir(path: str | PathLike[str]) -> None:
    """Delete the run directory and everything in it; a missing directory is not an error."""
    shutil.rmtree(path, ignore_errors=True)


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
