"""A test-only gateway extension that blocks the gateway's event loop while a health probe is in flight.

POST /_test/block-loop {"seconds": S} arms it; the next /health probe of a backend then blocks the
loop for S seconds inside an I/O callback, as parsing a huge request head does (the probe's answer
arrives during the block and its deadline passes before the loop reads it). GET /_test/block-loop
reports {"armed", "blocks"}. Loaded with start_gateway(config, extensions=[FACTORY]).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

FACTORY = "kvgate_testing.loop_blocker:create"


class _BlockOnRead(asyncio.Protocol):
    def __init__(self, blocker: LoopBlocker):
        self.blocker = blocker

    def data_received(self, data: bytes) -> None:
        time.sleep(self.blocker.seconds)  # the point: the whole loop stops here
        self.blocker.blocks += 1


class LoopBlocker:
    def __init__(self, gateway):
        self.gateway = gateway
        self.seconds = 0.0
        self.armed = False
        self.blocks = 0
        self._trigger: socket.socket | None = None
        self._transport: asyncio.BaseTransport | None = None

    def routes(self) -> list[Route]:
        async def block_loop(request: Request) -> JSONResponse:
            if request.method == "POST":
                self.seconds = float(json.loads(await request.body())["seconds"])
                self.armed = True
            return JSONResponse({"armed": self.armed, "blocks": self.blocks})

        return [Route("/_test/block-loop", block_loop, methods=["GET", "POST"])]

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._trigger, receiving_end = socket.socketpair()
        self._trigger.setblocking(False)
        self._transport, _ = await loop.connect_accepted_socket(lambda: _BlockOnRead(self), receiving_end)
        pool = self.gateway.pool
        probe = pool.get

        async def get_then_block(url: str, timeout_s: float) -> tuple[int, bytes]:
            if self.armed and url.endswith("/health"):
                self.armed = False
                self._trigger.send(b"x")  # read, and the loop blocked, at the loop's next I/O poll
            return await probe(url, timeout_s)

        pool.get = get_then_block

    async def stop(self) -> None:
        if self._transport is not None:
            self._transport.close()
        if self._trigger is not None:
            self._trigger.close()

    def backend_added(self, backend) -> None:
        pass

    def backend_removed(self, backend) -> None:
        pass


def create(gateway) -> LoopBlocker:
    return LoopBlocker(gateway)
