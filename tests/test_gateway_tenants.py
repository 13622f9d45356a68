"""Tenants apart: a client API key speaks for a tenant (auth.tenants), the tenant becomes the
request's cache_salt, and neither the router's credit nor the engine's prefix cache crosses tenants.

One simulated engine behind a kv_aware gateway, over real HTTP: every request lands on the same
engine, so the engine's own `cached_tokens` says whether the salt reached it, and the routing
decision's `cached_tokens` says what the router credited.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import httpx
import pytest

from kvgate_testing.backend import TEST_MODEL, running_backends
from kvgate_testing.gateway import GatewayProcess, gateway_config, simulated_fleet_config, start_gateway
from router.config import ConfigError, load_config

MODEL = "qwen3-tiny"
ACME_KEY = "kvgate-test-acme-key-0011"
BETA_KEY = "kvgate-test-beta-key-2233"
PLAIN_KEY = "kvgate-test-plain-key-4455"
ADMIN = "kvgate-test-admin-token-6677"


@pytest.fixture(scope="module")
def tenant_gateway() -> Iterator[GatewayProcess]:
    config = simulated_fleet_config(MODEL, "kv_aware", num_gpu_blocks=512, prefill_us_per_token=5, count=1)
    config["auth"] = {
        "api_keys": [PLAIN_KEY],
        "tenants": [
            {"name": "acme", "api_keys_env": ["KVGATE_TEST_ACME_KEYS"]},
            {"name": "beta", "api_keys": [BETA_KEY]},
        ],
    }
    config["admin"] = {"token": ADMIN}
    os.environ["KVGATE_TEST_ACME_KEYS"] = ACME_KEY
    try:
        gateway = start_gateway(config, timeout_s=180)
    finally:
        del os.environ["KVGATE_TEST_ACME_KEYS"]
    try:
        deadline = time.monotonic() + 90
        while True:
            state = _state(gateway)
            if state["backends"] and all(b["healthy"] and b["connected"] for b in state["backends"].values()):
                break
            assert time.monotonic() < deadline, f"the simulated engine never came up: {state['backends']}"
            time.sleep(0.2)
        time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher
        yield gateway
    finally:
        gateway.stop()


def _state(gateway: GatewayProcess) -> dict:
    headers = {"authorization": f"Bearer {ADMIN}"}
    return httpx.get(f"{gateway.url}/debug/prefix-map?format=json", headers=headers, timeout=10).json()


def _gpu_tokens(gateway: GatewayProcess) -> int:
    return _state(gateway)["backends"]["sim-0"]["tokens"].get("gpu", 0)


def _prompt(name: str) -> str:
    return f"{name}: " + " ".join(f"clause {i} of the {name} contract on item {i * 3}." for i in range(40))


def _complete(
    gateway: GatewayProcess, key: str, prompt: str, request_id: str, salt: str | None = None
) -> dict:
    """(engine's cached tokens, router's credited tokens) for one completion; waits until the
    engine's blocks reached the router's index, so the next request can be credited with them."""
    before = _gpu_tokens(gateway)
    body: dict = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(
        f"{gateway.url}/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {key}", "x-request-id": request_id},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    engine_cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    decisions = [d for d in _state(gateway)["decisions"] if d["request_id"] == request_id]
    assert decisions, f"no routing decision for {request_id}"
    deadline = time.monotonic() + 15
    while engine_cached == 0 and _gpu_tokens(gateway) <= before:
        assert time.monotonic() < deadline, "the engine never published the new blocks"
        time.sleep(0.05)
    return {"engine": engine_cached, "router": decisions[0]["cached_tokens"]}


def test_tenants_never_share_cached_kv_and_each_tenants_repeats_do(tenant_gateway):
    prompt = _prompt("shared")
    acme_first = _complete(tenant_gateway, ACME_KEY, prompt, "acme-1")
    assert acme_first == {"engine": 0, "router": 0}
    acme_again = _complete(tenant_gateway, ACME_KEY, prompt, "acme-2")
    assert acme_again["engine"] >= 160 and acme_again["router"] >= 160, acme_again
    # The same prompt on the same engine, from the other tenant: no credit, no hit.
    beta_first = _complete(tenant_gateway, BETA_KEY, prompt, "beta-1")
    assert beta_first == {"engine": 0, "router": 0}
    beta_again = _complete(tenant_gateway, BETA_KEY, prompt, "beta-2")
    assert beta_again["engine"] >= 160 and beta_again["router"] >= 160, beta_again
    # A key without a tenant keeps the unsalted cache, shared with neither tenant.
    plain = _complete(tenant_gateway, PLAIN_KEY, prompt, "plain-1")
    assert plain == {"engine": 0, "router": 0}


def test_a_client_salt_is_namespaced_under_its_own_tenant(tenant_gateway):
    prompt = _prompt("salted")
    # beta caches the prompt under its own salt, "beta".
    assert _complete(tenant_gateway, BETA_KEY, prompt, "salt-beta-1")["engine"] == 0
    # acme naming beta's salt gets "acme:beta": nothing of beta's.
    crossed = _complete(tenant_gateway, ACME_KEY, prompt, "salt-acme-1", salt="beta")
    assert crossed == {"engine": 0, "router": 0}
    # A client's own salt still partitions its own cache: the same salt repeats hit...
    repeat = _complete(tenant_gateway, ACME_KEY, prompt, "salt-acme-2", salt="beta")
    assert repeat["engine"] >= 160 and repeat["router"] >= 160, repeat
    # ...and the tenant's unsalted requests are another partition.
    assert _complete(tenant_gateway, ACME_KEY, prompt, "salt-acme-3") == {"engine": 0, "router": 0}


def test_anthropic_messages_are_salted_per_tenant_too(tenant_gateway):
    def send(key: str, request_id: str) -> dict:
        body = {
            "model": MODEL,
            "max_tokens": 1,
            "system": _prompt("anthropic"),
            "messages": [{"role": "user", "content": "Which clause applies?"}],
        }
        headers = {"authorization": f"Bearer {key}", "x-request-id": request_id}
        response = httpx.post(f"{tenant_gateway.url}/v1/messages", json=body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        decision = next(d for d in _state(tenant_gateway)["decisions"] if d["request_id"] == request_id)
        return {
            "engine": response.json()["usage"]["cache_read_input_tokens"],
            "router": decision["cached_tokens"],
        }

    before = _gpu_tokens(tenant_gateway)
    assert send(ACME_KEY, "messages-acme-1") == {"engine": 0, "router": 0}
    deadline = time.monotonic() + 15
    while _gpu_tokens(tenant_gateway) <= before:
        assert time.monotonic() < deadline, "the engine never published the new blocks"
        time.sleep(0.05)
    again = send(ACME_KEY, "messages-acme-2")
    assert again["engine"] >= 160 and again["router"] >= 160, again
    assert send(BETA_KEY, "messages-beta-1") == {"engine": 0, "router": 0}


def test_embeddings_are_salted_per_tenant_too(tenant_gateway):
    """vLLM's pooling requests take cache_salt: the engine computes each tenant's copy of the same
    input (its blocks grow again for the other tenant), and the router credits a tenant only with
    its own."""

    def embed(key: str, request_id: str) -> tuple[int, int]:
        """(the router's credit, the engine's GPU tokens gained) for one embedding request."""
        before = _gpu_tokens(tenant_gateway)
        body = {"model": MODEL, "input": _prompt("embedded")}
        headers = {"authorization": f"Bearer {key}", "x-request-id": request_id}
        response = httpx.post(f"{tenant_gateway.url}/v1/embeddings", json=body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        decision = next(d for d in _state(tenant_gateway)["decisions"] if d["request_id"] == request_id)
        deadline = time.monotonic() + 5
        while _gpu_tokens(tenant_gateway) <= before and time.monotonic() < deadline:
            time.sleep(0.05)  # new blocks, if any, reach the index
        return decision["cached_tokens"], _gpu_tokens(tenant_gateway) - before

    credit, gained = embed(ACME_KEY, "embed-acme-1")
    assert credit == 0 and gained >= 160
    credit, gained = embed(ACME_KEY, "embed-acme-2")
    assert credit >= 160 and gained == 0  # acme's own blocks: credited, and the engine computes nothing new
    credit, gained = embed(BETA_KEY, "embed-beta-1")
    assert credit == 0 and gained >= 160  # beta's salt reached the engine: its own copy


def test_unknown_keys_are_refused_and_tenants_are_counted(tenant_gateway):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    for headers in ({}, {"authorization": "Bearer not-a-key"}):
        response = httpx.post(f"{tenant_gateway.url}/v1/completions", json=body, headers=headers, timeout=10)
        assert response.status_code == 401
    bad_salt = {**body, "cache_salt": 7}
    response = httpx.post(
        f"{tenant_gateway.url}/v1/completions",
        json=bad_salt,
        headers={"authorization": f"Bearer {ACME_KEY}"},
        timeout=10,
    )
    assert response.status_code == 400 and "cache_salt" in response.text
    metrics = httpx.get(f"{tenant_gateway.url}/metrics", timeout=10).text
    assert 'kvgate_tenant_requests_total{status="400",tenant="acme"} 1.0' in metrics
    assert 'kvgate_tenant_requests_total{status="200",tenant="beta"}' in metrics
    assert 'tenant="not-a-key"' not in metrics


def test_a_tenants_request_to_a_served_name_reaches_the_engine_salted_and_renamed():
    # One body re-encoded with both (router/request_routing.py engine_body), as the picker sends it.
    models = [{"name": "client-name", "served_name": TEST_MODEL}]
    with running_backends("recorder", models=[TEST_MODEL]) as [backend]:
        auth = {"tenants": [{"name": "acme", "api_keys": [ACME_KEY]}]}
        config = gateway_config([backend], models=models, auth=auth, admin={"token": ADMIN})
        with start_gateway(config) as gateway:
            body = {"model": "client-name", "prompt": "hello", "max_tokens": 1}
            headers = {"authorization": f"Bearer {ACME_KEY}"}
            response = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=headers, timeout=10)
            assert response.status_code == 200, response.text
        [received] = backend.received()
    assert json.loads(received["body"]) == {**body, "model": TEST_MODEL, "cache_salt": "acme"}


def _load(tmp_path, auth: str) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text(
        f"models: [{{name: {MODEL}}}]\nbackends: [{{name: b0, url: 'http://127.0.0.1:1'}}]\n"
        f"admin: {{token: {ADMIN}}}\nauth: {auth}\n"
    )
    load_config(path)


def test_tenant_configuration_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match=r"auth.tenants\[0\].name.*no ':'"):
        _load(tmp_path, "{tenants: [{name: 'a:b', api_keys: [k1]}]}")
    with pytest.raises(ConfigError, match=r"tenant 'acme' is listed twice"):
        _load(tmp_path, "{tenants: [{name: acme, api_keys: [k1]}, {name: acme, api_keys: [k2]}]}")
    with pytest.raises(ConfigError, match=r"for tenant 'acme' and for tenant 'beta'"):
        _load(tmp_path, "{tenants: [{name: acme, api_keys: [k1]}, {name: beta, api_keys: [k1]}]}")
    with pytest.raises(ConfigError, match=r"for no tenant and for tenant 'acme'"):
        _load(tmp_path, "{api_keys: [k1], tenants: [{name: acme, api_keys: [k1]}]}")
    with pytest.raises(ConfigError, match=r"auth.tenants\[0\]`.*has no keys"):
        _load(tmp_path, "{tenants: [{name: acme}]}")
    with pytest.raises(ConfigError, match=r"KVGATE_TEST_UNSET.*auth.tenants\[0\].api_keys_env"):
        _load(tmp_path, "{tenants: [{name: acme, api_keys_env: [KVGATE_TEST_UNSET]}]}")
