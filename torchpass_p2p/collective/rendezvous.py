"""Rendezvous per configuration: no fixed host (docs/design.md section 8).

The member holding rank 0 in configuration ``c`` hosts a ``TCPStore`` on an ephemeral port and
announces it as service ``"store"`` of ``c`` through its agent; every other member of ``c``
looks it up from that member's agent (over the agents' authenticated TCP) and connects. Every
key lives under :func:`store_prefix` ``(c)``, so nothing of an older configuration can be
mistaken for the current one.

A configuration's group can be formed again (a *regroup*: a collective failed but no member
did, so no new configuration comes; :mod:`torchpass_p2p.trainer.recovery`). Attempt ``a > 0`` of
configuration ``c`` gets its own store, announced as :func:`store_service` ``(a)``, and its own
key namespace :func:`store_prefix` ``(c, a)``: it never meets the keys of the failed group.

Losing the host of ``c`` costs nothing once the group of ``c``
formed (gloo uses the store only to connect), and the host of ``c + 1`` is whoever holds rank 0
in ``c + 1`` -- a survivor or the spare that took rank 0.
"""

from __future__ import annotations

import datetime
import threading
from typing import Protocol

import torch.distributed as dist

__all__ = ["STORE_SERVICE", "ServiceDirectory", "StoreKeeper", "connect_store", "store_prefix",
           "store_service"]

STORE_SERVICE = "store"
"""Service name under which the holder of rank 0 announces the store of a configuration
(attempt 0; :func:`store_service`)."""
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


def store_prefix(config_id: int, attempt: int = 0) -> str:
    """The key namespace of attempt ``attempt`` of configuration ``config_id``'s group:
    ``torchpass/<config_id>`` for the first, ``torchpass/<config_id>r<attempt>`` for a
    regroup."""
    return f"torchpass/{config_id}" if attempt == 0 else f"torchpass/{config_id}r{attempt}"


def store_service(attempt: int = 0) -> str:
    """The service name of the store of attempt ``attempt`` (announced under the
    configuration's id): :data:`STORE_SERVICE`, or ``store.r<attempt>`` for a regroup."""
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    return STORE_SERVICE if attempt == 0 else f"{STORE_SERVICE}.r{attempt}"


class StoreKeeper:
    """The stores this process hosts, one per configuration (and regroup attempt) in which it
    held rank 0.

    Args:
        host: the address the stores listen on and that peers connect to (this member's
            agent host).
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._stores: dict[tuple[int, int], dist.TCPStore] = {}
        self._lock = threading.Lock()

    def host_store(self, config_id: int, attempt: int = 0) -> dist.TCPStore:
        """Start (or return) the store of ``config_id`` (its group's attempt ``attempt``) on
        an ephemeral port; older stores beyond :data:`KEEP_STORES` are dropped (their sockets
        close)."""
        with self._lock:
            key = (config_id, attempt)
            store = self._stores.get(key)
            if store is None:
                store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
                self._stores[key] = store
                for old in sorted(self._stores)[:-KEEP_STORES]:
                    del self._stores[old]
            return store

    def close(self) -> None:
        """Drop every hosted store."""
        with self._lock:
            self._stores.clear()


def connect_store(config_id: int, rank: int, holder: int, directory: ServiceDirectory,
                  keeper: StoreKeeper, *, timeout_s: float = STORE_TIMEOUT_S,
                  attempt: int = 0) -> dist.PrefixStore:
    """The store of configuration ``config_id`` (attempt ``attempt`` of its group), under
    :func:`store_prefix`.

    Rank 0 (``holder`` is then this member) hosts it and announces its port; every other rank
    looks the port up from ``holder``'s directory entry and connects.

    Args:
        config_id: the configuration whose group is being formed.
        rank: this member's rank in it.
        holder: member id holding rank 0 in it.
        directory: where ports are announced and found.
        keeper: this process's hosted stores.
        timeout_s: longest wait for the holder's announcement, and the store's call timeout.
        attempt: 0 for the configuration's first group, ``a > 0`` for its ``a``-th regroup
            (a store and a key namespace of its own).

    Raises:
        TimeoutError / TransportError: the holder did not announce a store in time.
        torch.distributed.DistNetworkError: the store's host could not be reached.
    """
    service = store_service(attempt)
    if rank == 0:
        store = keeper.host_store(config_id, attempt)
        directory.register_service(service, config_id, store.port)
    else:
        host, port = directory.lookup_service(holder, service, config_id, timeout_s=timeout_s)
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(store_prefix(config_id, attempt), store)
