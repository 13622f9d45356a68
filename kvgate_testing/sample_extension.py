"""A gateway extension used by tests/test_gateway_extensions.py to exercise every seam of
router/extensions.py: routes, start/stop, backend_added/removed and a request preparer; and one that
fails to start (`create_failing_at_start`), for the exit status of a start-up that fails."""

from __future__ import annotations

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from router.index.keys import Namespace

# Tokens the preparer claims for every prompt, of which this many are "cached".
PROMPT_TOKENS = 10
CACHED_TOKENS = 4


class SampleExtension:
    instances: list[SampleExtension] = []

    def __init__(self, gateway):
        self.gateway = gateway
        self.events: list[str] = []
        self.backends: list[str] = []
        gateway.kv_index = self
        gateway.request_preparers.append(self.prepare)
        SampleExtension.instances.append(self)

    async def prepare(self, route_request) -> None:
        route_request.tokens = np.arange(PROMPT_TOKENS, dtype=np.uint32)
        route_request.namespace = Namespace()
        route_request.known_cached_tokens = CACHED_TOKENS

    def routes(self) -> list[Route]:
        async def sample(request: Request) -> JSONResponse:
            return JSONResponse({"events": self.events, "backends": self.backends})

        return [Route("/debug/sample", sample)]

    async def start(self) -> None:
        self.events.append("start")

    async def stop(self) -> None:
        self.events.append("stop")

    def backend_added(self, backend) -> None:
        self.backends.append(backend.name)

    def backend_removed(self, backend) -> None:
        self.backends.remove(backend.name)


def create(gateway) -> SampleExtension:
    return SampleExtension(gateway)


class FailingAtStart(SampleExtension):
    """Raises in the app's startup, as a part of the gateway that cannot start would."""

    async def start(self) -> None:
        raise RuntimeError("the sample extension refuses to start")


def create_failing_at_start(gateway) -> FailingAtStart:
    return FailingAtStart(gateway)
