"""Simulated engines with roles (`kvgate sim --kv-role`) sharing a real redis-server as their KV tier,
and the gateway configuration that disaggregates over them: for the prefill/decode tests.

Each engine publishes KV events on its own ZMQ ports; an engine named in `crashing` is
kvgate_testing/crashing_engine.py instead: up for the health probes, it drops every request it is
sent before answering. `stores` gives an engine a Redis of its own instead of
the shared one (its store then holds nothing another engine wrote, as after a daemon restart).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import httpx

from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, wait_for_http
from kvgate_testing.redis_server import RedisServer
from kvgate_testing.sim_fleet import gateway_backend
from router.sim.shared_store import MEDIUM_SHARED

MODEL = "tiny-qwen3"
TIER = "pd"
# The simulated hardware of these tests: a prefill long enough for the cost terms to differ.
PREFILL_US_PER_TOKEN = 100.0
LOAD_US_PER_TOKEN = 10.0
# A store that takes its time (tens of ms for a long prompt): a decode request sent before the
# store holds the prompt would find it missing.
STORE_US_PER_TOKEN = 100.0


@dataclass(slots=True)
class RoledEngine:
    name: str
    role: str
    url: str
    events_endpoint: str
    replay_endpoint: str
    process: ManagedProcess | None = None


@dataclass(slots=True)
class RoledFleet:
    """`roles`: engine name -> role, in the order the gateway lists them."""

    roles: dict[str, str]
    sim_args: dict[str, list[str]] = field(default_factory=dict)
    crashing: tuple[str, ...] = ()
    stores: tuple[str, ...] = ()  # engines given a Redis of their own
    engines: list[RoledEngine] = field(default_factory=list)
    redis: RedisServer | None = None
    _own_redis: list[RedisServer] = field(default_factory=list)

    def start(self) -> RoledFleet:
        try:
            self.redis = RedisServer().start()
            for name, role in self.roles.items():
                http, events, replay = free_port(), free_port(), free_port()
                engine = RoledEngine(
                    name, role, f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{events}",
                    f"tcp://127.0.0.1:{replay}",
                )  # fmt: skip
                self.engines.append(engine)
                if name in self.crashing:
                    engine.process = ManagedProcess(
                        [sys.executable, "-m", "kvgate_testing.crashing_engine", "--port", str(http)]
                    )
                    continue
                store = self.redis
                if name in self.stores:
                    store = RedisServer().start()
                    self._own_redis.append(store)
                events_config = {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": engine.events_endpoint,
                    "replay_endpoint": engine.replay_endpoint,
                    "topic": "kv-events",
                }
                engine.process = ManagedProcess(
                    [
                        sys.executable, "-m", "router.cli", "sim",
                        "--model", MODEL, "--tokenizer", "builtin:qwen3", "--port", str(http),
                        "--kv-events-config", json.dumps(events_config), "--log-level", "warning",
                        "--shared-tier", TIER, "--shared-tier-url", store.url, "--kv-role", role,
                        "--prefill-us-per-token", str(PREFILL_US_PER_TOKEN),
                        "--shared-load-us-per-token", str(LOAD_US_PER_TOKEN),
                        "--shared-store-us-per-token", str(STORE_US_PER_TOKEN),
                        "--prefill-overhead-ms", "0",
                        *self.sim_args.get(name, []),
                    ]
                )  # fmt: skip
            for engine in self.engines:
                if engine.process is not None:
                    wait_for_http(f"{engine.url}/health", engine.process, 60.0)
        except BaseException:
            self.stop()
            raise
        return self

    def engine(self, name: str) -> RoledEngine:
        return next(engine for engine in self.engines if engine.name == name)

    def gateway_config(self, mode: str = "conditional", **disaggregation) -> dict:
        """proxy.yaml: kv_aware over the engines, every one attached to the shared tier."""
        return {
            "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
            "backends": [gateway_backend(engine, role=engine.role) for engine in self.engines],
            "shared_tiers": [{"name": MEDIUM_SHARED, "backends": [engine.name for engine in self.engines]}],
            "policy": {"name": "kv_aware"},
            # Probes seldom: a dead engine must be found by the request sent to it.
            "health": {"interval_s": 600.0},
            "disaggregation": {"mode": mode, **disaggregation},
        }

    def counters(self, name: str) -> dict[str, float]:
        """The engine's /metrics totals, summed over labels."""
        text = httpx.get(f"{self.engine(name).url}/metrics", timeout=10.0).text
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            metric, _, value = line.rpartition(" ")
            metric_name = metric.partition("{")[0]
            totals[metric_name] = totals.get(metric_name, 0.0) + float(value)
        return totals

    def stop(self) -> None:
        for engine in self.engines:
            if engine.process is not None:
                engine.process.stop()
        for store in [self.redis, *self._own_redis]:
            if store is not None:
                store.close()
        self.redis = None
        self._own_redis.clear()

    def __enter__(self) -> RoledFleet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def gateway_metrics(url: str) -> dict[str, float]:
    """The gateway's /metrics samples, keyed by the line's name and labels."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            metric, _, value = line.rpartition(" ")
            samples[metric] = float(value)
    return samples
