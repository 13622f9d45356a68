"""Active health checks: probe every backend's /health periodically and move it in and out of the
rotation. Passive marking (connect errors, 5xx) happens on the request path, in router/forward.py.

A probe that fails while the gateway's own event loop was blocked (a stall the gateway caused, not
the backend) is not evidence: `LoopStallWatch` notices stalls from a timer that runs late, and such
a probe is repeated instead of marking the backend down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from router.upstream import UpstreamError

if TYPE_CHECKING:
    from router.backends import BackendRegistry, BackendState
    from router.config import Health
    from router.metrics import GatewayMetrics
    from router.upstream import UpstreamPool

log = logging.getLogger("kvgate.health")

# A failed probe is repeated at once this many times while each attempt overlapped a loop stall;
# after that the round gives no verdict and the next round probes again.
_PROBE_ATTEMPTS = 3


class LoopStallWatch:
    """Notices when the event loop stops running: a timer due every `tick_s` that fires more than
    `min_stall_s` late says the loop was blocked for that long. Remembers the recent stalls."""

    def __init__(self, metrics: GatewayMetrics, tick_s: float = 0.05, min_stall_s: float = 0.1):
        self.metrics = metrics
        self.tick_s = tick_s
        self.min_stall_s = min_stall_s
        self._stalls: deque[tuple[float, float]] = deque(maxlen=64)  # (loop time from, to)
        self._last_tick = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._last_tick = self._loop.time()
        self._timer = self._loop.call_later(self.tick_s, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        now = self._loop.time()
        late_s = now - self._last_tick - self.tick_s
        if late_s > self.min_stall_s:
            self._stalls.append((self._last_tick, now))
            self.metrics.loop_stalls.observe(late_s)
        self._last_tick = now
        self._timer = self._loop.call_later(self.tick_s, self._tick)

    def stalled_since(self, since: float) -> float:
        """The longest stall (seconds) that overlapped loop time `since` to now, 0.0 if none; a
        stall still unseen by the timer (it has not fired yet) counts too."""
        now = self._loop.time()
        longest = max((end - start for start, end in self._stalls if end >= since), default=0.0)
        unseen = now - self._last_tick - self.tick_s
        if unseen > self.min_stall_s:
            longest = max(longest, unseen)
        return longest


class HealthChecker:
    """Probes every backend of `backends` through `pool` each `config.interval_s` and marks it up or down."""

    def __init__(
        self, backends: BackendRegistry, pool: UpstreamPool, config: Health, metrics: GatewayMetrics
    ) -> None:
        self.backends = backends
        self.pool = pool
        self.interval_s = config.interval_s
        self.timeout_s = config.timeout_s
        self.min_down_s = config.min_down_s
        self.stall_watch = LoopStallWatch(metrics)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.stall_watch.start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-health")

    async def stop(self) -> None:
        self.stall_watch.stop()
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
        backends = list(self.backends.values())
        await asyncio.gather(*(self.probe(backend) for backend in backends))

    async def probe(self, backend: BackendState) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(_PROBE_ATTEMPTS):
            started = loop.time()
            problem = await self._probe_once(backend)
            if problem is None:
                break
            stalled_s = self.stall_watch.stalled_since(started)
            if not stalled_s:
                break
            log.info(
                "health probe of %s failed (%s) while the gateway's event loop stalled for %.2f s; "
                "probing again",
                backend.name,
                problem,
                stalled_s,
            )
        else:
            return  # the loop kept stalling: no verdict this round
        if problem is None:
            if not backend.healthy and time.monotonic() - backend.down_since >= self.min_down_s:
                self.backends.mark_up(backend)
        elif backend.healthy:
            self.backends.mark_down(backend, problem)

    async def _probe_once(self, backend: BackendState) -> str | None:
        """None when the backend's /health answered 200, else what went wrong."""
        try:
            status, _ = await self.pool.get(backend.url + "/health", self.timeout_s)
            return None if status == 200 else f"/health answered {status}"
        except (UpstreamError, TimeoutError) as exc:
            return f"/health failed: {exc or 'timed out'}"
        except Exception as exc:  # a probe must never kill the checker
            log.exception("health probe of %s failed unexpectedly", backend.name)
            return f"/health failed: {exc!r}"
