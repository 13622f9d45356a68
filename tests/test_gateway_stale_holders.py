"""Stale holders through the real gateway process: a backend that is down, or whose KV-event stream
is disconnected, is not reported as holding prefixes by /lookup or /debug/prefix-map; both list it
apart under `stale_holders`, with the reason."""

from __future__ import annotations

import time

import httpx

from kvgate_testing.backend import running_backends
from kvgate_testing.event_publisher import EventPublisher, block_stored
from kvgate_testing.gateway import start_gateway
from kvgate_testing.ports import free_port
from kvgate_testing.waiting import wait_for

MODEL = "test-model"
PROMPT = list(range(1000, 1064))


def test_a_down_or_disconnected_backend_is_listed_apart_as_a_stale_holder() -> None:
    with running_backends("b0", "b1", "b2", models=[MODEL]) as backends:
        publishers = {}
        specs = []
        try:
            for backend in backends:
                endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
                publishers[backend.name] = EventPublisher(endpoint, replay, topic="")
                kv_events = {"endpoint": endpoint, "replay_endpoint": replay}
                specs.append({"name": backend.name, "url": backend.url, "kv_events": kv_events})
            config = {
                "models": [{"name": MODEL}],
                "backends": specs,
                "health": {"interval_s": 0.2, "timeout_s": 0.5, "min_down_s": 0.0},
            }
            with start_gateway(config) as gateway, httpx.Client(base_url=gateway.url, timeout=10) as client:

                def prefix_map() -> dict:
                    return client.get("/debug/prefix-map", params={"format": "json"}).json()

                def lookup() -> dict:
                    response = client.post("/lookup", json={"tokens": PROMPT})
                    assert response.status_code == 200
                    return response.json()

                wait_for(
                    lambda: all(b["connected"] for b in prefix_map()["backends"].values()), what="streams"
                )
                time.sleep(0.3)  # the subscriptions reach the publishers
                for n, publisher in enumerate(publishers.values()):
                    publisher.publish([block_stored([10 * n + k for k in range(1, 5)], PROMPT, 16)])
                wait_for(lambda: len(lookup()["layout_info"]) == 3, what="three holders")
                assert lookup()["stale_holders"] == {}

                backends[0].set_mode(health_status=503)  # b0 goes down
                publishers.pop("b1").close()  # b1's event stream goes away (its HTTP side stays up)
                wait_for(lambda: set(lookup()["stale_holders"]) == {"b0", "b1"}, what="two stale holders")
                answer = lookup()
                assert answer["layout_info"] == {"b2": ["GPU", 64]}
                assert answer["stale_holders"]["b0"]["tokens"] == 64
                assert answer["stale_holders"]["b0"]["reason"].startswith(
                    "backend down: /health answered 503"
                )
                assert answer["stale_holders"]["b1"] == {
                    "medium": "GPU",
                    "tokens": 64,
                    "reason": "event stream disconnected",
                }
                data = prefix_map()
                [prefix] = data["prefixes"]
                assert prefix["backends"] == {"b2": 64}
                assert set(prefix["stale_holders"]) == {"b0", "b1"}
                assert data["backends"]["b1"]["stale"] == "event stream disconnected"
                assert data["backends"]["b0"]["stale"].startswith("backend down")
                assert data["backends"]["b2"]["stale"] is None
                page = client.get("/debug/prefix-map").text
                assert "b1 64 stale" in page

                backends[0].set_mode(health_status=200)  # b0 is back: a holder again
                wait_for(lambda: set(lookup()["layout_info"]) == {"b0", "b2"}, what="b0 back")
                # (and an admin POST that is not JSON is refused, as on /backends)
                plain = client.post(
                    "/lookup", content=b'{"tokens": [1]}', headers={"content-type": "text/plain"}
                )
                assert plain.status_code == 415
        finally:
            for publisher in publishers.values():
                publisher.close()
