"""A :class:`~torchpass_p2p.collective.ServiceDirectory` of files, for tests without agents:
``register_service`` writes ``<dir>/svc-<name>-<config>-<member>`` (atomically), lookups poll."""

from __future__ import annotations

import os
import time
from pathlib import Path


class FileDirectory:
    def __init__(self, root: str | os.PathLike[str], member: int,
                 host: str = "127.0.0.1") -> None:
        self.root = Path(root)
        self.member = member
        self.host = host

    def _path(self, member: int, name: str, config_id: int) -> Path:
        return self.root / f"svc-{name}-{config_id}-{member:016x}"

    def register_service(self, name: str, config_id: int, port: int) -> None:
        path = self._path(self.member, name, config_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{self.host}:{port}")
        tmp.rename(path)

    def lookup_service(self, member: int, name: str, config_id: int, *,
                       timeout_s: float = 30.0) -> tuple[str, int]:
        path = self._path(member, name, config_id)
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{member:016x} serves no {name} for {config_id}")
            time.sleep(0.01)
        host, port = path.read_text().rsplit(":", 1)
        return host, int(port)
