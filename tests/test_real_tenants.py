"""Tenants apart on a real engine: `kvgate serve` salts each tenant's requests (auth.tenants), and
vLLM's own prefix cache, keyed by that cache_salt, never gives one tenant the other's blocks."""

from __future__ import annotations

import httpx
import pytest

from kvgate_testing.gateway import start_gateway
from kvgate_testing.vllm import (
    SERVED_MODEL,
    cached_tokens,
    gateway_config,
    long_text,
    running_vllms,
    wait_until,
)

pytestmark = pytest.mark.real_engine

KEYS = {"acme": "kvgate-real-acme-key-0011", "beta": "kvgate-real-beta-key-2233"}
ADMIN = "kvgate-real-admin-token-4455"


def engine_state(url: str) -> dict:
    headers = {"authorization": f"Bearer {ADMIN}"}
    prefix_map = httpx.get(f"{url}/debug/prefix-map?format=json", headers=headers, timeout=10)
    assert prefix_map.status_code == 200, prefix_map.text[:300]
    return prefix_map.json()["backends"]["engine-a"]


def complete(url: str, tenant: str, prompt: str) -> dict:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text[:500]
    return response.json()


def test_two_tenants_same_long_prompt_share_no_cached_tokens_on_vllm():
    with running_vllms({"name": "engine-a", "connector": False}) as engines:
        config = gateway_config(engines)
        config["auth"] = {"tenants": [{"name": name, "api_keys": [key]} for name, key in KEYS.items()]}
        config["admin"] = {"token": ADMIN}
        with start_gateway(config) as gateway:
            assert wait_until(lambda: engine_state(gateway.url)["connected"], timeout_s=30)
            prompt = long_text(seed=11)
            assert cached_tokens(complete(gateway.url, "acme", prompt)) == 0
            assert wait_until(lambda: engine_state(gateway.url)["tokens"].get("gpu", 0) >= 512, timeout_s=15)
            assert cached_tokens(complete(gateway.url, "acme", prompt)) >= 512
            # Same prompt, same engine, other tenant: vLLM's prefix cache is salted apart.
            assert cached_tokens(complete(gateway.url, "beta", prompt)) == 0
            assert cached_tokens(complete(gateway.url, "beta", prompt)) >= 512
