"""Two real vLLM instances that share nothing but a redis-server (the remote tier).

Each engine has its own in-process store (its own L1, its own process). Instance B has never seen
the prompt: its hit can only come from the chunks instance A wrote through to Redis. The greedy
outputs of the cold and the hit request must be identical: the remote tier changes speed, never
results.
"""

from __future__ import annotations

import time

import pytest

from kvgate_testing.vllm import (
    cached_tokens,
    greedy_output,
    prompt_tokens,
    running_vllms,
    wait_until,
    write_cache_config,
)

pytestmark = pytest.mark.real_engine

CHUNK = 256


def test_instance_b_hits_in_redis_what_instance_a_stored(tmp_path, redis_server):
    config = write_cache_config(tmp_path, chunk_size=CHUNK, remote_url=redis_server.url)
    prompt = prompt_tokens(700, seed=5)
    with (
        redis_server.client() as client,
        running_vllms(
            {"name": "vllm-a", "cache_config": config, "kv_events": False},
            {"name": "vllm-b", "cache_config": config, "kv_events": False},
        ) as (engine_a, engine_b),
    ):
        started = time.perf_counter()
        cold = engine_a.complete(prompt, max_tokens=12)
        cold_s = time.perf_counter() - started
        # The write-through is asynchronous: wait for A's two whole chunks (and its tail) in Redis.
        assert wait_until(lambda: len(client.keys("cachelayer:*")) >= 2, timeout_s=30)
        started = time.perf_counter()
        hit = engine_b.complete(prompt, max_tokens=12)
        hit_s = time.perf_counter() - started
    print(f"request time cold on A {cold_s * 1e3:.0f} ms, remote hit on B {hit_s * 1e3:.0f} ms")
    assert cached_tokens(cold) == 0
    assert cached_tokens(hit) >= 2 * CHUNK  # B loaded A's chunks from Redis
    reference_tokens, reference_logprobs = greedy_output(cold)
    tokens, logprobs = greedy_output(hit)
    assert tokens == reference_tokens
    assert logprobs == pytest.approx(reference_logprobs, abs=1e-3)
