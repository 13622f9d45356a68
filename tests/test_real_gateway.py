"""The gateway (policy kv_aware) in front of two real vLLM engines, routing by their KV events.

- Issue 3: engines with vLLM's own prefix cache: prompts sharing a long prefix land on the engine
  that cached it, which reports cached_tokens > 0; /debug/prefix-map agrees with the events the
  engines themselves still buffer (read back over their replay sockets).
- Issue 6: engines with the cache layer (shared daemon) and a tiny GPU cache: the gateway takes
  both tiers from each engine's stream (vLLM's "GPU" blocks, the connector's "SHARED" chunks: the
  daemon's, reported by the engine that stored them) and routes by them: a prompt whose GPU blocks
  were evicted still goes where its chunks were reported (no `shared_tiers` configured here).
"""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from kvgate_testing.gateway import start_gateway
from kvgate_testing.vllm import (
    SERVED_MODEL,
    TINY_MODEL,
    cached_tokens,
    gateway_config,
    held_by_tier,
    long_text,
    replay_events,
    running_cache_daemon,
    running_vllms,
    wait_until,
    write_cache_config,
)

pytestmark = pytest.mark.real_engine


def complete(url: str, prompt: str) -> tuple[str, dict]:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text[:500]
    return response.headers.get("x-kvgate-backend", ""), response.json()


def lookup(gateway_url: str, tokens: list[int]) -> dict:
    """The gateway's LMCache-style /lookup: {backend: [medium, matched tokens]}."""
    return httpx.post(f"{gateway_url}/lookup", json={"tokens": tokens}, timeout=10).json()["layout_info"]


def prefix_map(gateway_url: str) -> dict:
    return httpx.get(f"{gateway_url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()


def gpu_tokens(gateway_url: str, backend: str) -> int:
    return prefix_map(gateway_url)["backends"][backend]["tokens"].get("gpu", 0)


def wait_connected(gateway_url: str, names: list[str]) -> None:
    def connected() -> bool:
        backends = prefix_map(gateway_url)["backends"]
        return all(backends[name]["connected"] for name in names)

    assert wait_until(connected, timeout_s=30), prefix_map(gateway_url)["backends"]


def test_shared_prefixes_land_on_the_engine_that_cached_them_and_the_prefix_map_agrees():
    engines_spec = [{"name": name, "connector": False} for name in ("engine-a", "engine-b")]
    with running_vllms(*engines_spec) as engines, start_gateway(gateway_config(engines)) as gateway:
        names = [engine.name for engine in engines]
        wait_connected(gateway.url, names)
        homes = {}
        for family, seed in (("x", 1), ("y", 2)):
            prefix = long_text(seed=seed)
            home, first = complete(gateway.url, f"{prefix} question 0")
            assert home in names
            assert cached_tokens(first) == 0
            homes[family] = home
            # The engine's BlockStored events reach the index before the follow-ups are routed.
            assert wait_until(lambda home=home: gpu_tokens(gateway.url, home) >= 512, timeout_s=15)
            for question in range(1, 4):
                backend, response = complete(gateway.url, f"{prefix} question {question}")
                assert backend == home, (
                    f"family {family} question {question} went to {backend}, cached on {home}; "
                    f"decision: {prefix_map(gateway.url)['decisions'][:1]}; backends: "
                    f"{prefix_map(gateway.url)['backends']}"
                )
                assert cached_tokens(response) >= 512
        # Two cold families: spread over the two engines rather than piled on one.
        assert homes["x"] != homes["y"]
        # Two more prompts straight to each engine: its next messages reach the gateway in order,
        # and go to the index undecoded (the wire scan reads vLLM's payloads); the check below
        # holds the index so built against the engine's own buffer.
        for number, engine in enumerate(engines):
            for extra in range(2):
                prompt = long_text(seed=10 + 2 * number + extra)
                body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1}
                assert httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120).status_code == 200

        # /debug/prefix-map against the events each engine still buffers for replay.
        def agrees() -> bool:
            backends = prefix_map(gateway.url)["backends"]
            for engine in engines:
                batches = replay_events(engine.replay_endpoint)
                held = held_by_tier(batches).get("gpu", {"blocks": 0, "tokens": 0})
                entry = backends[engine.name]
                if (
                    entry["blocks"].get("gpu", 0) != held["blocks"]
                    or entry["tokens"].get("gpu", 0) != held["tokens"]
                ):
                    return False
                if entry["last_seq"] != batches[-1][0]:
                    return False
            return True

        assert wait_until(agrees, timeout_s=15), prefix_map(gateway.url)["backends"]
        page = prefix_map(gateway.url)
        assert page["policy"] == "kv_aware"
        assert page["decisions"], "routing decisions are listed"
        for engine in engines:
            assert page["backends"][engine.name]["tokens"]["gpu"] > 0
            # vLLM's live payloads went to the index undecoded (the wire scan read them).
            entry = page["backends"][engine.name]
            assert entry["scanned_batches"] > 0, {key: entry.get(key) for key in ("batches", "last_seq")}


