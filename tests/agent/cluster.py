"""A cluster of live agents on loopback, all on the test's event loop.

Every agent has real UDP and TCP sockets and the real sealing; only the process is shared.
Ports are reserved for both protocols (the launcher's ``reserve_ports``) and released just
before the agents bind: configuration 0 must name every address before any agent starts. (The
launcher hands its children the bound sockets instead; in one process the agents bind at once.)
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Callable
from dataclasses import replace

from torchpass_p2p.agent.runtime import AgentRuntime
from torchpass_p2p.agent.settings import AgentSettings
from torchpass_p2p.core.configuration import Configuration
from torchpass_p2p.core.params import Params
from torchpass_p2p.core.seal import Keyring
from torchpass_p2p.launch.ports import reserve_ports

HOST = "127.0.0.1"


class LocalCluster:
    """``ranks`` + ``spares`` agents with member ids 1..N (ranks first), one seeded rng each."""

    def __init__(self, ranks: int, spares: int, *, params: Params | None = None,
                 seed: int = 0, status: bool = False, pulse: bool = True) -> None:
        ids = list(range(1, ranks + spares + 1))
        held = reserve_ports(len(ids), HOST)
        ports = [r.port for r in held]
        for r in held:
            r.close()
        self.key = secrets.token_bytes(32)
        self.keyring = Keyring(self.key)
        self.configuration = Configuration(
            0, ids[:ranks], ids[ranks:], {m: (HOST, p) for m, p in zip(ids, ports, strict=True)})
        self.template = AgentSettings(
            keyring=self.keyring, member_id=ids[0], configuration=self.configuration,
            params=params or Params(), status=(HOST, 0) if status else None, health=False,
            pulse=pulse)
        self.seed = seed
        self.agents: dict[int, AgentRuntime] = {
            m: AgentRuntime(replace(self.template, member_id=m, bind=(HOST, p)),
                            rng=random.Random(seed * 1_000 + m))
            for m, p in zip(ids, ports, strict=True)}

    def __getitem__(self, member: int) -> AgentRuntime:
        return self.agents[member]

    async def start(self) -> None:
        await asyncio.gather(*(a.start() for a in self.agents.values()))

    async def join(self, member: int) -> AgentRuntime:
        """Start a new process that joins through the first two members as seeds."""
        seeds = tuple(self.configuration.addresses[m] for m in self.configuration.members[:2])
        settings = replace(self.template, member_id=member, configuration=None, seeds=seeds,
                           bind=(HOST, 0))
        agent = AgentRuntime(settings, rng=random.Random(self.seed * 1_000 + member))
        self.agents[member] = agent
        await agent.start()
        return agent

    def live(self) -> list[AgentRuntime]:
        return [a for a in self.agents.values() if not a.stopped]

    async def until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Wait until ``predicate()`` holds, polling every 20 ms.

        Raises:
            TimeoutError: it did not hold within ``timeout_s`` seconds.
        """
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.02)

    async def stop(self) -> None:
        await asyncio.gather(*(a.stop(leave=False) for a in self.live()))
