"""Request content an attacker controls, against the real gateway process: client-supplied chat
templates, very large inputs to tokenize, deeply nested JSON. The gateway must answer with a clear
error or route without tokens, never stall its event loop (measured as /health latency during the
attack) and never flood its log with a traceback per request."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvgate_testing.backend import start_backend
from kvgate_testing.gateway import start_gateway
from router.config import builtin_tokenizer_dir, parse_config
from router.policies.base import RouteRequest
from router.template_sandbox import RENDER_TIMEOUT_S
from router.tokenize import PromptTokenizer, RequestTokenizer

MODEL = "test-model"
# About 250 bytes of request: 64M loop iterations (seconds of Jinja), the CVE-2025-61620 shape.
NESTED_LOOPS_TEMPLATE = "{% for i in range(8000) %}{% for j in range(8000) %}{% endfor %}{% endfor %}"
# Three nested loops: hours of rendering, unless the gateway stops it.
ENDLESS_TEMPLATE = (
    "{% for i in range(8000) %}{% for j in range(8000) %}{% for k in range(8000) %}"
    "{% endfor %}{% endfor %}{% endfor %}"
)
# A template a trusting operator's client might send: it must render exactly as the engine would.
PLAIN_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
# How much slower than the slowest /health answer before an attack the slowest during it may be.
# A stalled loop holds it for seconds: the templates above render for seconds to hours, and when run
# on the loop (or in the sandbox, past its 2 s time box) hold it that long. What the loop itself does
# for a large input (3M token ids converted in chunks) costs /health about 0.15 s on a quiet machine,
# and a few times that when the two cores are shared: a bound between the two, not a timing.
HEALTH_LIMIT_S = 1.0
# /health answers timed before the attack starts: the machine's own latency at the moment.
BASELINE_POLLS = 5


@pytest.fixture(scope="module")
def backend():
    started = start_backend("b0", [MODEL])
    yield started
    started.stop()


def gateway_config(backend, **model_settings) -> dict:
    return {
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3", **model_settings}],
        "backends": [{"name": "b0", "url": backend.url}],
        "policy": {"name": "kv_aware"},
    }


@pytest.fixture(scope="module")
def guarded(backend):
    with start_gateway(gateway_config(backend)) as running:
        yield running


@pytest.fixture(scope="module")
def trusting(backend):
    with start_gateway(gateway_config(backend, trust_request_chat_template=True)) as running:
        yield running


@pytest.fixture(scope="module")
def qwen3() -> PromptTokenizer:
    return PromptTokenizer(builtin_tokenizer_dir("qwen3"))


def chat(content: str | list = "Hello there", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}


def last_decision(url: str, request_id: str) -> dict:
    decisions = httpx.get(f"{url}/debug/prefix-map", params={"format": "json"}, timeout=10).json()[
        "decisions"
    ]
    return next(decision for decision in decisions if decision["request_id"] == request_id)


class HealthWatch:
    """Polls GET /health from a thread before and while an attack runs; `excess_s` is how much the
    slowest answer during the attack took over the slowest of the BASELINE_POLLS before it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                client.get(f"{self.url}/health")
                self.latencies.append(time.perf_counter() - started)
                time.sleep(0.02)

    @property
    def excess_s(self) -> float:
        baseline, during = self.latencies[:BASELINE_POLLS], self.latencies[BASELINE_POLLS:]
        return max(during, default=0.0) - max(baseline)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        while len(self.latencies) < BASELINE_POLLS:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def post_watching_health(
    client: httpx.Client, url: str, path: str, body: dict, headers: dict | None = None
) -> tuple[httpx.Response, float]:
    """POST `body` to the gateway; its response, and how much the worst /health latency while it
    ran took over the worst just before (HealthWatch.excess_s).

    The body is encoded before the watch starts: encoding megabytes here would hold this process's
    GIL, and the watch's thread with it."""
    content = json.dumps(body).encode()
    headers = {"content-type": "application/json", **(headers or {})}
    with HealthWatch(url) as watch:
        response = client.post(f"{url}{path}", content=content, headers=headers)
        # A poll in progress when the response came may be the one the attack held up.
        time.sleep(0.1)
    return response, watch.excess_s


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=20) as http:
        yield http