def test_the_gateway_routes_by_gpu_and_cpu_tier_events_of_engines_sharing_the_daemon(tmp_path):
    config = write_cache_config(tmp_path, chunk_size=256)
    with running_cache_daemon(chunk_size=256) as daemon:
        # 48 blocks of 32 tokens: a few 800-token prompts evict each other's GPU blocks.
        shared = {
            "cache_config": config,
            "cache_server": daemon.endpoint,
            "max_model_len": 1440,
            "extra_args": ["--num-gpu-blocks-override", "48"],
        }
        specs = [{"name": "engine-a", **shared}, {"name": "engine-b", **shared}]
        with (
            running_vllms(*specs) as (engine_a, engine_b),
            start_gateway(gateway_config([engine_a, engine_b])) as gateway,
        ):
            wait_connected(gateway.url, [engine_a.name, engine_b.name])
            tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
            cpu_prompt = long_text(seed=11, words=600)
            cpu_tokens = tokenizer.encode(cpu_prompt, add_special_tokens=False)
            whole_chunks = len(cpu_tokens) // 256 * 256
            assert whole_chunks >= 512

            # Engine A computes the prompt (stored in its GPU cache and, as chunks, in the daemon),
            # then other prompts push its blocks out of the small GPU cache.
            engine_a.complete(cpu_prompt, max_tokens=2)
            for filler in range(3):
                engine_a.complete(long_text(seed=100 + filler, words=600), max_tokens=2)

            # The index now holds the prompt on engine A in the daemon's (shared) tier only.
            assert wait_until(
                lambda: lookup(gateway.url, cpu_tokens).get(engine_a.name) == ["SHARED", whole_chunks],
                timeout_s=15,
            ), lookup(gateway.url, cpu_tokens)
            backend, response = complete(gateway.url, cpu_prompt + " and then")
            assert backend == engine_a.name, prefix_map(gateway.url)["decisions"][:1]
            assert cached_tokens(response) >= 512  # loaded by the connector: the GPU copy is gone

            # GPU tier: a prompt engine B computed goes back to engine B.
            gpu_prompt = long_text(seed=12, words=300)
            engine_b.complete(gpu_prompt, max_tokens=2)
            gpu_tokens_b = tokenizer.encode(gpu_prompt, add_special_tokens=False)
            assert wait_until(
                lambda: lookup(gateway.url, gpu_tokens_b).get(engine_b.name, [None])[0] == "GPU", timeout_s=15
            ), lookup(gateway.url, gpu_tokens_b)
            backend, response = complete(gateway.url, gpu_prompt + " and then")
            assert backend == engine_b.name, prefix_map(gateway.url)["decisions"][:1]
            assert cached_tokens(response) > 0

            tiers = {name: entry["tokens"] for name, entry in prefix_map(gateway.url)["backends"].items()}
            assert tiers[engine_a.name].get("shared", 0) >= whole_chunks
            assert "cpu" not in tiers[engine_a.name]  # the daemon's chunks are not its own CPU tier
            assert tiers[engine_b.name].get("gpu", 0) > 0
