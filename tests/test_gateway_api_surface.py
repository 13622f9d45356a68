"""The API surface users of vLLM and sglang-router expect, through the real gateway process:
GET /v1/models/{id}; /v1/embeddings, rerank, score, /tokenize and /detokenize forwarded to real
(simulated) engines and routed by their prompt's cached prefix; the Responses and Anthropic
Messages APIs through the official `openai` and `anthropic` clients; one error shape for the
gateway and the engines; client API keys; and the command lines (`kvgate --version`,
KVGATE_CONFIG, --help with defaults, `cachelayer` subcommands)."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from kvgate_testing.backend import start_backend
from kvgate_testing.gateway import GatewayProcess, simulated_fleet_config, start_gateway
from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, ManagedProcess, python_command, wait_for_http

MODEL = "tiny-qwen3"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        python_command(*args),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
    )


# ---- GET /v1/models/{id} ----


def test_model_by_id_answers_its_card_or_a_404_in_the_openai_shape():
    backend = start_backend("b0", ["org/model-a"])
    try:
        config = {
            "models": [{"name": "org/model-a"}, {"name": "model-b"}],
            "backends": [{"name": "b0", "url": backend.url}],
        }
        with start_gateway(config) as gateway:
            card = httpx.get(f"{gateway.url}/v1/models/org/model-a", timeout=10)
            assert card.status_code == 200, card.text
            assert card.json()["id"] == "org/model-a"
            assert card.json()["object"] == "model"
            # Configured, but no backend reports it: as absent from the list, so from here.
            for missing in ("model-b", "no-such-model"):
                answer = httpx.get(f"{gateway.url}/v1/models/{missing}", timeout=10)
                assert answer.status_code == 404
                error = answer.json()["error"]
                assert error["code"] == 404 and error["type"] == "NotFoundError" and error["param"] == "model"
                assert missing in error["message"]
    finally:
        backend.stop()


# ---- forwarded pooling and tokenizer paths, on simulated engines ----


@pytest.fixture(scope="module")
def sim_gateway() -> Iterator[GatewayProcess]:
    """kv_aware over two simulated engines that publish KV events (started by the gateway)."""
    config = simulated_fleet_config(MODEL, "kv_aware", num_gpu_blocks=512, prefill_us_per_token=5)
    gateway = start_gateway(config, timeout_s=180)
    try:
        deadline = time.monotonic() + 90
        while True:
            state = httpx.get(f"{gateway.url}/debug/prefix-map?format=json", timeout=10).json()
            backends = state["backends"].values()
            if len(backends) == 2 and all(b["healthy"] and b["connected"] for b in backends):
                break
            assert time.monotonic() < deadline, f"the simulated engines never came up: {state['backends']}"
            time.sleep(0.2)
        time.sleep(0.3)  # PUB/SUB: let the subscriptions reach the publishers
        yield gateway
    finally:
        gateway.stop()


def _wait_cached(gateway: GatewayProcess, backend: str, tokens: int) -> None:
    deadline = time.monotonic() + 15
    while True:
        state = httpx.get(f"{gateway.url}/debug/prefix-map?format=json", timeout=10).json()
        if state["backends"][backend]["tokens"].get("gpu", 0) >= tokens:
            return
        assert time.monotonic() < deadline, f"{backend} never published its blocks: {state['backends']}"
        time.sleep(0.05)


def _document(n: int) -> str:
    return " ".join(f"document {n} sentence {i} about topic {n * 7 + i}." for i in range(40))


def test_embeddings_rerank_and_score_land_where_their_prompt_is_cached(sim_gateway):
    gateway = sim_gateway
    placed: dict[int, str] = {}
    for n in range(4):
        document = _document(n)
        completion = httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": MODEL, "prompt": document, "max_tokens": 1},
            timeout=30,
        )
        assert completion.status_code == 200, completion.text
        placed[n] = completion.headers["x-kvgate-backend"]
        _wait_cached(gateway, placed[n], 16)
    assert len(set(placed.values())) == 2, f"cold documents should spread over both engines: {placed}"

    for n, backend in placed.items():
        document = _document(n)
        embedding = httpx.post(
            f"{gateway.url}/v1/embeddings", json={"model": MODEL, "input": document}, timeout=30
        )
        assert embedding.status_code == 200, embedding.text
        assert embedding.headers["x-kvgate-backend"] == backend, f"document {n}: embedding left its cache"
        assert embedding.json()["object"] == "list"
        assert len(embedding.json()["data"][0]["embedding"]) > 0

        rerank = httpx.post(
            f"{gateway.url}/v1/rerank",
            json={"query": document, "documents": ["topic words", document]},
            timeout=30,
        )
        assert rerank.status_code == 200, rerank.text
        assert rerank.headers["x-kvgate-backend"] == backend, f"document {n}: rerank left its cache"
        assert rerank.json()["results"][0]["index"] == 1

        score = httpx.post(
            f"{gateway.url}/score", json={"model": MODEL, "text_1": document, "text_2": "x"}, timeout=30
        )
        assert score.status_code == 200, score.text
        assert score.headers["x-kvgate-backend"] == backend, f"document {n}: score left its cache"

    decisions = httpx.get(f"{gateway.url}/debug/prefix-map?format=json", timeout=10).json()["decisions"]
    assert sum(1 for decision in decisions if decision["reason"] == "cache_hit") >= 12


def test_tokenize_and_detokenize_are_forwarded_and_round_trip(sim_gateway):
    gateway = sim_gateway
    text = "Tokenizers turn text into ids and back."
    # `model` is optional on these paths (vLLM's and SGLang's too): the one configured model.
    tokenized = httpx.post(f"{gateway.url}/tokenize", json={"prompt": text}, timeout=30)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.headers["x-kvgate-backend"].startswith("sim")
    tokens = tokenized.json()["tokens"]
    assert tokenized.json()["count"] == len(tokens) > 0
    detokenized = httpx.post(f"{gateway.url}/detokenize", json={"model": MODEL, "tokens": tokens}, timeout=30)
    assert detokenized.status_code == 200, detokenized.text
    assert detokenized.json()["prompt"] == text
    # What a path needs is checked before anything is forwarded.
    missing = httpx.post(f"{gateway.url}/detokenize", json={"model": MODEL}, timeout=30)
    assert missing.status_code == 400
    assert "`tokens`" in missing.json()["error"]["message"]


# ---- the Responses and Anthropic Messages APIs, through their official clients ----


def _gpu_tokens(gateway: GatewayProcess, backend: str) -> int:
    state = httpx.get(f"{gateway.url}/debug/prefix-map?format=json", timeout=10).json()
    return state["backends"][backend]["tokens"].get("gpu", 0)


def _decision(gateway: GatewayProcess, request_id: str) -> dict:
    decisions = httpx.get(f"{gateway.url}/debug/prefix-map?format=json", timeout=10).json()["decisions"]
    found = [decision for decision in decisions if decision["request_id"] == request_id]
    assert found, f"no routing decision for {request_id}"
    return found[0]


def _profile(api: str, n: int) -> str:
    """A long system prompt of its own per API and number (no other test's prompt starts like it)."""
    return f"{api} profile {n}: " + " ".join(
        f"rule {i} of {api} assistant {n} on topic {n * 9 + i}." for i in range(40)
    )


def test_openai_responses_client_repeats_land_on_the_engine_that_caches_them(sim_gateway):
    gateway = sim_gateway
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=30)
    placed: dict[int, str] = {}
    for n in range(4):
        before = {name: _gpu_tokens(gateway, name) for name in ("sim-0", "sim-1")}
        raw = client.responses.with_raw_response.create(
            model=MODEL,
            instructions=_profile("responses", n),
            input="Which rule applies?",
            max_output_tokens=2,
            extra_headers={"x-request-id": f"responses-cold-{n}"},
        )
        first = raw.parse()
        placed[n] = raw.headers["x-kvgate-backend"]
        assert first.usage.input_tokens_details.cached_tokens == 0 and first.output_text
        # The gateway tokenized the request as the engine did: its prompt, token for token in count.
        assert _decision(gateway, f"responses-cold-{n}")["prompt_tokens"] == first.usage.input_tokens
        _wait_cached(gateway, placed[n], before[placed[n]] + 16)
    assert len(set(placed.values())) == 2, f"cold prompts should spread over both engines: {placed}"

    for n, backend in placed.items():
        # The same instructions, a new question, streamed: routed to the engine that holds the prefix.
        raw = client.responses.with_raw_response.create(
            model=MODEL,
            instructions=_profile("responses", n),
            input=[{"role": "user", "content": [{"type": "input_text", "text": "And the next one?"}]}],
            max_output_tokens=3,
            stream=True,
            extra_headers={"x-request-id": f"responses-repeat-{n}"},
        )
        assert raw.headers["x-kvgate-backend"] == backend, f"prompt {n} left the engine that caches it"
        decision = _decision(gateway, f"responses-repeat-{n}")
        assert decision["reason"] == "cache_hit" and decision["cached_tokens"] >= 16 * 10, decision
        events = list(raw.parse())
        kinds = [event.type for event in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert kinds.count("response.output_text.delta") == 3
        final = events[-1].response
        assert final.usage.input_tokens_details.cached_tokens >= 16 * 10, final.usage
        assert final.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_anthropic_client_repeats_land_on_the_engine_that_caches_them(sim_gateway):
    gateway = sim_gateway
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=30)
    placed: dict[int, str] = {}
    for n in range(4):
        before = {name: _gpu_tokens(gateway, name) for name in ("sim-0", "sim-1")}
        raw = client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=2,
            system=_profile("messages", n),
            messages=[{"role": "user", "content": "Which rule applies?"}],
            extra_headers={"x-request-id": f"messages-cold-{n}"},
        )
        message = raw.parse()
        placed[n] = raw.headers["x-kvgate-backend"]
        assert message.stop_reason == "max_tokens" and message.content[0].text
        assert message.usage.cache_read_input_tokens == 0
        assert _decision(gateway, f"messages-cold-{n}")["prompt_tokens"] == message.usage.input_tokens
        _wait_cached(gateway, placed[n], before[placed[n]] + 16)
    assert len(set(placed.values())) == 2, f"cold prompts should spread over both engines: {placed}"

    for n, backend in placed.items():
        repeat = client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=2,
            system=[{"type": "text", "text": _profile("messages", n)}],
            messages=[{"role": "user", "content": [{"type": "text", "text": "And the next one?"}]}],
            extra_headers={"x-request-id": f"messages-repeat-{n}"},
        )
        assert repeat.headers["x-kvgate-backend"] == backend, f"prompt {n} left the engine that caches it"
        decision = _decision(gateway, f"messages-repeat-{n}")
        assert decision["reason"] == "cache_hit" and decision["cached_tokens"] >= 16 * 10, decision
        assert repeat.parse().usage.cache_read_input_tokens >= 16 * 10
        with client.messages.stream(
            model=MODEL,
            max_tokens=3,
            system=_profile("messages", n),
            messages=[{"role": "user", "content": "Streamed, please."}],
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
            assert stream.response.headers["x-kvgate-backend"] == backend
        assert text and final.content[0].text == text
        assert final.usage.output_tokens == 3 and final.usage.cache_read_input_tokens >= 16 * 10
        # vLLM's count_tokens is forwarded too (by load: it computes no KV cache).
        counted = client.messages.count_tokens(
            model=MODEL,
            system=_profile("messages", n),
            messages=[{"role": "user", "content": "Streamed, please."}],
        )
        assert counted.input_tokens == final.usage.input_tokens


def test_the_gateway_and_the_engines_answer_errors_in_one_shape(sim_gateway):
    """The same kind of bad request gets the same error body from the gateway (which refuses it
    itself, or forwards the engine's answer) and from a simulated engine asked directly."""
    gateway = sim_gateway
    engine = httpx.get(f"{gateway.url}/backends", timeout=10).json()["backends"][0]["url"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases = {
        "bad JSON": ("/v1/chat/completions", b"{not json"),
        "unknown model": ("/v1/chat/completions", {**chat, "model": "no-such-model"}),
        "missing messages": ("/v1/chat/completions", {"model": MODEL}),
        # The schema first, the model after it (vLLM's order): a 400, not a 404.
        "unknown model, no messages": ("/v1/chat/completions", {"model": "no-such-model"}),
        "missing input": ("/v1/responses", {"model": MODEL}),
        "missing messages (Anthropic)": ("/v1/messages", {"model": MODEL, "max_tokens": 1}),
        "temperature not a number": ("/v1/chat/completions", {**chat, "temperature": "hot"}),
        "negative temperature": ("/v1/responses", {"model": MODEL, "input": "hi", "temperature": -1}),
        "unknown role": ("/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [{"role": "wizard"}]}),
    }
    for kind, (path, body) in cases.items():
        answers = []
        for url in (gateway.url, engine):
            if isinstance(body, bytes):
                response = httpx.post(url + path, content=body, timeout=30)
            else:
                response = httpx.post(url + path, json=body, timeout=30)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, (kind, url, error)
            answers.append((response.status_code, error["type"], error["param"], error["code"]))
        assert answers[0] == answers[1], f"{kind}: gateway {answers[0]}, engine {answers[1]}"
        assert answers[0][0] in (400, 404) and answers[0][0] == answers[0][3]


# ---- client API keys ----


KEY_ONE = "kvgate-test-key-one-0123456789abcdef"
KEY_TWO = "kvgate-test-key-two-fedcba9876543210"


@pytest.fixture(scope="module")
def keyed_gateway() -> Iterator[GatewayProcess]:
    backend = start_backend("b0", [MODEL])
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": "b0", "url": backend.url}],
        "auth": {"api_keys_env": ["KVGATE_TEST_API_KEYS"]},
        # Client keys need an admin token of their own (router/config.py, check_admin_exposure).
        "admin": {"token": "kvgate-test-admin-token-00112233"},
    }
    os.environ["KVGATE_TEST_API_KEYS"] = f"{KEY_ONE}, {KEY_TWO}"
    try:
        gateway = start_gateway(config)
    finally:
        del os.environ["KVGATE_TEST_API_KEYS"]
    try:
        yield gateway
    finally:
        gateway.stop()
        backend.stop()


def _raw_post(url: str, path: str, headers: dict[str, str], close: bool) -> tuple[int, bytes]:
    """One POST over a fresh socket; `Connection: close` makes the gateway take its ASGI path."""
    host, port = url.removeprefix("http://").split(":")
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 1}' % MODEL.encode()
    lines = [f"POST {path} HTTP/1.1", f"host: {host}", "content-type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines += [f"content-length: {len(body)}", "connection: close" if close else "connection: keep-alive"]
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        status = int(data.split(b" ", 2)[1])
        return status, data


@pytest.mark.parametrize("close", [False, True], ids=["direct path", "ASGI path"])
def test_every_configured_key_opens_the_api_and_nothing_else_does(keyed_gateway, close):
    url = keyed_gateway.url
    for key in (KEY_ONE, KEY_TWO):
        status, _ = _raw_post(url, "/v1/completions", {"authorization": f"Bearer {key}"}, close)
        assert status == 200
    refused = [
        {},
        {"authorization": f"Bearer {KEY_ONE[:-1]}"},
        {"authorization": f"Bearer {KEY_ONE}x"},
        {"authorization": f"Basic {KEY_ONE}"},
        {"authorization": "Bearer"},
    ]
    for headers in refused:
        status, answer = _raw_post(url, "/v1/completions", headers, close)
        assert status == 401, headers
        assert b"www-authenticate: bearer" in answer.lower()


def test_keys_guard_every_route_but_health_and_metrics(keyed_gateway):
    url = keyed_gateway.url
    for method, path in [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("POST", "/v1/embeddings"),
                         ("POST", "/tokenize"), ("GET", "/backends"), ("GET", "/no/such/route")]:  # fmt: skip
        answer = httpx.request(method, url + path, json={"model": MODEL, "input": "x"}, timeout=10)
        assert answer.status_code == 401, path
        error = answer.json()["error"]
        assert error["code"] == 401 and error["type"] == "Unauthorized"
        assert "Authorization: Bearer" in error["message"]
    models = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEY_TWO}"}, timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200


def test_a_key_variable_that_is_not_set_stops_the_start(tmp_path):
    config = tmp_path / "proxy.yaml"
    config.write_text(
        f"models: [{{name: {MODEL}}}]\nbackends: [{{name: b0, url: 'http://127.0.0.1:1'}}]\n"
        "auth: {api_keys_env: [KVGATE_TEST_UNSET_KEYS]}\n"
    )
    result = _run("-m", "router.cli", "serve", "--config", str(config))
    assert result.returncode == 2
    assert "auth.api_keys_env" in result.stderr and "KVGATE_TEST_UNSET_KEYS" in result.stderr


# ---- command lines ----


def test_kvgate_version_is_the_installed_version():
    result = _run("-m", "router.cli", "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kvgate {importlib.metadata.version('kvgate')}"


def test_config_path_comes_from_kvgate_config_when_the_flag_is_absent(tmp_path):
    backend = start_backend("b0", [MODEL])
    port = free_port()
    config = tmp_path / "proxy.yaml"
    config.write_text(
        f"listen: {{port: {port}}}\nmodels: [{{name: {MODEL}}}]\n"
        f"backends: [{{name: b0, url: '{backend.url}'}}]\n"
    )
    process = ManagedProcess(python_command("-m", "router.cli", "serve"), env={"KVGATE_CONFIG": str(config)})
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", process)
    finally:
        process.stop()
        backend.stop()
    missing = _run("-m", "router.cli", "serve", env={"KVGATE_CONFIG": ""})
    assert missing.returncode == 2 and "--config" in missing.stderr


def test_help_shows_defaults():
    sim = _run("-m", "router.cli", "sim", "--help")
    assert "(default: 16)" in sim.stdout  # --block-size
    server = _run("-m", "cachelayer.cli", "server", "--help")
    assert server.returncode == 0, server.stderr
    # LMCache's multiprocess server listens on 5555 (MPServerConfig.port): so does this one.
    assert "ZMQ data-plane port (0: any free port) (default: 5555)" in " ".join(server.stdout.split())


def test_cachelayer_subcommands_are_described_and_take_a_log_level():
    overview = _run("-m", "cachelayer.cli", "--help")
    assert "controller" in overview.stdout and "server" in overview.stdout
    for name in ("controller", "server"):
        page = _run("-m", "cachelayer.cli", name, "--help")
        assert page.returncode == 0, page.stderr
        assert "--log-level" in page.stdout
        # A description of what the command does, beyond its one-line summary.
        assert len(page.stdout.split("options:")[0].split("\n\n")[1]) > 100
    http_port = free_port()
    flags = ["--port", "0", "--http-port", str(http_port), "--l1-size-gb", "0.01", "--log-level", "warning"]
    quiet = ManagedProcess(python_command("-m", "cachelayer.cli", "server", *flags))
    try:
        wait_for_http(f"http://127.0.0.1:{http_port}/healthcheck", quiet)
        assert "cachelayer server ready" in quiet.output()
        assert " INFO " not in quiet.output()
    finally:
        quiet.stop()
    bad = _run("-m", "cachelayer.cli", "server", "--log-level", "chatty")
    assert bad.returncode == 2 and "--log-level" in bad.stderr
