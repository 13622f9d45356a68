"""kv_aware must say when it routes blind, in the log, on /debug/prefix-map (JSON and HTML) and in
kvgate_routing_warnings: a model without a tokenizer, a subscribed backend whose events never arrive
(a topic mismatch: the stream reads connected), an event socket that could not be bound.
Real gateway process, real test backends, real ZMQ publishers."""

from __future__ import annotations

import socket
import time

import httpx

from kvgate_testing.backend import start_backend
from kvgate_testing.event_publisher import EventPublisher, block_stored
from kvgate_testing.gateway import start_gateway
from kvgate_testing.metrics import metric_samples
from kvgate_testing.ports import free_port
from router.routing_warnings import SILENT_AFTER_S

PROMPT = "A prompt long enough to fill more than one block of sixteen tokens, " * 4


def _prefix_map(gateway) -> dict:
    answer = httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10)
    answer.raise_for_status()
    return answer.json()


def _warning_gauge(gateway) -> dict[str, float]:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return {
        dict(labels)["kind"]: value
        for (name, labels), value in metric_samples(text).items()
        if name == "kvgate_routing_warnings"
    }


def _wait_for_log(gateway, needle: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while needle not in gateway.process.output():
        assert time.monotonic() < deadline, f"{needle!r} never logged:\n{gateway.process.output()[-3000:]}"
        time.sleep(0.1)
    return gateway.process.output()


def test_a_model_without_tokenizer_and_an_unbindable_event_socket_are_reported_and_nothing_else():
    # One gateway for the start-time blind spots (a gateway with a tokenizer takes seconds to
    # start), beside a healthy model and backend that must not be reported.
    backends = [start_backend("e1", ["plain", "m"]), start_backend("b0", ["plain", "m"])]
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
    config = {
        "models": [{"name": "plain"}, {"name": "m", "tokenizer": "builtin:qwen3"}],
        "backends": [
            {"name": "e1", "url": backends[0].url, "kv_events": {"endpoint": endpoint, "bind": True}},
            {
                "name": "b0",
                "url": backends[1].url,
                "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}"},
            },
        ],
        "policy": {"name": "kv_aware"},
    }
    try:
        with start_gateway(config) as gateway:
            warnings = _prefix_map(gateway)["warnings"]
            assert [(w["kind"], w["subject"]) for w in warnings] == [
                ("no_tokenizer", "plain"),
                ("socket_error", "e1"),
            ]
            assert "no_tokens" in warnings[0]["message"] and "tokenizer:" in warnings[0]["message"]
            assert f"cannot bind {endpoint}" in warnings[1]["message"]
            page = httpx.get(f"{gateway.url}/debug/prefix-map", timeout=10).text
            assert "Routing blind spots" in page and "model plain: it has no `tokenizer:`" in page
            assert "socket failed" in page
            assert _warning_gauge(gateway) == {
                "no_tokenizer": 1, "socket_error": 1, "silent_events": 0, "contract_mismatch": 0
            }  # fmt: skip
            _wait_for_log(gateway, "kv_aware routes blind: model plain")
            log = _wait_for_log(gateway, "kv_aware routes blind: backend e1")
            assert "e1 is NOT subscribed" in log
            assert "subscribed to e1" not in log and "subscribed to b0" in log
            assert "model m:" not in log and "backend b0" not in log
    finally:
        taken.close()
        for backend in backends:
            backend.stop()


