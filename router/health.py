"""Active health checks: probe every backend's /health periodically and move it in and out of the
rotation. Passive marking (connect errors, 5xx) happens on the request path, in router/forward.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from router.upstream import UpstreamError

if TYPE_CHECKING:
    from router.app import Gateway
    from router.backends import BackendState

log = logging.getLogger("kvgate.health")


class HealthChecker:
    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.interval_s = gateway.config.health.interval_s
        self.timeout_s = gateway.config.health.timeout_s
        self.min_down_s = gateway.config.health.min_down_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)

    async def probe_all(self) -> None:
        backends = list(self.gateway.backends.values())
        await asyncio.gather(*(self.probe(backend) for backend in backends))

    async def probe(self, backend: BackendState) -> None:
        try:
            status, _ = await self.gateway.pool.get(backend.url + "/health", self.timeout_s)
            problem = None if status == 200 else f"/health answered {status}"
        except (UpstreamError, TimeoutError) as exc:
            problem = f"/health failed: {exc or 'timed out'}"
        except Exception as exc:  # a probe must never kill the checker
            log.exception("health probe of %s failed unexpectedly", backend.name)
            problem = f"/health failed: {exc!r}"
        if problem is None:
            if not backend.healthy and time.monotonic() - backend.down_since >= self.min_down_s:
                self.gateway.mark_up(backend)
        elif backend.healthy:
            self.gateway.mark_down(backend, problem)
