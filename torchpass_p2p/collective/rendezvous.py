"""Rendezvous per configuration: no fixed host (DESIGN section 8).

The member holding rank 0 in configuration ``c`` hosts a ``TCPStore`` on an ephemeral port and
announces it as service ``"store"`` of ``c`` through its agent; every other member of ``c``
looks it up from that member's agent (over the agents' authenticated TCP) and connects. Every
key lives under :func:`store_prefix` ``(c)``, so nothing of an older configuration can be
mistaken for the current one. Losing the host of ``c`` costs nothing once the group of ``c``
formed (gloo uses the store only to connect), and the host of ``c + 1`` is whoever holds rank 0
in ``c + 1`` -- a survivor or the spare that took rank 0.
"""

from __future__ import annotations

import datetime
import threading
from typing import Protocol

import torch.distributed as dist

__all__ = ["STORE_SERVICE", "ServiceDirectory", "StoreKeeper", "connect_store", "store_prefix"]

STORE_SERVICE = "store"
"""Service name under which the holder of rank 0 announces the store of a configuration."""
STORE_TIMEOUT_S = 60.0
"""A store client's per-call timeout (seconds): how long a ``get`` waits for a key another member
has not written yet. Members of a new configuration arrive within a few seconds of each other
(one decision, one gossip round); a member that never arrives is replaced by the next
configuration long before 60 s, and the waiting member abandons this rendezvous then."""
KEEP_STORES = 2
"""Stores a member keeps hosting: the current configuration's and the one before (a slow member
may still be connecting to it while the others already moved on)."""


class ServiceDirectory(Protocol):
    """Where a member announces and finds per-configuration ports: the agent
    (:class:`~torchpass_p2p.agent.api.Agent`) in production, a directory of files in tests."""

    def register_service(self, name: str, config_id: int, port: int) -> None: ...

    def lookup_service(self, member: int, name: str, config_id: int, *,
                       timeout_s: float = 30.0) -> tuple[str, int]: ...


def store_prefix(config_id: int) -> str:
    """The key namespace of configuration ``config_id``: ``torchpass/<config_id>``."""
    return f"torchpass/{config_id}"


class StoreKeeper:
    """The stores this process hosts, one per configuration in which it held rank 0.

    Args:
        host: the address the stores listen on and that peers connect to (this member's
            agent host).
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._stores: dict[int, dist.TCPStore] = {}
        self._lock = threading.Lock()

    def host_store(self, config_id: int) -> dist.TCPStore:
        """Start (or return) the store of ``config_id`` on an ephemeral port; older stores
        beyond :data:`KEEP_STORES` are dropped (their sockets close)."""
        with self._lock:
            store = self._stores.get(config_id)
            if store is None:
                store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
                self._stores[config_id] = store
                for old in sorted(self._stores)[:-KEEP_STORES]:
                    del self._stores[old]
            return store

    def close(self) -> None:
        """Drop every hosted store."""
        with self._lock:
            self._stores.clear()


def connect_store(config_id: int, rank: int, holder: int, directory: ServiceDirectory,
                  keeper: StoreKeeper, *, timeout_s: float = STORE_TIMEOUT_S,
                  ) -> dist.PrefixStore:
    """The store of configuration ``config_id``, under :func:`store_prefix`.

    Rank 0 (``holder`` is then this member) hosts it and announces its port; every other rank
    looks the port up from ``holder``'s directory entry and connects.

    Args:
        config_id: the configuration whose group is being formed.
        rank: this member's rank in it.
        holder: member id holding rank 0 in it.
        directory: where ports are announced and found.
        keeper: this process's hosted stores.
        timeout_s: longest wait for the holder's announcement, and the store's call timeout.

    Raises:
        TimeoutError / TransportError: the holder did not announce a store in time.
        torch.distributed.DistNetworkError: the store's host could not be reached.
    """
    if rank == 0:
        store = keeper.host_store(config_id)
        directory.register_service(STORE_SERVICE, config_id, store.port)
    else:
        host, port = directory.lookup_service(holder, STORE_SERVICE, config_id,
                                              timeout_s=timeout_s)
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(store_prefix(config_id), store)
