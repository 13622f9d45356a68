"""kv_aware through the real gateway process: three test backends, each with a KV-event publisher
speaking vLLM's protocol; prompts cached on different backends must land there (x-kvgate-backend).
Also /debug/prefix-map (JSON), POST /lookup, and the admin token with prompt redaction."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvgate_testing.kv_fleet import DOCS, MODEL, Fleet, chat_body
from kvgate_testing.metrics import metric_samples, sample_key
from router.config import builtin_tokenizer_dir
from router.tokenize import PromptTokenizer


@pytest.fixture(scope="module")
def qwen3() -> PromptTokenizer:
    return PromptTokenizer(builtin_tokenizer_dir("qwen3"))


@pytest.fixture(scope="module")
def fleet(qwen3: PromptTokenizer) -> Iterator[Fleet]:
    fleet = Fleet()
    try:
        for n, (name, doc) in enumerate(DOCS.items()):
            # What the engine cached: the earlier request's prompt (same document, another question).
            fleet.cache(name, qwen3.tokens_for(chat_body(doc, "What is this about?")), 1000 * (n + 1))
        fleet.wait_for(lambda m: m["backends"]["b1"]["blocks"] and m["backends"]["b2"]["blocks"])
        yield fleet
    finally:
        fleet.close()


def test_prompts_land_on_the_backend_that_cached_their_prefix(fleet: Fleet) -> None:
    for round_ in range(3):
        for name, doc in DOCS.items():
            response = fleet.client.post(
                "/v1/chat/completions", json=chat_body(doc, f"Follow-up question {round_}?")
            )
            assert response.status_code == 200
            assert response.headers["x-kvgate-backend"] == name


def test_completions_with_a_cached_prefix_route_too(fleet: Fleet, qwen3: PromptTokenizer) -> None:
    text = "Plain completion prompt about lighthouse keepers and their logbooks, season after season. " * 5
    fleet.cache("b0", qwen3.tokens_for({"prompt": text}), 50_000)
    fleet.wait_for(lambda m: m["backends"]["b0"]["blocks"].get("gpu", 0) > 0)
    response = fleet.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": text + " And then?", "max_tokens": 2}
    )
    assert response.status_code == 200
    assert response.headers["x-kvgate-backend"] == "b0"


def test_prefix_map_json_shows_streams_prefixes_and_decisions(fleet: Fleet) -> None:
    fleet.client.post("/v1/chat/completions", json=chat_body(DOCS["b1"], "One more?"))
    data = fleet.prefix_map()
    b1 = data["backends"]["b1"]
    assert b1["connected"] is True
    assert b1["last_seq"] == 0
    assert b1["blocks"]["gpu"] > 0 and b1["tokens"]["gpu"] == 16 * b1["blocks"]["gpu"]
    assert b1["replays"] == 0 and b1["restarts"] == 0 and b1["uncertain"] is False
    assert b1["synced"] is True and b1["superseded_batches"] == 0
    texts = [p["text"] for p in data["prefixes"]]
    assert any("tidal energy" in text for text in texts)
    assert any("bookbinding" in text for text in texts)
    assert data["decisions"][0]["backend"] == "b1"
    assert data["decisions"][0]["reason"] == "cache_hit"
    assert data["decisions"][0]["cached_tokens"] >= 64


def test_lookup_answers_like_the_lmcache_controller(fleet: Fleet, qwen3: PromptTokenizer) -> None:
    tokens = qwen3.tokens_for(chat_body(DOCS["b2"], "What is this about?")).tolist()
    response = fleet.client.post("/lookup", json={"tokens": tokens})
    assert response.status_code == 200
    answer = response.json()
    assert answer["event_id"].startswith("Lookup")
    assert answer["layout_info"] == {"b2": ["GPU", len(tokens) - len(tokens) % 16]}
    assert fleet.client.post("/lookup", json={"tokens": [1, 2, 3]}).json()["layout_info"] == {}


@pytest.mark.parametrize("body", [b"not json", b'{"tokens": "abc"}', b'{"nothing": 1}', b'{"tokens": [-4]}'])
def test_lookup_rejects_bad_bodies_with_a_message(fleet: Fleet, body: bytes) -> None:
    response = fleet.client.post("/lookup", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "tokens" in response.json()["detail"]


def test_metrics_export_index_and_routing_counters(fleet: Fleet) -> None:
    """A request routed to its cached prefix moves the decision and cached-token counters; the
    index's event and lookup counters are on the same page."""
    cache_hit = sample_key("kvgate_route_decisions_total", policy="kv_aware", reason="cache_hit")
    cached = sample_key("kvgate_routed_prompt_tokens_total", kind="cached", policy="kv_aware")
    before = metric_samples(fleet.client.get("/metrics").text)
    response = fleet.client.post("/v1/chat/completions", json=chat_body(DOCS["b1"], "And the metrics?"))
    assert response.headers["x-kvgate-backend"] == "b1"
    after = metric_samples(fleet.client.get("/metrics").text)
    assert after[cache_hit] == before.get(cache_hit, 0.0) + 1
    assert after[cached] - before.get(cached, 0.0) >= 64  # the document's blocks
    assert after[sample_key("kvgate_kv_events_total", backend="b1", type="BlockStored")] == 1.0
    assert after[sample_key("kvgate_index_lookup_seconds_count")] >= 1
    assert any(name == "kvgate_index_router_keys" for name, _labels in after)


