"""A real gateway routing kv_aware in front of three test backends, each with a KV-event publisher
speaking vLLM's protocol (`Fleet`), and the documents and chat bodies the tests send it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from kvgate_testing.backend import start_backend
from kvgate_testing.event_publisher import EventPublisher, block_stored
from kvgate_testing.gateway import start_gateway
from kvgate_testing.ports import free_port

MODEL = "test-model"
DOCS = {
    "b1": "The first document is about tidal energy in northern fjords and how turbines are placed. " * 6,
    "b2": "The second document covers medieval bookbinding, glue recipes and the sewing of quires. " * 6,
}


def chat_body(doc: str, question: str) -> dict:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": doc},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
    }


class Fleet:
    """Backends b0, b1, b2 and the gateway (its model on `tokenizer`, a config's `tokenizer` value);
    `cache` announces cached blocks as vLLM does. `start` runs the gateway from its config mapping
    (start_gateway: `kvgate serve`; kvgate_testing/picker.py start_picker: `kvgate epp`), `sections` are
    further config sections."""

    def __init__(
        self,
        admin: dict | None = None,
        tokenizer: str = "builtin:qwen3",
        start: Callable[[dict], Any] = start_gateway,
        **sections: Any,
    ) -> None:
        self.backends = [start_backend(f"b{i}", [MODEL]) for i in range(3)]
        self.publishers: dict[str, EventPublisher] = {}
        specs = []
        try:
            for backend in self.backends:
                endpoint = f"tcp://127.0.0.1:{free_port()}"
                replay = f"tcp://127.0.0.1:{free_port()}"
                self.publishers[backend.name] = EventPublisher(endpoint, replay, topic="kv-events")
                specs.append(
                    {
                        "name": backend.name,
                        "url": backend.url,
                        "kv_events": {"endpoint": endpoint, "replay_endpoint": replay, "topic": "kv-events"},
                    }
                )
            config = {
                "models": [{"name": MODEL, "tokenizer": tokenizer}],
                "backends": specs,
                "policy": {"name": "kv_aware", "measure_load_costs": True},
                "admin": admin or {},
                **sections,
            }
            self.gateway = start(config)
            self.headers = {"authorization": f"Bearer {admin['token']}"} if admin else {}
            self.client = httpx.Client(base_url=self.gateway.url, timeout=30, headers=self.headers)
            self.wait_for(lambda m: all(b["connected"] for b in m["backends"].values()))
            time.sleep(0.3)  # PUB/SUB: let the subscriptions reach the publishers
        except BaseException:
            self.close()
            raise

    def prefix_map(self) -> dict:
        response = self.client.get("/debug/prefix-map", params={"format": "json"})
        response.raise_for_status()
        return response.json()

    def wait_for(self, predicate, timeout: float = 15.0) -> dict:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while True:
            data = self.prefix_map()
            if predicate(data):
                return data
            if time.monotonic() > deadline:
                raise AssertionError(f"gateway never reached the expected state: {data['backends']}")
            time.sleep(0.05)

    def cache(self, backend: str, tokens: np.ndarray, first_hash: int, *, medium: str = "GPU") -> None:
        """Announce `tokens` as cached on `backend` the way vLLM does after a prefill (or, with
        `medium` "CPU", after offloading them: the same block hashes, another medium)."""
        usable = len(tokens) - len(tokens) % 16
        hashes = list(range(first_hash, first_hash + usable // 16))
        self.publishers[backend].publish([block_stored(hashes, tokens[:usable].tolist(), 16, medium=medium)])

    def close(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        if hasattr(self, "gateway"):
            self.gateway.stop()
        for publisher in self.publishers.values():
            publisher.close()
        for backend in self.backends:
            backend.stop()
