"""Prefill/decode disaggregation when something fails: a prefill engine down or too slow, a decode
engine down before its first byte, a store that lost the KV. Real gateway, simulated engines in their
own processes, a real redis-server; a crashing engine (kvgate_testing/crashing_engine.py) answers its
health probes and drops every request before answering.
No request hangs, and in-flight load is back to zero after each."""

from __future__ import annotations

import time

import httpx
import pytest

from kvgate_testing.gateway import GatewayProcess, start_gateway
from kvgate_testing.pd_fleet import MODEL, RoledFleet, gateway_metrics

# Each module starts its own simulated engines, redis-server and gateway (about 10 s of CPU on these
# machines): run with `make test-slow`; tests/test_pd_flow.py keeps the split itself in the default suite.
pytestmark = pytest.mark.slow

BLOCK = 16


def decision(gateway: GatewayProcess, request_id: str) -> dict:
    page = httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
    return next(d for d in page["disaggregation"]["decisions"] if d["request_id"] == request_id)


def post(gateway: GatewayProcess, request_id: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/completions", json=body, headers={"x-request-id": request_id}, timeout=30
    )


def loads(gateway: GatewayProcess) -> dict[str, tuple[int, int]]:
    backends = httpx.get(f"{gateway.url}/backends", timeout=10).json()["backends"]
    return {b["name"]: (b["in_flight"], b["in_flight_prefill_tokens"]) for b in backends}


def open_prefills(gateway: GatewayProcess) -> dict[str, int]:
    """Per engine, the prefills the cost model still counts as running (its lower bound's evidence)."""
    page = httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
    return {name: costs["open_prefills"] for name, costs in page["disaggregation"]["costs"].items()}


def test_failed_and_slow_prefill_engines_leave_the_request_colocated_after_one_retry_elsewhere():
    roles = {
        "prefill-down": "prefill",
        "prefill-slow": "prefill",
        "prefill-spare": "prefill",
        "decode-0": "decode",
    }
    # prefill-slow takes 50 ms per prompt token: seconds for this prompt, past the 0.5 s allowed.
    slow = {"prefill-slow": ["--prefill-us-per-token", "50000"]}
    with (
        RoledFleet(roles, sim_args=slow, crashing=("prefill-down", "prefill-spare")) as fleet,
        start_gateway(fleet.gateway_config("always", prefill_timeout_s=0.5)) as gateway,
    ):
        body = {"model": MODEL, "prompt": "a prefill that never comes " * 20, "max_tokens": 4}
        response = post(gateway, "prefill-fails", body)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvgate-backend"] == "decode-0"
        chosen = decision(gateway, "prefill-fails")
        assert chosen["option"] == "colocated_gpu" and chosen["prefill_failed"]
        failures = {
            name: value
            for name, value in gateway_metrics(gateway.url).items()
            if name.startswith("kvgate_pd_prefill_failures_total")
        }
        # Two prefill engines tried, each once (one retry elsewhere), never the third.
        assert sum(failures.values()) == 2
        assert len({name.split('backend="')[1].split('"')[0] for name in failures}) == 2
        assert gateway_metrics(gateway.url)['kvgate_pd_decisions_total{option="prefill_failed"}'] == 1
        # The colocated answer computed the whole prompt on the decode engine.
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert loads(gateway) == {name: (0, 0) for name in roles}
        # A failed or timed-out leg bounds no engine's prefill cost any more.
        assert set(open_prefills(gateway).values()) == {0}

        # A client that leaves while its prefill leg runs (on prefill-slow, the one engine not marked
        # down): the leg is dropped and every in-flight count is back to zero.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.2))
        deadline = time.monotonic() + 10
        while loads(gateway) != {name: (0, 0) for name in roles}:
            assert time.monotonic() < deadline, f"in-flight load never went back to zero: {loads(gateway)}"
            time.sleep(0.05)
        assert set(open_prefills(gateway).values()) == {0}


def test_a_decode_engine_down_before_its_first_byte_hands_the_request_to_another_that_loads_the_same_kv():
    roles = {"decode-down": "decode", "decode-0": "decode", "prefill-0": "prefill"}
    with (
        RoledFleet(roles, crashing=("decode-down",)) as fleet,
        start_gateway(fleet.gateway_config("always")) as gateway,
    ):
        prefills_before = fleet.counters("prefill-0")["vllm:request_success_total"]
        # The first decode choice of a fresh gateway is the first decode backend listed (kv_aware
        # deals cold prompts out in turn): the one that is down.
        response = post(
            gateway, "decode-fails", {"model": MODEL, "prompt": "decode it elsewhere " * 40, "max_tokens": 4}
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-kvgate-backend"] == "decode-0"
        metrics = gateway_metrics(gateway.url)
        assert metrics['kvgate_retries_total{backend="decode-down",reason="connect"}'] == 1
        # No prefill repeated: one prefill leg, and the second decode engine loaded its KV.
        assert fleet.counters("prefill-0")["vllm:request_success_total"] - prefills_before == 1
        usage = response.json()["usage"]
        assert (
            usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // BLOCK * BLOCK
        )
        assert decision(gateway, "decode-fails")["option"] == "split"
        assert loads(gateway) == {name: (0, 0) for name in roles}


def test_a_store_that_lost_the_kv_makes_the_decode_engine_recompute_and_counts_the_miss():
    # decode-0 reads a Redis of its own: empty, as a store is after a restart.
    roles = {"prefill-0": "prefill", "decode-0": "decode"}
    with (
        RoledFleet(roles, stores=("decode-0",)) as fleet,
        start_gateway(fleet.gateway_config("always")) as gateway,
    ):
        body = {"model": MODEL, "prompt": "the store forgot " * 50, "max_tokens": 6, "seed": 11}
        response = post(gateway, "store-lost", body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert decision(gateway, "store-lost")["option"] == "split"
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert "kv_transfer_params" not in answer  # nothing loaded
        assert gateway_metrics(gateway.url)["kvgate_pd_transfer_misses_total"] == 1
        # Still the right answer: the decode engine's own for this prompt.
        direct = httpx.post(f"{fleet.engine('decode-0').url}/v1/completions", json=body, timeout=30).json()
        assert direct["choices"][0]["text"] == answer["choices"][0]["text"]
        assert loads(gateway) == {name: (0, 0) for name in roles}
