"""Forwarding through the real gateway process to real test backends: bytes pass through untouched,
SSE streams chunk by chunk, headers are kept or added, nothing is lost or duplicated under load."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from kvgate_testing.backend import TEST_MODEL
from kvgate_testing.gateway import gateway_config, start_gateway

MODEL = TEST_MODEL


@pytest.fixture(scope="module")
def gateway(backends):
    models = [{"name": MODEL}, {"name": "unserved-model"}, {"name": "alias-model", "served_name": MODEL}]
    config = gateway_config(backends, models=models, policy={"name": "round_robin"})
    with start_gateway(config) as running:
        yield running


@pytest.fixture
def client(gateway, backends):
    for backend in backends:
        backend.reset()
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        yield http


def test_json_answer_is_byte_identical_to_the_backends(client, backends):
    body = b'{"model": "test-model",   "prompt": "caf\xc3\xa9 \\u00e9", "max_tokens": 3}'
    headers = {"content-type": "application/json", "x-request-id": "req-json-1"}
    through_gateway = client.post("/v1/completions", content=body, headers=headers)
    assert through_gateway.status_code == 200
    serving = next(b for b in backends if b.name == through_gateway.headers["x-kvgate-backend"])
    direct = httpx.post(f"{serving.url}/v1/completions", content=body, headers=headers)
    assert through_gateway.content == direct.content
    # The request body reached the backend as the client sent it, byte for byte.
    assert serving.received()[0]["body"].encode() == body


def test_sse_stream_is_byte_identical_to_the_backends(client, backends):
    body = json.dumps({"model": MODEL, "prompt": "stream me", "stream": True}).encode()
    headers = {"content-type": "application/json", "x-request-id": "req-sse-1", "x-test-chunks": "7"}
    through_gateway = client.post("/v1/completions", content=body, headers=headers)
    assert through_gateway.headers["content-type"].startswith("text/event-stream")
    serving = next(b for b in backends if b.name == through_gateway.headers["x-kvgate-backend"])
    direct = httpx.post(f"{serving.url}/v1/completions", content=body, headers=headers)
    assert through_gateway.content == direct.content
    assert through_gateway.content.count(b"data: ") == 8  # 7 chunks and [DONE]


def test_first_sse_chunk_arrives_before_the_backend_has_finished(client):
    chunks, delay_ms = 5, 300
    headers = {"x-test-chunks": str(chunks), "x-test-chunk-delay-ms": str(delay_ms)}
    body = {"model": MODEL, "prompt": "slow stream", "stream": True}
    started = time.perf_counter()
    arrivals = []
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        for piece in response.iter_raw():
            if piece.strip():
                arrivals.append(time.perf_counter() - started)
    backend_duration = (chunks - 1) * delay_ms / 1000
    # The first piece came while the backend was still sending: at least half its sending time
    # before the last (buffered whole, they would come together). A ratio of the backend's own
    # pacing: a busy machine delays the first and the last piece alike.
    assert arrivals[-1] - arrivals[0] >= backend_duration / 2, arrivals
    # Pieces arrive spread out as the backend sends them, not in one buffered lump.
    assert len(arrivals) >= chunks


def test_chat_completions_are_forwarded_on_their_own_path(client, backends):
    response = client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 200
    received = [r for b in backends for r in b.received()]
    assert [r["path"] for r in received] == ["/v1/chat/completions"]


def test_request_id_is_kept_when_sent_and_generated_otherwise(client, backends):
    kept = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"x-request-id": "my-id-42"}
    )
    assert kept.headers["x-request-id"] == "my-id-42"
    generated = client.post("/v1/completions", json={"model": MODEL, "prompt": "y"})
    new_id = generated.headers["x-request-id"]
    assert len(new_id) == 32 and new_id != "my-id-42"
    ids_seen_by_backends = {r["request_id"] for b in backends for r in b.received()}
    assert ids_seen_by_backends == {"my-id-42", new_id}
    # Exactly one x-request-id on the response, even when the backend echoes its own.
    assert generated.headers.get_list("x-request-id") == [new_id]


def test_every_answer_names_its_backend(client, backends):
    names = [client.post("/v1/completions", json={"model": MODEL, "prompt": str(i)}) for i in range(4)]
    assert {r.headers["x-kvgate-backend"] for r in names} == {"a", "b"}
    for response in names:
        assert response.headers["x-kvgate-backend"] == response.json()["backend"]


def test_hop_by_hop_headers_are_dropped_and_others_forwarded(client, backends):
    client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "h"},
        headers={"authorization": "Bearer engine-key", "x-custom": "kept", "proxy-authorization": "secret"},
    )
    [received] = [r for b in backends for r in b.received()]
    assert received["headers"]["authorization"] == "Bearer engine-key"
    assert received["headers"]["x-custom"] == "kept"
    assert "proxy-authorization" not in received["headers"]


def test_models_lists_what_the_backends_report(client):
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list"
    # "unserved-model" is configured but no backend reports it: not listed, as vLLM would not.
    # "alias-model" is what the backends report as MODEL (its served_name).
    assert [card["id"] for card in listed["data"]] == [MODEL, "alias-model"]
    assert all(card["owned_by"] in ("a", "b") for card in listed["data"])  # the backends' own cards


def test_served_name_is_what_the_backend_receives(client, backends):
    response = client.post(
        "/v1/completions", json={"model": "alias-model", "prompt": "aliased", "max_tokens": 2}
    )
    assert response.status_code == 200
    [received] = [r for b in backends for r in b.received()]
    assert json.loads(received["body"]) == {"model": MODEL, "prompt": "aliased", "max_tokens": 2}


def test_health_and_metrics(client):
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "backends": {"a": "healthy", "b": "healthy"}}
    client.post("/v1/completions", json={"model": MODEL, "prompt": "count me"})
    metrics = client.get("/metrics").text
    for name in (
        "kvgate_requests_total",
        "kvgate_gateway_overhead_seconds_bucket",
        "kvgate_upstream_seconds_bucket",
        'kvgate_backend_in_flight{backend="a"}',
        "kvgate_retries_total",
        "kvgate_health_transitions_total",
    ):
        assert name in metrics
    assert 'kvgate_requests_total{backend="a",status="200"}' in metrics


def test_500_concurrent_requests_over_50_connections_lose_and_duplicate_nothing(gateway, backends):
    for backend in backends:
        backend.reset()

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=50, max_keepalive_connections=50)
        async with httpx.AsyncClient(base_url=gateway.url, limits=limits, timeout=60) as http:
            return await asyncio.gather(
                *(
                    http.post(
                        "/v1/completions",
                        json={"model": MODEL, "prompt": f"prompt {i}", "stream": i % 2 == 0},
                        headers={"x-request-id": f"load-{i}"},
                    )
                    for i in range(500)
                )
            )

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 500
    for i, response in enumerate(responses):
        assert response.headers["x-request-id"] == f"load-{i}"
        if i % 2:
            assert response.json()["request_id"] == f"load-{i}"
        else:
            assert response.text.endswith("data: [DONE]\n\n")
    received = [r["request_id"] for b in backends for r in b.received()]
    assert sorted(received) == sorted(f"load-{i}" for i in range(500))


def test_upstream_connections_are_kept_alive_and_reused(client, backends):
    for i in range(20):
        assert (
            client.post("/v1/completions", json={"model": MODEL, "prompt": f"reuse {i}"}).status_code == 200
        )
    for backend in backends:
        ports = {record["client_port"] for record in backend.received()}
        # Sequential requests: one pooled connection per backend (two if one expired meanwhile).
        assert 1 <= len(ports) <= 2, ports
