"""A transfer server that holds its chunks back until its receiver's connections are all in."""

from __future__ import annotations

import asyncio

from torchpass_p2p.transfer.server import TransferServer


class GatedServer(TransferServer):
    """Serves no chunk until ``ready(self)`` holds (checked every millisecond, for 30 s at
    most; by default: until two connections have asked for chunks): a transfer small enough to
    end before its extra connection opens, made to wait for it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.asking = set()

    ready = staticmethod(lambda server: len(server.asking) >= 2)

    async def serve_chunk(self, conn, snapshot, index, header, skip=0):
        self.asking.add(conn)
        async with asyncio.timeout(30):
            while not self.ready(self):
                await asyncio.sleep(0.001)
        await super().serve_chunk(conn, snapshot, index, header, skip)
