"""The forwarded paths besides generation, as router/forward.py's FORWARDED_ROUTES says: a model the
engines know by another name (`served_name`) gets the client's whole body re-encoded with that
name, whatever the policy could route it by; /tokenize and /detokenize, which compute no KV cache,
go to the least-loaded backend without the policy. Real gateway process; a real HTTP backend
(uvicorn in a thread) that answers every path and records every body it gets."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvgate_testing.gateway import start_gateway
from kvgate_testing.in_thread_server import serving_in_thread

SERVED = "engine-model"


@pytest.fixture(scope="module")
def recording_backend():
    """An engine that answers every path and records (path, body) of each POST."""
    received: list[tuple[str, dict]] = []

    async def record(request: Request) -> JSONResponse:
        received.append((request.url.path, json.loads(await request.body())))
        return JSONResponse({"results": []})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": SERVED, "object": "model"}]})

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/{path:path}", record, methods=["POST"]),
        ]
    )
    with serving_in_thread(app) as url:
        yield url, received


def test_a_request_with_no_text_to_route_by_reaches_the_engine_whole_under_its_served_name(
    recording_backend,
):
    url, received = recording_backend
    received.clear()
    config = {
        "models": [{"name": "alias", "served_name": SERVED}],
        "backends": [{"name": "a", "url": url}],
    }
    # A rerank query given as token ids: no leading text to route by, so the request goes to the
    # least-loaded backend without the policy; its body must still be forwarded whole.
    body = {"model": "alias", "query": [101, 102, 103], "documents": ["first", "second"], "top_n": 1}
    with start_gateway(config) as gateway:
        answer = httpx.post(f"{gateway.url}/v1/rerank", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    [(path, forwarded)] = received
    assert path == "/v1/rerank"
    assert forwarded == {**body, "model": SERVED}


def test_tokenize_and_detokenize_bypass_the_policy(recording_backend):
    url, received = recording_backend
    received.clear()
    config = {
        "models": [{"name": "alias", "served_name": SERVED}],
        "backends": [{"name": "a", "url": url}],
        "policy": {"name": "kv_aware"},
    }
    with start_gateway(config) as gateway:
        for path, body in (("/tokenize", {"prompt": "count my tokens"}), ("/detokenize", {"tokens": [1, 2]})):
            answer = httpx.post(f"{gateway.url}{path}", json={"model": "alias", **body}, timeout=30)
            assert answer.status_code == 200, answer.text
        state = httpx.get(f"{gateway.url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()
    # kv_aware records every request it routes; these never reached it (and credited no prediction).
    assert state["decisions"] == []
    assert [path for path, _ in received[-2:]] == ["/tokenize", "/detokenize"]
