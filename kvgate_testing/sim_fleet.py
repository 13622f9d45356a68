"""A fleet of simulated engines (`kvgate sim`) on loopback for benchmarks: start, reset, count, stop.

Every engine gets OS-chosen free ports (HTTP, KV-event PUB, replay ROUTER), so benchmarks run beside
other work on the machine. Per-engine request counts come from each engine's own /metrics
(vllm:request_success_total), which works whatever router sits in front.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, wait_for_http
from kvgate_testing.redis_server import RedisServer
from router.sim.shared_store import MEDIUM_SHARED, tier_prefix

MODEL = "tiny-qwen3"
EVENTS_TOPIC = "kv-events"
# The benchmarks' simulated hardware: a little slower than the simulator's default (100 instead of 50
# us per uncached prompt token, like a mid-size model on one accelerator), so that what routing
# changes (queueing and prefill of uncached tokens) outweighs CPU noise on a shared 2-core machine.
DEFAULT_SIM_ARGS = ["--prefill-us-per-token", "100"]


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    url: str
    events_endpoint: str
    replay_endpoint: str


def gateway_backend(engine: Any, *, url: str | None = None, bind: bool = False, **extra: Any) -> dict:
    """One `backends:` entry of a kvgate config for an engine publishing KV events (a simulated
    engine here, or anything with name, url, events_endpoint and replay_endpoint, as real vLLM's
    VllmServer): its events subscribed with replay; `bind` when the engine connects out to the
    gateway (real vLLM's PUB does); `extra` keys (role, cache_controller, ...) added as given."""
    events = {
        "endpoint": engine.events_endpoint,
        "replay_endpoint": engine.replay_endpoint,
        "topic": EVENTS_TOPIC,
    }
    if bind:
        events["bind"] = True
    return {"name": engine.name, "url": url or engine.url, "kv_events": events, **extra}


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """Totals from one engine's /metrics."""

    requests: float
    prompt_tokens: float
    cached_tokens: float

    def minus(self, earlier: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.requests - earlier.requests,
            self.prompt_tokens - earlier.prompt_tokens,
            self.cached_tokens - earlier.cached_tokens,
        )


def _distinct_free_ports(count: int, taken: set[int]) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in taken:
            taken.add(port)
            ports.append(port)
    return ports


class EngineFleet:
    """`count` simulated engines of `num_gpu_blocks` KV blocks each; `sim_args` go to `kvgate sim`.

    With `shared_tier` (a name), the engines share one simulated KV tier (router/sim/shared_store.py)
    in a redis-server the fleet starts (with `redis_args`, e.g. `--maxmemory`), and `shared_tiers` is
    the gateway's `shared_tiers` entry for it; `reset_caches` empties that tier too, and
    `restart_shared_store` restarts its server empty on the same port."""

    def __init__(
        self,
        count: int,
        num_gpu_blocks: int,
        block_size: int = 16,
        sim_args: list[str] | None = None,
        shared_tier: str | None = None,
        per_engine_args: list[list[str]] | None = None,
        redis_args: list[str] | None = None,
    ):
        """`per_engine_args[i]`: more `kvgate sim` flags for engine i alone (e.g. another block size)."""
        self.count = count
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.sim_args = list(sim_args or [])
        self.shared_tier = shared_tier
        self.per_engine_args = per_engine_args or []
        self.redis_args = list(redis_args or [])
        self.engines: list[Engine] = []
        self._processes: list[ManagedProcess] = []
        self._redis: RedisServer | None = None
        # Idle connections dropped after 1 s: the engines (uvicorn, as vLLM) close theirs after 5 s,
        # httpx's default is 5 s too, and a request sent on one the engine closes at that moment is
        # lost ("Server disconnected without sending a response": routing_bench's counters after a
        # router's start that took 5 s).
        self._client = httpx.Client(timeout=10.0, limits=httpx.Limits(keepalive_expiry=1.0))

    @property
    def shared_tiers(self) -> list[dict]:
        """The gateway's `shared_tiers` for this fleet (empty without a shared tier)."""
        if self.shared_tier is None:
            return []
        return [{"name": MEDIUM_SHARED, "backends": [engine.name for engine in self.engines]}]

    def start(self, timeout_s: float = 120.0) -> None:
        try:
            self._start_engines(timeout_s)
        except BaseException:  # a failed start, or SIGTERM as SystemExit: no engine outlives it
            self.stop()
            raise

    def _start_engines(self, timeout_s: float) -> None:
        taken: set[int] = set()
        shared_args: list[str] = []
        if self.shared_tier is not None:
            self._redis = RedisServer(*self.redis_args).start()
            shared_args = ["--shared-tier", self.shared_tier, "--shared-tier-url", self._redis.url]
        for index in range(self.count):
            http_port, events_port, replay_port = _distinct_free_ports(3, taken)
            engine = Engine(
                f"engine-{index}",
                f"http://127.0.0.1:{http_port}",
                f"tcp://127.0.0.1:{events_port}",
                f"tcp://127.0.0.1:{replay_port}",
            )
            events_config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": engine.events_endpoint,
                "replay_endpoint": engine.replay_endpoint,
                "topic": EVENTS_TOPIC,
            }
            args = [
                sys.executable, "-m", "router.cli", "sim",
                "--model", MODEL, "--tokenizer", "builtin:qwen3",
                "--host", "127.0.0.1", "--port", str(http_port),
                "--block-size", str(self.block_size),
                "--num-gpu-blocks-override", str(self.num_gpu_blocks),
                "--kv-events-config", json.dumps(events_config),
                "--log-level", "warning",
                *shared_args,
                *self.sim_args,
                *(self.per_engine_args[index] if index < len(self.per_engine_args) else []),
            ]  # fmt: skip
            self.engines.append(engine)
            self._processes.append(ManagedProcess(args))
        for engine, process in zip(self.engines, self._processes, strict=True):
            wait_for_http(f"{engine.url}/health", process, timeout_s)

    def reset_caches(self, timeout_s: float = 30.0) -> None:
        """Empty every engine's prefix cache (POST /reset_prefix_cache, refused while requests run)."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.engines)
        while pending:
            pending = [
                e for e in pending if self._client.post(f"{e.url}/reset_prefix_cache").status_code != 200
            ]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"engines {[e.name for e in pending]} still refuse to reset their cache")
            if pending:
                time.sleep(0.2)
        if self._redis is not None:
            # Deleted key by key (not FLUSHDB): members that watch removals hear of each deletion.
            with self._redis.client() as client:
                keys = list(client.scan_iter(match=f"{tier_prefix(self.shared_tier or '')}*", count=1000))
                for start in range(0, len(keys), 1000):
                    client.delete(*keys[start : start + 1000])

    @property
    def shared_store(self) -> RedisServer:
        """The redis-server holding the shared tier (a fleet without one has none)."""
        if self._redis is None:
            raise RuntimeError("this fleet has no shared tier")
        return self._redis

    def restart_shared_store(self) -> None:
        """Kill the shared tier's redis-server and start a new one on the same port: the store comes
        back empty, as a restarted cache daemon does."""
        self.shared_store.kill()
        self.shared_store.start()

    def lanes(self) -> list[list[int]]:
        """Groups of engines that share hardware, so that a request on one slows the others: each
        simulated engine times its requests by its own clock, so each is a lane of its own."""
        return [[index] for index in range(len(self.engines))]

    def counters(self) -> list[EngineCounters]:
        with ThreadPoolExecutor(max_workers=min(16, self.count)) as pool:
            return list(pool.map(self._counters_of, self.engines))

    def _counters_of(self, engine: Engine) -> EngineCounters:
        # A connection of its own per read: the shared client's pool, used from the threads at once
        # while it drops connections idle past keepalive_expiry, once handed a thread a socket
        # another had just closed ("Bad file descriptor").
        text = httpx.get(f"{engine.url}/metrics", timeout=10.0).text
        totals = {"vllm:request_success_total": 0.0, "vllm:prompt_tokens_total": 0.0,
                  "vllm:prefix_cache_hits_total": 0.0}  # fmt: skip
        for line in text.splitlines():
            name, _, rest = line.partition("{")
            if name in totals:
                totals[name] += float(rest.rsplit(" ", 1)[1])
        return EngineCounters(
            totals["vllm:request_success_total"],
            totals["vllm:prompt_tokens_total"],
            totals["vllm:prefix_cache_hits_total"],
        )

    def engine_pid(self, index: int) -> int:
        """The process id of engine `index` (its main thread's id too: the one serving HTTP)."""
        return self._processes[index].pid

    def all_alive(self) -> bool:
        return all(process.alive() for process in self._processes)

    def stop_engine(self, index: int) -> None:
        """Stop one engine (SIGTERM), as an engine that goes away: its port stops answering. The fleet
        keeps its entry, so `counters()` must not be called after this."""
        self._processes[index].stop()

    def stop(self) -> None:
        for process in self._processes:
            process.stop()
        self._processes.clear()
        self.engines.clear()
        self._client.close()
        if self._redis is not None:
            self._redis.close()
            self._redis = None

    def __enter__(self) -> EngineFleet:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
