"""`tokenize: engine`: the prompt's tokens asked of a backend's POST /tokenize (a real HTTP server on
loopback with vLLM's answer shape), through the gateway's own upstream pool, and the answers that
leave a request without tokens (an error status, a body that is not a token list, one too long)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvgate_testing.in_thread_server import serving_in_thread
from kvgate_testing.tokenizers import config
from router.backends import BackendState
from router.policies.base import RouteRequest
from router.tokenize import RequestTokenizer
from router.tokenize import engine as engine_module
from router.upstream import UpstreamPool

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}


@dataclass
class TokenizeServer:
    """What the server received, from which client port, and what it answers next."""

    url: str = ""
    received: list[dict] = field(default_factory=list)
    client_ports: list[int] = field(default_factory=list)
    answer: Response | None = None  # None: vLLM's shape with tokens 1..4


@pytest.fixture
def tokenize_server() -> Iterator[TokenizeServer]:
    """A real HTTP server with vLLM's POST /tokenize answer shape, and a GET /peer that says which
    client port asked (to tell whether two calls shared a connection)."""
    state = TokenizeServer()

    async def tokenize(request: Request) -> Response:
        state.received.append(await request.json())
        state.client_ports.append(request.client.port)
        if state.answer is not None:
            return state.answer
        return JSONResponse({"tokens": [1, 2, 3, 4], "count": 4, "max_model_len": 2048})

    async def peer(request: Request) -> Response:
        return JSONResponse({"port": request.client.port})

    app = Starlette(routes=[Route("/tokenize", tokenize, methods=["POST"]), Route("/peer", peer)])
    with serving_in_thread(app, log_level="error") as url:
        state.url = url
        yield state


def _tokens(server: TokenizeServer, body: dict, pool: UpstreamPool | None = None) -> np.ndarray | None:
    backends = {"b1": BackendState(name="b1", url=server.url)}
    tokenizer = RequestTokenizer(config("engine"), backends, pool)

    async def run() -> np.ndarray | None:
        try:
            return await tokenizer.tokens_for("qwen", body)
        finally:
            await tokenizer.close()

    return asyncio.run(run())


def test_tokenize_engine_asks_the_backend(tokenize_server: TokenizeServer) -> None:
    tokens = _tokens(tokenize_server, CHAT)
    assert tokens is not None and tokens.tolist() == [1, 2, 3, 4]
    assert tokenize_server.received == [{"model": "qwen", "messages": CHAT["messages"], "tools": TOOLS}]


def test_tokenize_engine_goes_through_the_gateways_upstream_pool(tokenize_server: TokenizeServer) -> None:
    """Two prompts tokenized and then a probe of the same backend through the gateway's pool ride one
    keep-alive connection: the tokenizer uses that pool, and leaves it open when it closes."""
    backends = {"b1": BackendState(name="b1", url=tokenize_server.url)}
    pool = UpstreamPool(connect_timeout_s=5.0, max_connections=4)
    tokenizer = RequestTokenizer(config("engine"), backends, pool)

    async def run() -> int:
        try:
            for _ in range(2):
                tokens = await tokenizer.tokens_for("qwen", CHAT)
                assert tokens is not None and tokens.tolist() == [1, 2, 3, 4]
        finally:
            await tokenizer.close()
        status, body = await pool.get(f"{tokenize_server.url}/peer", 5.0)
        pool.close()
        assert status == 200
        return int(body.decode().split(":")[1].rstrip("}"))

    probe_port = asyncio.run(run())
    assert tokenize_server.client_ports == [probe_port, probe_port]


@pytest.mark.parametrize(
    "answer",
    [
        Response("no such model", status_code=404),
        Response("engine overloaded", status_code=503),
        JSONResponse({"count": 4}),  # no token list
        JSONResponse({"tokens": [1, -2, 3]}),  # not token ids
        Response(b"{not json", media_type="application/json"),
    ],
    ids=["404", "503", "no-tokens", "negative-id", "not-json"],
)
def test_a_bad_tokenize_answer_leaves_the_request_without_tokens(
    tokenize_server: TokenizeServer, answer: Response
) -> None:
    tokenize_server.answer = answer
    backends = {"b1": BackendState(name="b1", url=tokenize_server.url)}
    tokenizer = RequestTokenizer(config("engine"), backends)
    request = RouteRequest(request_id="r1", model="qwen", body=CHAT)

    async def run() -> None:
        try:
            await tokenizer.prepare(request)
        finally:
            await tokenizer.close()

    asyncio.run(run())
    assert request.tokens is None and tokenizer.failures == 1


def test_an_answer_over_the_bound_is_not_read_on(
    tokenize_server: TokenizeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bound lowered to 1 KiB so a small answer crosses it (the real one is 16 MiB).
    monkeypatch.setattr(engine_module, "MAX_ENGINE_TOKENIZE_BYTES", 1024)
    tokenize_server.answer = JSONResponse({"tokens": list(range(1000))})
    with pytest.raises(engine_module.TokenizeError, match="over 1024 bytes"):
        _tokens(tokenize_server, CHAT)
    tokenize_server.answer = JSONResponse({"tokens": list(range(100))})  # 390 bytes: read whole
    tokens = _tokens(tokenize_server, CHAT)
    assert tokens is not None and tokens.tolist() == list(range(100))