# ---- client-supplied chat templates ----


@pytest.mark.parametrize(
    "fields",
    [
        {"chat_template_kwargs": {"chat_template": NESTED_LOOPS_TEMPLATE}},
        {"chat_template": NESTED_LOOPS_TEMPLATE},
    ],
    ids=["in_chat_template_kwargs", "top_level"],
)
def test_request_chat_template_is_refused_by_default(guarded, client: httpx.Client, fields: dict) -> None:
    body = chat(**fields)
    response, excess_s = post_watching_health(client, guarded.url, "/v1/chat/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "chat_template"
    assert "chat template" in error["message"] and "trust_request_chat_template" in error["message"]
    assert excess_s < HEALTH_LIMIT_S


def routed_with_tokens(gateway, client: httpx.Client, body: dict, timeout_s: float = 90.0) -> dict:
    """The decision for `body`, sent until it is routed with tokens: the gateway starts its template
    sandbox in the background (transformers' import takes seconds) and routes by load meanwhile."""
    deadline = time.monotonic() + timeout_s
    for attempt in range(10_000):
        request_id = f"with-tokens-{attempt}-{time.monotonic_ns()}"
        response = client.post(
            f"{gateway.url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}
        )
        assert response.status_code == 200
        decision = last_decision(gateway.url, request_id)
        if decision["reason"] != "no_tokens" or time.monotonic() > deadline:
            return decision
        time.sleep(0.5)
    raise AssertionError("unreachable")


def test_trusted_client_template_renders_like_the_engine(
    trusting, client: httpx.Client, qwen3: PromptTokenizer
) -> None:
    body = chat("Tell me about tides.", chat_template_kwargs={"chat_template": PLAIN_TEMPLATE})
    decision = routed_with_tokens(trusting, client, body)
    text = qwen3.tokenizer.apply_chat_template(
        body["messages"], chat_template=PLAIN_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    expected = qwen3.tokenizer.encode(text, add_special_tokens=False)
    assert decision["reason"] != "no_tokens"
    assert decision["prompt_tokens"] == len(expected)


@pytest.mark.parametrize(
    ("kind", "template"),
    [
        ("memory", "{% set x = 'a' * 3000000000 %}{{ x|length }}"),  # 3 GB: over its address space
        ("output", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"),  # 100 MB: over the cap
        ("internals", "{{ ''.__class__.__mro__[1].__subclasses__() }}"),  # jinja's sandbox refuses
        ("mutation", "{{ messages.append(messages[0]) }}"),  # changing its inputs: refused too
    ],
    ids=["memory", "output", "internals", "mutation"],
)
def test_trusted_templates_stay_inside_the_sandbox(
    trusting, client: httpx.Client, kind: str, template: str
) -> None:
    plain = chat(chat_template_kwargs={"chat_template": PLAIN_TEMPLATE})
    routed_with_tokens(trusting, client, plain)
    url = f"{trusting.url}/v1/chat/completions"
    response = client.post(
        url, json=chat(chat_template=template), headers={"x-request-id": f"contained-{kind}"}
    )
    assert response.status_code == 200
    assert last_decision(trusting.url, f"contained-{kind}")["reason"] == "no_tokens"
    # The child refused the render and lives on: the next template renders at once.
    client.post(url, json=plain, headers={"x-request-id": f"next-{kind}"})
    assert last_decision(trusting.url, f"next-{kind}")["reason"] != "no_tokens"


def test_trusted_hostile_template_costs_a_bounded_time_and_does_not_stall(
    trusting, client: httpx.Client
) -> None:
    routed_with_tokens(trusting, client, chat(chat_template_kwargs={"chat_template": PLAIN_TEMPLATE}))
    body = chat(chat_template_kwargs={"chat_template": ENDLESS_TEMPLATE})
    started = time.perf_counter()
    response, excess_s = post_watching_health(
        client, trusting.url, "/v1/chat/completions", body, {"x-request-id": "endless-1"}
    )
    assert excess_s < HEALTH_LIMIT_S
    assert response.status_code == 200  # routed without tokens, as an untokenizable request is
    # The render is stopped at the sandbox's time box instead of running for hours: a bound on a
    # hang (five time boxes), not a timing.
    assert time.perf_counter() - started < 5 * RENDER_TIMEOUT_S
    assert last_decision(trusting.url, "endless-1")["reason"] == "no_tokens"


# ---- large inputs ----


def large_tools(total_bytes: int) -> list[dict]:
    description = "Looks up a record by key and returns every field of it in order. " * 150
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": description,
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
    return [tool] * (total_bytes // len(description))


@pytest.mark.parametrize(
    "body",
    [
        chat(tools=large_tools(20_000_000)),
        {"model": MODEL, "prompt": [9] * 3_000_000, "max_tokens": 2},
    ],
    ids=["tools_20MB", "token_ids_3M"],
)
def test_large_inputs_do_not_stall_the_gateway(guarded, client: httpx.Client, body: dict) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response, excess_s = post_watching_health(client, guarded.url, path, body)
    assert response.status_code == 200
    assert response.headers["x-kvgate-backend"] == "b0"
    assert excess_s < HEALTH_LIMIT_S


@pytest.fixture(scope="module")
def request_tokenizer() -> Iterator[RequestTokenizer]:
    config = parse_config(
        {
            "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
            "backends": [{"name": "b0", "url": "http://127.0.0.1:9"}],
        }
    )
    tokenizer = RequestTokenizer(config)
    yield tokenizer
    asyncio.run(tokenizer.close())


@pytest.mark.parametrize(
    "body",
    [
        chat(tools=large_tools(200_000)),
        chat([{"type": "text", "text": "A part."}] * 20_000),
        {"model": MODEL, "prompt": [9] * 30_000},
    ],
    ids=["tools", "content_parts", "token_ids"],
)
def test_bodies_large_besides_their_text_are_tokenized_off_the_loop(
    request_tokenizer: RequestTokenizer, qwen3: PromptTokenizer, body: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tools, content parts and token ids cost Python work in proportion to their size, but their
    text is short: the thread takes them on the body's size, with the same tokens as on the loop."""
    prompt_tokenizer = request_tokenizer.tokenizer(MODEL)
    assert prompt_tokenizer is not None
    threads: list[bool] = []
    original = prompt_tokenizer.prompt_text

    def recording(body: dict):  # type: ignore[no-untyped-def]
        threads.append(threading.get_ident() != loop_thread)
        return original(body)

    monkeypatch.setattr(prompt_tokenizer, "prompt_text", recording)
    loop_thread = threading.get_ident()
    request = RouteRequest("r1", MODEL, body, body_size=len(json.dumps(body)))
    asyncio.run(request_tokenizer.prepare(request))
    assert threads == [True]
    assert request.tokens is not None
    assert request.tokens.tolist() == qwen3.tokens_for(body).tolist()


def test_model_template_chat_still_routes_with_its_tokens(
    guarded, client: httpx.Client, qwen3: PromptTokenizer
) -> None:
    body = chat("What is the capital of Norway?", chat_template_kwargs={"enable_thinking": False})
    response = client.post(
        f"{guarded.url}/v1/chat/completions", json=body, headers={"x-request-id": "parity-1"}
    )
    assert response.status_code == 200
    decision = last_decision(guarded.url, "parity-1")
    assert decision["prompt_tokens"] == len(qwen3.tokens_for(body))


# ---- parsing ----


def nested_body(levels: int) -> bytes:
    return b'{"model": "test-model", "messages": ' + b"[" * levels + b"]" * levels + b"}"


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/v1/chat/completions", {}),
        ("/v1/chat/completions", {"connection": "close"}),
        ("/lookup", {}),
    ],
    ids=["direct_path", "asgi_path", "starlette_route"],
)
def test_deeply_nested_json_is_a_400_without_a_traceback_per_request(
    guarded, path: str, headers: dict
) -> None:
    before = guarded.process.output().count("Traceback")
    for _ in range(20):
        response = httpx.post(
            f"{guarded.url}{path}",
            content=nested_body(100_000),
            headers={"content-type": "application/json", **headers},
            timeout=20,
        )
        assert response.status_code == 400
        assert "nested" in response.text
    assert guarded.process.output().count("Traceback") - before <= 1
