"""Prefill/decode disaggregation end to end: a real gateway, a prefill-role and a decode-role simulated
engine (their own processes, KV events over ZMQ) handing the prompt's KV over through a real
redis-server. `mode: always` splits every request, so each test here sees a split."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvgate_testing.gateway import GatewayProcess, start_gateway
from kvgate_testing.pd_fleet import (
    LOAD_US_PER_TOKEN,
    MODEL,
    PREFILL_US_PER_TOKEN,
    STORE_US_PER_TOKEN,
    RoledFleet,
    gateway_metrics,
)

BLOCK = 16  # the simulated engines' KV block


@pytest.fixture(scope="module")
def split() -> Iterator[tuple[RoledFleet, GatewayProcess]]:
    with (
        RoledFleet({"prefill-0": "prefill", "decode-0": "decode"}) as fleet,
        start_gateway(fleet.gateway_config("always", min_observations=4)) as gateway,
    ):
        yield fleet, gateway


def debug_page(gateway: GatewayProcess) -> dict:
    return httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()


def decision_of(gateway: GatewayProcess, request_id: str) -> dict:
    decisions = debug_page(gateway)["disaggregation"]["decisions"]
    return next(d for d in decisions if d["request_id"] == request_id)


def test_a_split_request_prefills_on_the_prefill_engine_and_decodes_from_the_tier(split):
    fleet, gateway = split
    prefill_before, decode_before = fleet.counters("prefill-0"), fleet.counters("decode-0")
    body = {"model": MODEL, "prompt": "the tier carries it " * 120, "max_tokens": 8, "seed": 3}
    response = httpx.post(
        f"{gateway.url}/v1/completions", json=body, headers={"x-request-id": "split-whole"}, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-kvgate-backend"] == "decode-0"
    answer = response.json()
    prompt_tokens = answer["usage"]["prompt_tokens"]
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The decode engine computed only the last, partial block: the rest came from the tier.
    assert cached == (prompt_tokens - 1) // BLOCK * BLOCK
    assert answer["kv_transfer_params"]["loaded_tokens"] == cached
    prefill_after, decode_after = fleet.counters("prefill-0"), fleet.counters("decode-0")
    # The prefill engine ran the prompt once, for one token; the decode engine loaded it.
    assert prefill_after["vllm:request_success_total"] - prefill_before["vllm:request_success_total"] == 1
    assert (
        prefill_after["vllm:prompt_tokens_total"] - prefill_before["vllm:prompt_tokens_total"]
        == prompt_tokens
    )
    assert prefill_after["vllm:generation_tokens_total"] - prefill_before["vllm:generation_tokens_total"] == 1
    loaded = (
        decode_after["vllm:external_prefix_cache_hits_total"]
        - decode_before["vllm:external_prefix_cache_hits_total"]
    )
    assert loaded == cached
    decision = decision_of(gateway, "split-whole")
    assert (decision["option"], decision["prefill_backend"], decision["backend"]) == (
        "split",
        "prefill-0",
        "decode-0",
    )
    # The answer is the decode engine's own: the same request sent to it directly answers the same text.
    direct = httpx.post(f"{fleet.engine('decode-0').url}/v1/completions", json=body, timeout=30).json()
    assert direct["choices"][0]["text"] == answer["choices"][0]["text"]


def test_a_streamed_split_request_is_one_ordinary_event_stream_with_the_decode_usage(split):
    _, gateway = split
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "stream me a split answer " * 60}],
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/chat/completions",
        json=body,
        headers={"x-request-id": "split-stream"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-kvgate-backend"] == "decode-0"
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    content = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert sum(1 for piece in content if piece) == 12  # every token streamed, none from the prefill leg
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert decision_of(gateway, "split-stream")["option"] == "split"


def test_the_decision_names_its_choice_and_estimate_on_the_debug_page_and_in_metrics(split):
    _, gateway = split
    body = {"model": MODEL, "prompt": "estimate this " * 50, "max_tokens": 2}
    response = httpx.post(
        f"{gateway.url}/v1/completions", json=body, headers={"x-request-id": "split-shown"}, timeout=30
    )
    assert response.status_code == 200
    page = debug_page(gateway)
    assert page["disaggregation"]["roles"] == {"prefill-0": "prefill", "decode-0": "decode"}
    assert {name: entry["role"] for name, entry in page["backends"].items()} == page["disaggregation"][
        "roles"
    ]
    decision = decision_of(gateway, "split-shown")
    estimates = decision["estimates"]
    assert set(estimates) == {"colocated_gpu", "split"}
    split_estimate = estimates["split"]
    assert split_estimate["prefill_backend"] == "prefill-0"
    assert decision["estimate_s"] == split_estimate["total_s"] > 0
    # A split pays the transfer and the decode engine's load on top of the prefill a colocated run pays.
    assert split_estimate["transfer_s"] > 0 and split_estimate["load_s"] > 0
    page_html = httpx.get(f"{gateway.url}/debug/prefix-map", timeout=10).text
    assert "Prefill/decode decisions (mode always)" in page_html
    assert "split-shown" in page_html and "prefill-0 → decode-0" in page_html
    metrics = gateway_metrics(gateway.url)
    assert metrics['kvgate_pd_decisions_total{option="split"}'] >= 1
    assert metrics['kvgate_pd_prefill_seconds_per_token{backend="prefill-0"}'] > 0


def test_in_flight_load_is_back_to_zero_after_split_requests(split):
    _, gateway = split
    body = {"model": MODEL, "prompt": "count me out " * 40, "max_tokens": 3}
    for _ in range(3):
        assert httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30).status_code == 200
    backends = {b["name"]: b for b in httpx.get(f"{gateway.url}/backends", timeout=10).json()["backends"]}
    assert {name: (b["in_flight"], b["in_flight_prefill_tokens"]) for name, b in backends.items()} == {
        "prefill-0": (0, 0),
        "decode-0": (0, 0),
    }
    assert backends["prefill-0"]["role"] == "prefill"


def test_the_costs_are_learned_from_what_the_engines_report(split):
    _, gateway = split
    for index, words in enumerate((60, 240, 120, 360, 180, 300)):
        prompt = f"learning run {index}: " + "measure the engines " * words
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            response.read()
    costs = debug_page(gateway)["disaggregation"]["costs"]
    # The decode engine reports each load's seconds: the measured load cost is the engine's own.
    assert costs["decode-0"]["measured"]["load"]
    assert costs["decode-0"]["load_us_per_token"] == pytest.approx(LOAD_US_PER_TOKEN, rel=0.05)
    # The prefill engine's cost per computed token, fitted on its answers' times (a loose bound:
    # the fit's constant takes the HTTP round trips, the slope the simulated prefill).
    assert costs["prefill-0"]["measured"]["prefill"] and costs["prefill-0"]["measured"]["transfer"]
    assert PREFILL_US_PER_TOKEN / 3 < costs["prefill-0"]["prefill_us_per_token"] < PREFILL_US_PER_TOKEN * 3
    # Its reported store seconds: the simulated write plus a real Redis round trip.
    assert STORE_US_PER_TOKEN * 0.95 <= costs["prefill-0"]["transfer_us_per_token"] < STORE_US_PER_TOKEN * 2
    metrics = gateway_metrics(gateway.url)
    assert metrics['kvgate_pd_load_seconds_per_token{backend="decode-0"}'] == pytest.approx(
        LOAD_US_PER_TOKEN / 1e6, rel=0.05
    )


def test_a_request_the_engines_refuse_gets_their_error_without_another_prefill(split):
    _, gateway = split
    body = {"model": MODEL, "prompt": "refused " * 40, "max_tokens": 3, "temperature": -1}
    before = gateway_metrics(gateway.url).get(
        'kvgate_pd_prefill_failures_total{backend="prefill-0",reason="status"}', 0.0
    )
    response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
    # The decode engine, colocated, refuses it as the prefill engine did: the client sees vLLM's 400.
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "temperature"
    failures = gateway_metrics(gateway.url)[
        'kvgate_pd_prefill_failures_total{backend="prefill-0",reason="status"}'
    ]
    assert failures - before == 1
    backends = httpx.get(f"{gateway.url}/backends", timeout=10).json()["backends"]
    assert all(b["in_flight"] == 0 and b["healthy"] for b in backends)