def test_admin_token_protects_the_page_and_redaction_hides_prompts(qwen3: PromptTokenizer) -> None:
    fleet = Fleet(admin={"token": "s3cret", "redact_prompts": True})
    try:
        fleet.cache("b1", qwen3.tokens_for(chat_body(DOCS["b1"], "What is this about?")), 1)
        data = fleet.wait_for(lambda m: m["prefixes"])
        assert "text" not in data["prefixes"][0] and "token_ids" not in data["prefixes"][0]
        assert data["prefixes"][0]["tokens"] > 0
        anonymous = httpx.get(f"{fleet.gateway.url}/debug/prefix-map", timeout=10)
        assert anonymous.status_code == 401
        assert httpx.post(f"{fleet.gateway.url}/lookup", json={"tokens": [1]}, timeout=10).status_code == 401
        page = fleet.client.get("/debug/prefix-map")
        assert page.status_code == 200 and "redacted" in page.text and "tidal" not in page.text
    finally:
        fleet.close()


def test_cold_prefixes_sent_one_at_a_time_spread_over_the_engines() -> None:
    # A fleet of its own: the module's fleet carries the recent prefills of the other tests,
    # which rightly steer cold prompts away from the engines that did them.
    fleet = Fleet()
    try:
        homes = []
        for n in range(3):
            doc = f"Cold document number {n} about an unrelated subject, repeated to make it long. " * 8
            response = fleet.client.post("/v1/chat/completions", json=chat_body(doc, "Question?"))
            assert response.status_code == 200
            homes.append(response.headers["x-kvgate-backend"])
        assert len(set(homes)) == 3, homes
    finally:
        fleet.close()


def test_a_prompt_still_being_answered_draws_the_requests_that_share_it(fleet: Fleet) -> None:
    # A non-streamed answer starts only when it is complete: the placement must count from the
    # moment the request is sent, or every request of a burst sharing a new prefix goes elsewhere.
    doc = "A brand new report on glacier retreat, measured by drones every spring and autumn. " * 60
    first: dict[str, httpx.Response] = {}

    def send_slow() -> None:
        with httpx.Client(base_url=fleet.gateway.url, timeout=30, headers=fleet.headers) as client:
            first["response"] = client.post(
                "/v1/chat/completions",
                json=chat_body(doc, "What was measured?"),
                headers={"x-test-delay-ms": "1500"},
            )

    def in_flight() -> int:
        listing = fleet.client.get("/backends").json()["backends"]
        return sum(backend["in_flight"] for backend in listing)

    slow = threading.Thread(target=send_slow)
    slow.start()
    try:
        deadline = time.monotonic() + 10
        while in_flight() == 0:  # until the slow request is at its backend
            assert time.monotonic() < deadline, "the slow request never reached a backend"
            time.sleep(0.02)
        assert "response" not in first  # its answer has not started
        follow_up = fleet.client.post("/v1/chat/completions", json=chat_body(doc, "How often?"))
    finally:
        slow.join()
    assert first["response"].status_code == 200 and follow_up.status_code == 200
    assert follow_up.headers["x-kvgate-backend"] == first["response"].headers["x-kvgate-backend"]


def test_the_policy_measures_load_costs_from_streamed_answers_only(fleet: Fleet) -> None:
    # x-test-delay-ms holds back the headers, so the first piece comes after 200 ms: the time the
    # gateway records is the time to it, and only a streamed answer's first piece means a first token.
    def observed() -> int:
        return fleet.prefix_map()["load_costs"]["observed"]

    before = observed()
    body = chat_body(DOCS["b1"], "Stream it?")
    streamed = fleet.client.post("/v1/chat/completions", json={**body, "stream": True},
                                 headers={"x-test-delay-ms": "200"})  # fmt: skip
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert observed() == before + 1
    whole = fleet.client.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200
    assert observed() == before + 1


def test_a_prefix_split_over_gpu_and_cpu_loses_to_the_whole_prefix_on_one_gpu(
    fleet: Fleet, qwen3: PromptTokenizer
) -> None:
    """b0 announces the prompt's first 256 tokens on its GPU and its first 512 offloaded to CPU (the
    same blocks, as vLLM's offloading reports them); b2 announces the first 512 on its GPU. b0 saves
    256 + 0.8 * 256 tokens, b2 saves 512: b2 wins. Scoring b0's CPU run whole, GPU head included,
    made b0 save 256 + 0.8 * 512 and win."""
    doc = "An atlas of lighthouse lenses, their makers, their flash patterns and keepers' logs. " * 40
    body = chat_body(doc, "Which lens flashed fastest?")
    tokens = qwen3.tokens_for(body)
    assert len(tokens) > 600
    gpu_before = fleet.prefix_map()["backends"]["b2"]["blocks"].get("gpu", 0)
    fleet.cache("b0", tokens[:256], 90_000)
    fleet.cache("b0", tokens[:512], 90_000, medium="CPU")
    fleet.cache("b2", tokens[:512], 95_000)
    fleet.wait_for(
        lambda m: (
            m["backends"]["b0"]["blocks"].get("cpu", 0) >= 32
            and m["backends"]["b2"]["blocks"].get("gpu", 0) >= gpu_before + 32
        )
    )
    response = fleet.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["x-kvgate-backend"] == "b2"
    decision = fleet.prefix_map()["decisions"][0]
    assert decision["backend"] == "b2" and decision["reason"] == "cache_hit"
    b0, b2 = decision["candidates"]["b0"], decision["candidates"]["b2"]
    assert b0["cached"] == b2["cached"] == 512
    assert b0["cost"] > b2["cost"]
