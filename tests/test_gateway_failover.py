"""Failover: a backend answering 503, or killed mid-run, is routed around before the first byte, marked
down, and brought back by the health checker when it recovers. After the first byte, never a retry."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvgate_testing.backend import TEST_MODEL
from kvgate_testing.gateway import gateway_config, start_gateway
from kvgate_testing.metrics import metric_samples, sample_key

MODEL = TEST_MODEL


@pytest.fixture(scope="module")
def gateway(backends):
    health = {"interval_s": 0.1, "timeout_s": 0.5, "min_down_s": 0.2}
    with start_gateway(gateway_config(backends, health=health)) as running:
        yield running


@pytest.fixture
def client(gateway, backends):
    for backend in backends:
        if backend.process is None or not backend.process.alive():
            backend.start()
        backend.reset()
    wait_until_healthy(gateway.url, {"a", "b"})
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        yield http


def backend_states(url: str) -> dict[str, str]:
    return {b["name"]: b["state"] for b in httpx.get(f"{url}/backends").json()["backends"]}


def wait_until_healthy(url: str, names: set[str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if {name for name, state in backend_states(url).items() if state == "healthy"} >= names:
            return
        time.sleep(0.05)
    raise AssertionError(f"backends {names} not healthy: {backend_states(url)}")


def wait_until_state(url: str, name: str, state: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if backend_states(url)[name] == state:
            return
        time.sleep(0.05)
    raise AssertionError(f"backend {name} not {state}: {backend_states(url)}")


def send(client: httpx.Client, prompt: str) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})


def test_a_503_is_retried_on_another_backend_then_the_backend_recovers(client, gateway, backends):
    a, b = backends
    # /health stays 200, so only the 503 answers (the passive path) take a out of the rotation;
    # the probe brings it back after min_down_s, and each request that reached it is retried on b.
    a.set_mode(status=503)
    retries = sample_key("kvgate_retries_total", backend="a", reason="503")
    retries_before = metric_samples(client.get("/metrics").text).get(retries, 0.0)
    responses = [send(client, f"p{i}") for i in range(10)]
    assert [r.status_code for r in responses] == [200] * 10
    assert {r.headers["x-kvgate-backend"] for r in responses} == {"b"}
    reached_a = len(a.received())
    assert reached_a >= 1
    assert len(b.received()) == 10
    assert metric_samples(client.get("/metrics").text)[retries] == retries_before + reached_a
    # A failing /health keeps it out for good.
    a.set_mode(status=503, health_status=503)
    wait_until_state(gateway.url, "a", "down")
    assert {send(client, f"r{i}").headers["x-kvgate-backend"] for i in range(4)} == {"b"}
    assert len(a.received()) == reached_a
    came_up = sample_key("kvgate_health_transitions_total", backend="a", to="up")
    came_up_before = metric_samples(client.get("/metrics").text).get(came_up, 0.0)
    a.set_mode()  # recovered
    wait_until_healthy(gateway.url, {"a"})
    assert {send(client, f"q{i}").headers["x-kvgate-backend"] for i in range(4)} == {"a", "b"}
    # At least one: under load a probe may time out and the backend go down and up once more.
    assert metric_samples(client.get("/metrics").text)[came_up] >= came_up_before + 1


def test_when_every_backend_answers_503_the_client_gets_503(client, backends):
    for backend in backends:
        backend.set_mode(status=503)
    response = send(client, "nobody")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == 503


def test_a_killed_backend_loses_no_request_and_comes_back_when_restarted(client, gateway, backends):
    a, _ = backends
    statuses: list[int | str] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            i = 0
            while not stop.is_set():
                try:
                    statuses.append(send(http, f"load-{i}").status_code)
                except httpx.HTTPError as exc:  # counted as a lost request, not hidden in the thread
                    statuses.append(repr(exc))
                i += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        time.sleep(0.5)
        a.kill()
        time.sleep(1.0)
    finally:
        stop.set()
        worker.join()
    assert len(statuses) > 20
    assert set(statuses) == {200}
    assert backend_states(gateway.url)["a"] == "down"
    a.start()  # same port: the health checker brings it back
    wait_until_healthy(gateway.url, {"a"})
    assert {send(client, f"after-{i}").headers["x-kvgate-backend"] for i in range(4)} == {"a", "b"}


def test_a_backend_that_dies_between_its_head_and_its_body_is_routed_around(client, gateway, backends):
    # Nothing reached the client (a whole answer's head waits for its body), so the request is
    # not lost: it goes to the other backend (before: the client's connection was dropped).
    statuses, served = [], set()
    for i in range(6):
        response = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": f"dies-{i}"},
            headers={"x-test-die-after-head": "a"},
        )
        statuses.append(response.status_code)
        served.add(response.headers.get("x-kvgate-backend"))
        if backend_states(gateway.url)["a"] == "down":
            break
    assert set(statuses) == {200}
    assert served == {"b"}
    assert backend_states(gateway.url)["a"] == "down"
    retried = metric_samples(client.get("/metrics").text)
    assert retried[sample_key("kvgate_retries_total", backend="a", reason="body")] >= 1


def test_a_stream_that_fails_after_the_first_byte_ends_with_an_error_and_is_not_retried(client, backends):
    headers = {"x-test-chunks": "30", "x-test-chunk-delay-ms": "100", "x-session-id": "s"}
    body = {"model": MODEL, "prompt": "long stream", "stream": True}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        serving = next(b for b in backends if b.name == response.headers["x-kvgate-backend"])
        other = next(b for b in backends if b is not serving)
        pieces = response.iter_raw()
        first = next(pieces)
        assert first.startswith(b"data: ")
        serving.kill()
        rest = b"".join(pieces)
    assert rest.rstrip().endswith(b"}")
    last_event = rest.strip().split(b"\n\n")[-1]
    assert last_event.startswith(b'data: {"error"')
    assert b"[DONE]" not in rest
    assert other.received() == []


@pytest.mark.parametrize(
    ("path", "body", "expected_start"),
    [
        ("/v1/responses", {"model": MODEL, "input": "long stream", "stream": True}, b'data: {"error"'),
        # The Messages API's own error event, which the anthropic client raises on.
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "long stream"}],
                "stream": True,
            },
            b'event: error\ndata: {"type":"error","error":{"type":"Bad Gateway","message":"backend ',
        ),
    ],
    ids=["responses", "messages"],
)
def test_a_broken_stream_ends_with_the_error_event_of_its_api(client, backends, path, body, expected_start):
    headers = {"x-test-chunks": "30", "x-test-chunk-delay-ms": "100", "x-session-id": "s"}
    with client.stream("POST", path, json=body, headers=headers) as response:
        serving = next(b for b in backends if b.name == response.headers["x-kvgate-backend"])
        pieces = response.iter_raw()
        assert next(pieces).startswith(b"data: ")
        serving.kill()
        rest = b"".join(pieces)
    last_event = rest.strip().split(b"\n\n")[-1]
    assert last_event.startswith(expected_start), last_event


def test_a_client_that_leaves_mid_stream_stops_the_backend(client, backends):
    headers = {"x-test-chunks": "50", "x-test-chunk-delay-ms": "100", "x-request-id": "leaver"}
    body = {"model": MODEL, "prompt": "long stream", "stream": True}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        serving = next(b for b in backends if b.name == response.headers["x-kvgate-backend"])
        assert next(response.iter_raw()).startswith(b"data: ")
    # Leaving the block closed the client's connection after one chunk.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        [record] = serving.received()
        if record.get("stream_end") == "client_disconnected":
            break
        time.sleep(0.05)
    assert record["stream_end"] == "client_disconnected"
    assert record["chunks_sent"] < 20


# ---- panic routing: every backend marked down ----


@pytest.fixture
def sticky_down_gateway(backends):
    """A gateway whose probes never bring a backend back within a test (min_down_s 60 s)."""
    for backend in backends:
        if backend.process is None or not backend.process.alive():
            backend.start()
        backend.reset()
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": b.name, "url": b.url} for b in backends],
        "health": {"interval_s": 0.1, "timeout_s": 0.5, "min_down_s": 60},
    }
    with start_gateway(config) as running:
        wait_until_healthy(running.url, {"a", "b"})
        yield running
    for backend in backends:
        backend.reset()


def test_when_every_backend_is_marked_down_the_one_back_answers_least_recently_failed_first(
    sticky_down_gateway, backends
):
    url = sticky_down_gateway.url
    a, b = backends
    # a fails its probes first, then b: both are marked down, a the longer ago.
    a.set_mode(health_status=503)
    wait_until_state(url, "a", "down")
    b.set_mode(health_status=503)
    wait_until_state(url, "b", "down")
    # b is back (its probes pass, but min_down_s keeps it out); a still answers 503.
    a.set_mode(status=503, health_status=503)
    b.set_mode()
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/health").status_code == 503  # nothing in the rotation
        response = send(client, "panic")
        assert response.status_code == 200, response.text
        assert response.headers["x-kvgate-backend"] == "b"
        # a, the least recently failed, was tried first; b answered and is back in the rotation.
        assert len(a.received()) == 1
        assert len(b.received()) == 1
        assert backend_states(url) == {"a": "down", "b": "healthy"}
        panic = metric_samples(client.get("/metrics").text)
        assert panic[sample_key("kvgate_panic_routed_total", backend="a")] == 1
        assert panic[sample_key("kvgate_panic_routed_total", backend="b")] == 1
        # b is a candidate again: the next request goes straight to it.
        assert send(client, "after").headers["x-kvgate-backend"] == "b"
        assert len(a.received()) == 1


def test_when_every_backend_is_marked_down_and_none_is_back_the_client_gets_503(
    sticky_down_gateway, backends
):
    url = sticky_down_gateway.url
    for backend in backends:
        backend.set_mode(status=503, health_status=503)
    for backend in backends:
        wait_until_state(url, backend.name, "down")
    with httpx.Client(base_url=url, timeout=30) as client:
        response = send(client, "nobody")
    assert response.status_code == 503
    # Each marked-down backend was tried once.
    assert [len(backend.received()) for backend in backends] == [1, 1]
