"""Client limits of the gateway's HTTP server (router/http_server.py) and health probing under a
stalled event loop (router/health.py), against the real process over raw sockets.

A request head over limits.max_header_bytes gets 431 as it arrives; a head or body that does not
arrive in time gets 408; at limits.max_client_connections the longest idle connection is closed to
make room, and past it (every connection answering) new ones get 503 while open ones keep working
and /health answers; a loop blocked by the gateway itself marks no backend down.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest

from kvgate_testing.backend import TEST_MODEL
from kvgate_testing.gateway import gateway_config, start_gateway
from kvgate_testing.loop_blocker import FACTORY as LOOP_BLOCKER
from kvgate_testing.metrics import metric_samples, sample_key
from kvgate_testing.waiting import wait_for

MODEL = TEST_MODEL
HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5
# A slow client must be closed within its timeout plus this (a busy 2-core machine).
CLOSE_SLACK_S = 1.5


@pytest.fixture(scope="module")
def gateway(backend):
    limits = {"header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S}
    with start_gateway(gateway_config([backend], limits=limits)) as running:
        yield running


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _connect(url: str, timeout_s: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", _port(url)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection (socket.timeout if it never does)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass  # closed with our unread bytes still queued: what it wrote before is in `data`
    return data


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def _head_with_big_header(method: str, target: str, header_bytes: int) -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nhost: gateway\r\ncontent-length: 0\r\nx-big: ".encode()
    return head + b"a" * header_bytes + b"\r\n\r\n"


def _send_head(url: str, head: bytes) -> bytes:
    with _connect(url) as sock:
        # Refused part-way: the answer was written before the close.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head)
        return _read_until_closed(sock)


def _health_latency_s(client: httpx.Client) -> float:
    started = time.perf_counter()
    client.get("/health").raise_for_status()
    return time.perf_counter() - started


# ---- header size ----


@pytest.mark.parametrize(
    ("method", "target"), [("GET", "/health"), ("POST", "/v1/completions")], ids=["asgi-path", "direct-path"]
)
def test_a_head_over_the_limit_gets_431_and_the_connection_closes(gateway, method, target):
    response = _send_head(gateway.url, _head_with_big_header(method, target, 1 << 20))
    assert _status(response) == 431
    assert b"connection: close" in response.lower()
    assert b"limits.max_header_bytes" in response
    assert b'"type":"Request Header Fields Too Large"' in response


def test_a_head_under_the_limit_is_served(gateway):
    # Headers totalling 60 KiB, in several headers, stay under the default 64 KiB.
    headers = {f"x-filler-{i}": "f" * 6000 for i in range(10)}
    response = httpx.post(
        f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers, timeout=10
    )
    assert response.status_code == 200


def test_pipelined_requests_totalling_more_than_the_limit_are_all_answered(gateway):
    # The limit is per request head: 150 pipelined requests of 2 KiB each arrive in reads far over 64 KiB.
    request = b"GET /health HTTP/1.1\r\nhost: gateway\r\nx-filler: " + b"f" * 2000 + b"\r\n\r\n"
    with _connect(gateway.url) as sock:
        sock.sendall(request * 150 + b"GET /health HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n\r\n")
        responses = _read_until_closed(sock)
    assert responses.count(b"HTTP/1.1 200 OK\r\n") == 151
    assert b" 431 " not in responses


def test_health_stays_fast_during_a_burst_of_huge_heads(gateway):
    # Each 32 MiB header value cost the parser about a second of event loop (its buffer is copied
    # on every read); the limit stops reading at 64 KiB.
    huge_head = _head_with_big_header("GET", "/health", 32 << 20)
    senders = [threading.Thread(target=_send_head, args=(gateway.url, huge_head)) for _ in range(3)]
    latencies: list[float] = []
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        _health_latency_s(client)  # connected before the burst
        # The machine's own latency now: the slowest of a few answers before the burst.
        baseline_s = max(_health_latency_s(client) for _ in range(5))
        for sender in senders:
            sender.start()
        try:
            while any(sender.is_alive() for sender in senders):
                latencies.append(_health_latency_s(client))
                time.sleep(0.02)
        finally:
            for sender in senders:
                sender.join()
        latencies.append(_health_latency_s(client))
    # A head parsed whole held the loop about a second each (three at once: seconds); a busy
    # machine adds its baseline. Half a second over the baseline is a bound, not a timing.
    assert max(latencies) < baseline_s + 0.5, (baseline_s, latencies)


# ---- read timeouts ----


def test_a_client_trickling_its_head_gets_408_after_the_header_timeout(gateway):
    with _connect(gateway.url) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: gateway\r\n")
        sock.settimeout(0.1)
        response = b""
        # One header byte every 100 ms: each read is quick, the head never ends.
        while time.monotonic() - started < HEADER_TIMEOUT_S + CLOSE_SLACK_S:
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            response += chunk
        closed_after = time.monotonic() - started
    assert _status(response) == 408, response
    assert b"limits.header_timeout_s" in response
    assert closed_after < HEADER_TIMEOUT_S + CLOSE_SLACK_S


def test_a_connection_that_never_sends_a_request_is_closed(gateway):
    with _connect(gateway.url) as sock:
        started = time.monotonic()
        assert _read_until_closed(sock) == b""  # closed quietly: there is no request to answer
        assert time.monotonic() - started < HEADER_TIMEOUT_S + CLOSE_SLACK_S


@pytest.mark.parametrize(
    "target", ["/v1/completions", "/v1/completions?via=asgi"], ids=["direct-path", "asgi-path"]
)
def test_a_body_that_never_ends_gets_408_after_the_body_timeout(gateway, target):
    with _connect(gateway.url) as sock:
        started = time.monotonic()
        sock.sendall(
            f"POST {target} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            'content-length: 100\r\n\r\n{"model": '.encode()
        )
        response = _read_until_closed(sock)
        closed_after = time.monotonic() - started
    assert _status(response) == 408, response
    assert b"limits.body_timeout_s" in response
    assert closed_after < BODY_TIMEOUT_S + CLOSE_SLACK_S


def test_a_stream_longer_than_the_read_timeouts_is_not_cut(gateway):
    headers = {"x-test-chunks": "8", "x-test-chunk-delay-ms": "200"}
    body = {"model": MODEL, "prompt": "long", "stream": True}
    with httpx.Client(base_url=gateway.url, timeout=30, limits=httpx.Limits(max_connections=1)) as client:
        started = time.monotonic()
        with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            text = b"".join(response.iter_raw())
        assert time.monotonic() - started > HEADER_TIMEOUT_S + BODY_TIMEOUT_S
        assert text.rstrip().endswith(b"data: [DONE]")
        # The same keep-alive connection takes the next request.
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "next"}).status_code == 200


# ---- connection limit ----

MAX_CLIENT_CONNECTIONS = 4


@pytest.fixture
def small_gateway(backend):
    limits = {"max_client_connections": MAX_CLIENT_CONNECTIONS, "header_timeout_s": 10.0}
    with start_gateway(gateway_config([backend], limits=limits)) as running:
        yield running


def _busy_connections(url: str, count: int, delay_ms: int) -> tuple[list[threading.Thread], list[int]]:
    """`count` connections, each with a completion in flight for `delay_ms` (the backend waits):
    connections answering a request, which the gateway never closes to make room. Returns the
    threads and the list their statuses go to."""
    statuses: list[int] = []

    def post() -> None:
        answer = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": "busy"},
            headers={"x-test-delay-ms": str(delay_ms)},
            timeout=30,
        )
        statuses.append(answer.status_code)

    threads = [threading.Thread(target=post) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, statuses


def test_connections_past_the_limit_are_refused_while_open_ones_keep_working(small_gateway, backend):
    url = small_gateway.url
    completion = {"model": MODEL, "prompt": "hi"}
    backend.reset()
    # Fill the limit with connections that each have a request in flight (asked of the backend, so
    # that no connection of the test's own takes a slot meanwhile).
    threads, statuses = _busy_connections(url, MAX_CLIENT_CONNECTIONS, delay_ms=3000)
    try:
        wait_for(lambda: len(backend.received()) == MAX_CLIENT_CONNECTIONS, what="the busy requests")
        refused = httpx.post(f"{url}/v1/completions", json=completion, timeout=10)
        assert refused.status_code == 503
        assert "limits.max_client_connections" in refused.json()["error"]["message"]
        assert refused.headers["connection"] == "close"
        # Monitoring still answers on a new connection.
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 200
        assert health.json()["status"] == "ok"
        samples = metric_samples(httpx.get(f"{url}/metrics", timeout=10).text)
        assert samples[sample_key("kvgate_client_connections_refused_total")] >= 3
    finally:
        for thread in threads:
            thread.join(timeout=30)
    # The open ones were served to the end.
    assert statuses == [200] * MAX_CLIENT_CONNECTIONS
    # Room again once they are done.
    wait_for(
        lambda: httpx.post(f"{url}/v1/completions", json=completion, timeout=10).status_code == 200,
        what="a new connection served after the busy ones ended",
    )


def test_at_the_limit_the_longest_idle_connection_is_closed_to_make_room(small_gateway):
    url = small_gateway.url
    idle = [_connect(url) for _ in range(MAX_CLIENT_CONNECTIONS)]
    try:
        time.sleep(0.2)  # all accepted, the first longest idle
        served = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
        assert served.status_code == 200
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""  # closed by the gateway, without an answer
        for sock in idle[1:]:
            sock.settimeout(0.1)
            with pytest.raises(TimeoutError):
                sock.recv(1)  # still open
    finally:
        for sock in idle:
            sock.close()


def test_idle_connections_past_the_limit_never_keep_health_probes_out(backend):
    # The report: 130 idle connections against a limit of 50 got /health 503 on 98 of 100 probes,
    # as the idle ones had taken the probes' reserve (64 connections past the limit).
    limits = {"max_client_connections": 50, "header_timeout_s": 30.0}
    with start_gateway(gateway_config([backend], limits=limits)) as running:
        url = running.url
        idle = [_connect(url) for _ in range(130)]
        try:
            statuses = [httpx.get(f"{url}/health", timeout=10).status_code for _ in range(100)]
            assert statuses.count(200) == 100, statuses
            answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
            assert answer.status_code == 200
            # The idle ones made the room: those past the limit, and one for each probe since.
            closed = 0
            for sock in idle:
                sock.settimeout(0.05)
                with contextlib.suppress(TimeoutError):
                    closed += sock.recv(1) == b""
            assert closed >= 130 - 50
        finally:
            for sock in idle:
                sock.close()


def test_a_flood_of_idle_connections_under_a_low_file_limit_is_served_and_marks_no_backend_down(backend):
    # With 512 file descriptors the default limit is (512 - 192) // 2 = 160 client connections, 64
    # more for monitoring. Without it, 600 idle connections ran the gateway out of descriptors:
    # new clients were reset and the health probes, unable to connect, marked the backend down.
    # Now each idle connection past the limit closes the longest idle one.
    config = {"models": [{"name": MODEL}], "backends": [{"name": "a", "url": backend.url}]}
    config["health"] = {"interval_s": 0.1, "timeout_s": 0.5, "min_down_s": 0.2}
    with start_gateway(config, open_file_limit=512) as running:
        url = running.url
        assert httpx.get(f"{url}/health", timeout=10).json()["backends"] == {"a": "healthy"}
        flood = [_connect(url) for _ in range(600)]
        try:
            completion = {"model": MODEL, "prompt": "hi"}
            assert httpx.post(f"{url}/v1/completions", json=completion, timeout=5).status_code == 200
            time.sleep(0.5)  # several probe rounds
            health = httpx.get(f"{url}/health", timeout=10).json()
            assert health == {"status": "ok", "backends": {"a": "healthy"}}
            assert "Too many open files" not in running.process.output()
        finally:
            for sock in flood:
                sock.close()


# ---- health probing while the gateway's own loop is blocked ----


@pytest.fixture
def blocking_gateway(backend):
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": "a", "url": backend.url}],
        "health": {"interval_s": 0.1, "timeout_s": 0.5, "min_down_s": 0.2},
    }
    # The probe's answer then arrives while the loop is blocked, never before the block.
    backend.set_mode(health_delay_ms=50)
    try:
        with start_gateway(config, extensions=[LOOP_BLOCKER]) as running:
            yield running
    finally:
        backend.set_mode()


def test_a_blocked_event_loop_marks_no_backend_down(blocking_gateway):
    url = blocking_gateway.url
    wait_for(lambda: httpx.get(f"{url}/health").json()["backends"] == {"a": "healthy"})
    went_down = sample_key("kvgate_health_transitions_total", backend="a", to="down")
    before = metric_samples(httpx.get(f"{url}/metrics").text)
    # Blocked for three probe timeouts while a probe is in flight.
    httpx.post(f"{url}/_test/block-loop", json={"seconds": 1.5}, timeout=10).raise_for_status()
    wait_for(lambda: httpx.get(f"{url}/_test/block-loop", timeout=10).json()["blocks"] == 1, what="the block")
    time.sleep(0.5)  # several probe rounds after the block
    after = metric_samples(httpx.get(f"{url}/metrics").text)
    assert after.get(went_down, 0.0) == before.get(went_down, 0.0)
    assert httpx.get(f"{url}/health").json()["backends"] == {"a": "healthy"}
    assert after[sample_key("kvgate_event_loop_stall_seconds_count")] >= 1