def test_a_backend_whose_events_never_arrive_is_reported_though_it_reads_connected():
    # Two models, each served by one backend, so the test decides where requests go. The engine of
    # `silent` publishes on another topic than the gateway subscribes to.
    backends = {name: start_backend(name, [f"model-{name}"]) for name in ("heard", "silent")}
    publishers: dict[str, EventPublisher] = {}
    specs = []
    for name, backend in backends.items():
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        publishers[name] = EventPublisher(endpoint, topic="kv-events")
        subscribed_topic = "kv-events" if name == "heard" else "kv-events-of-another-engine"
        specs.append(
            {
                "name": name,
                "url": backend.url,
                "models": [f"model-{name}"],
                "kv_events": {"endpoint": endpoint, "topic": subscribed_topic},
            }
        )
    config = {
        "models": [{"name": f"model-{name}", "tokenizer": "builtin:qwen3"} for name in backends],
        "backends": specs,
        "policy": {"name": "kv_aware"},
    }
    gateway = start_gateway(config)
    try:
        deadline = time.monotonic() + 15
        while not all(b["connected"] for b in _prefix_map(gateway)["backends"].values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(SILENT_AFTER_S + 0.2)  # the engines have had time to publish; from now it counts
        for n in range(3):
            for name in backends:
                answer = httpx.post(
                    f"{gateway.url}/v1/completions",
                    json={"model": f"model-{name}", "prompt": f"{n} {PROMPT}", "max_tokens": 1},
                    timeout=10,
                )
                assert answer.headers["x-kvgate-backend"] == name
                # What the engine does after a prefill: announce the blocks it stored.
                hashes = [1000 * n + 10 * len(name) + i for i in range(2)]
                publishers[name].publish([block_stored(hashes, list(range(32)), 16)])
        deadline = time.monotonic() + 10
        while True:
            data = _prefix_map(gateway)
            if data["warnings"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [(w["kind"], w["subject"]) for w in data["warnings"]] == [("silent_events", "silent")]
        assert "kv_events.topic" in data["warnings"][0]["message"]
        assert data["backends"]["silent"]["connected"] is True  # what made it look fine before
        assert data["backends"]["silent"]["batches"] == 0 and data["backends"]["heard"]["batches"] > 0
        page = httpx.get(f"{gateway.url}/debug/prefix-map", timeout=10).text
        assert "backend silent: took 3 requests" in page
        assert _warning_gauge(gateway)["silent_events"] == 1
        _wait_for_log(gateway, "kv_aware routes blind: backend silent")
    finally:
        gateway.stop()
        for publisher in publishers.values():
            publisher.close()
        for backend in backends.values():
            backend.stop()


def test_an_event_stream_that_both_sides_connect_is_reported_with_the_side_to_change():
    # Both engines' publishers connect out, as vLLM's does for a host address such as
    # tcp://127.0.0.1:PORT (docs/real-engines.md). The gateway binds for `right` (kv_events.bind:
    # true, the matching config) and connects for `wrong` (the default): two connecting sockets,
    # so `wrong` never hears a thing, while its engine answers every request.
    backends = {name: start_backend(name, [f"model-{name}"]) for name in ("right", "wrong")}
    publishers = {}
    specs = []
    for name, backend in backends.items():
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        publishers[name] = EventPublisher(endpoint, topic="kv-events", connect=True)
        specs.append(
            {
                "name": name,
                "url": backend.url,
                "models": [f"model-{name}"],
                "kv_events": {"endpoint": endpoint, "topic": "kv-events", "bind": name == "right"},
            }
        )
    config = {
        "models": [{"name": f"model-{name}", "tokenizer": "builtin:qwen3"} for name in backends],
        "backends": specs,
        "policy": {"name": "kv_aware"},
    }
    gateway = start_gateway(config)
    try:
        deadline = time.monotonic() + 15
        while not _prefix_map(gateway)["backends"]["right"]["connected"]:
            assert time.monotonic() < deadline, "the engine's publisher never reached the bound socket"
            time.sleep(0.05)
        time.sleep(SILENT_AFTER_S + 0.2)  # the engines have had time to publish; from now it counts
        for n in range(3):  # what `right` must take without a warning, its events arriving
            for name in backends:
                answer = httpx.post(
                    f"{gateway.url}/v1/completions",
                    json={"model": f"model-{name}", "prompt": f"{n} {PROMPT}", "max_tokens": 1},
                    timeout=10,
                )
                assert answer.headers["x-kvgate-backend"] == name
                hashes = [1000 * n + 10 * len(name) + i for i in range(2)]
                publishers[name].publish([block_stored(hashes, list(range(32)), 16)])
        # /health shows what the background check (every WARNING_CHECK_EVERY_S) found.
        deadline = time.monotonic() + 10
        while "warnings" not in (health := httpx.get(f"{gateway.url}/health", timeout=10).json()):
            assert time.monotonic() < deadline, f"/health never warned: {health}"
            time.sleep(0.1)
        assert health["status"] == "ok"
        assert [(w["kind"], w["subject"]) for w in health["warnings"]] == [("silent_events", "wrong")]
        data = _prefix_map(gateway)
        assert [(w["kind"], w["subject"]) for w in data["warnings"]] == [("silent_events", "wrong")]
        message = data["warnings"][0]["message"]
        assert "never connected" in message and "the engine connects too" in message
        assert "set kv_events.bind: true" in message
        assert data["backends"]["wrong"]["connected"] is False and data["backends"]["wrong"]["batches"] == 0
        assert data["backends"]["right"]["batches"] > 0
        page = httpx.get(f"{gateway.url}/debug/prefix-map", timeout=10).text
        assert "set kv_events.bind: true" in page
        assert _warning_gauge(gateway)["silent_events"] == 1
        log = _wait_for_log(gateway, "kv_aware routes blind: backend wrong")
        assert "backend right" not in log
        # The start-time line says which side binds, so the wrong direction shows before any request.
        assert "subscribed to wrong (1 rank(s)) at" in log and "connecting to it" in log
        assert "subscribed to right (1 rank(s)) at" in log and "binding it" in log
    finally:
        gateway.stop()
        for publisher in publishers.values():
            publisher.close()
        for backend in backends.values():
            backend.stop()
