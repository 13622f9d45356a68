"""Hostile peers of the gateway, each a real process or socket on loopback against the real gateway
process: a backend whose response head (or trailer section) never ends; a client that pipelines
requests and never reads the answers, or queues large bodies behind a slow request; a client naming
headers in `Connection:`. (Idle connections filling the limit: tests/test_gateway_connection_limits.py;
a stopped worker: tests/test_gateway_replicas.py; client keys opening admin: tests/test_gateway_admin.py.)

Each test states the bound it holds the gateway to.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time

import httpx
import pytest

from kvgate_testing.backend import TEST_MODEL
from kvgate_testing.gateway import gateway_config, start_gateway
from kvgate_testing.hostile_upstream import running_endless_head_upstream
from kvgate_testing.metrics import metric_samples, sample_key
from kvgate_testing.proc_stats import rss_bytes

MODEL = TEST_MODEL
MIB = 1 << 20


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# ---- a backend whose response head never ends ----


def test_an_upstream_head_that_never_ends_gets_the_client_a_502_and_marks_the_backend_down():
    # Before the cap the gateway buffered the header lines for as long as they came (16 GB in
    # 60 s) and the client got no status until limits.upstream_timeout_s (600 s).
    with running_endless_head_upstream(max_seconds=30.0) as upstream_url:
        config = {
            "models": [{"name": MODEL}],
            "backends": [{"name": "endless", "url": upstream_url}],
            # No probe brings it back while the test looks (the hostile backend answers /health).
            "health": {"interval_s": 60.0},
        }
        with start_gateway(config) as gateway:
            before = rss_bytes(gateway.process.pid)
            started = time.monotonic()
            # 20 s: far below the 30 s the upstream keeps sending, and below upstream_timeout_s.
            answer = httpx.post(
                f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=20
            )
            took_s = time.monotonic() - started
            grown = rss_bytes(gateway.process.pid) - before
            assert answer.status_code == 502, answer.text
            assert "response head over" in answer.json()["error"]["message"]
            assert took_s < 20
            # The head is cut at 64 KiB; 50 MB leaves room for the allocator's own slack.
            assert grown < 50 * MIB, f"gateway grew {grown / MIB:.0f} MiB"
            samples = metric_samples(httpx.get(f"{gateway.url}/metrics", timeout=10).text)
            assert samples[sample_key("kvgate_health_transitions_total", backend="endless", to="down")] >= 1


def test_upstream_trailers_that_never_end_cut_the_answer_short_and_hold_no_memory():
    # After a chunked body the backend sends trailer lines without end. Before, each one was kept
    # (a list of headers that grew for as long as it sent) and the client waited the whole time.
    with running_endless_head_upstream(mode="trailer", max_seconds=30.0) as upstream_url:
        config = {
            "models": [{"name": MODEL}],
            "backends": [{"name": "endless", "url": upstream_url}],
            "health": {"interval_s": 60.0},
        }
        with start_gateway(config) as gateway:
            before = rss_bytes(gateway.process.pid)
            started = time.monotonic()
            body = {"model": MODEL, "prompt": "hi", "stream": True}
            received = b""
            with (
                httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=20) as answer,
                contextlib.suppress(httpx.RemoteProtocolError),
            ):
                for piece in answer.iter_raw():
                    received += piece
            took_s = time.monotonic() - started
            grown = rss_bytes(gateway.process.pid) - before
            assert answer.status_code == 200  # the head had gone out before the trailers began
            assert received.startswith(b"data: hello")
            # The stream ends with the error event the gateway sends for a backend failing mid-stream.
            assert b"trailers or chunk framing over" in received
            assert took_s < 20
            assert grown < 50 * MIB, f"gateway grew {grown / MIB:.0f} MiB"


# ---- a client that pipelines and never reads ----

PIPELINE_ATTACK_S = 10.0
# A model name the 404 answer repeats: 64 KiB in, about 64 KiB out, answered without any backend.
_UNKNOWN_MODEL = "m" * 65536
_UNKNOWN_MODEL_BODY = json.dumps({"model": _UNKNOWN_MODEL, "prompt": "x"}).encode()
_BIG_ANSWER_REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_UNKNOWN_MODEL_BODY), _UNKNOWN_MODEL_BODY)
)
# 34 bytes in, a few KiB out (uvicorn's ASGI path): thousands of them arrive in one read.
_SMALL_REQUEST = b"GET /metrics HTTP/1.1\r\nhost: g\r\n\r\n"


def _pipeline_without_reading(
    url: str, pid: int, duration_s: float, max_bytes: int, request: bytes = _BIG_ANSWER_REQUEST
) -> tuple[int, int, int]:
    """Send `request` pipelined on one connection for `duration_s` (at most `max_bytes`), reading
    nothing. Returns the bytes the gateway took, its largest RSS growth (process `pid`) seen
    while it went on, and its growth 1 s after the connection closed."""
    request *= max(1, 65536 // len(request))
    before = rss_bytes(pid)
    sent = peak = 0
    with socket.socket() as sock:
        # A small receive buffer: the answers back up into the gateway at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", _port(url)))
        sock.setblocking(False)
        view, offset = memoryview(request), 0
        deadline = time.monotonic() + duration_s
        next_sample = 0.0
        while sent < max_bytes and (left := deadline - time.monotonic()) > 0:
            if time.monotonic() >= next_sample:
                peak = max(peak, rss_bytes(pid) - before)
                next_sample = time.monotonic() + 0.25
            _, writable, _ = select.select([], [sock], [], min(left, 0.25))
            if not writable:
                continue  # the gateway stopped reading: what the bound is about
            try:
                count = sock.send(view[offset:])
            except BlockingIOError:
                continue
            sent += count
            offset = (offset + count) % len(request)
        peak = max(peak, rss_bytes(pid) - before)
    time.sleep(1.0)
    return sent, peak, rss_bytes(pid) - before


@pytest.mark.parametrize(
    "request_bytes",
    [_BIG_ANSWER_REQUEST, _SMALL_REQUEST],
    ids=["direct-path-64KiB-answers", "asgi-path-small"],
)
def test_gateway_rss_grows_less_than_100_mb_while_a_client_pipelines_without_reading(backend, request_bytes):
    # Before: the gateway read on and queued every answer for the client (270 MB in 40 s in the
    # report; here 457 MiB in 12 s, 212 MiB still held after the client closed), or, for small
    # requests, parsed every one a read brought and queued it (200 MiB in 5 s).
    with start_gateway(gateway_config([backend])) as gateway:
        sent, peak, after_close = _pipeline_without_reading(
            gateway.url, gateway.process.pid, PIPELINE_ATTACK_S, max_bytes=1 << 30, request=request_bytes
        )
        assert peak < 100 * MIB, f"gateway grew {peak / MIB:.0f} MiB while taking {sent / MIB:.0f} MiB"
        assert after_close < 100 * MIB, f"{after_close / MIB:.0f} MiB stayed after the client closed"
        # It stopped reading: what it took is bounded by the socket buffers, not by the attack's length.
        assert sent < 64 * MIB, f"the gateway read {sent / MIB:.0f} MiB from a client that read nothing"
        # And it still serves everyone else.
        answer = httpx.post(
            f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10
        )
        assert answer.status_code == 200


WRITE_TIMEOUT_S = 2.0


def test_a_client_that_reads_none_of_its_answers_is_dropped_after_the_write_timeout(backend):
    # Backpressure alone would leave such a connection open for as long as the client liked,
    # holding its slot and its request's engine; limits.write_timeout_s ends it.
    limits = {"write_timeout_s": WRITE_TIMEOUT_S}
    with start_gateway(gateway_config([backend], limits=limits)) as gateway:
        ended: list[BaseException] = []

        def send_all(sock: socket.socket) -> None:
            try:
                sock.sendall(_BIG_ANSWER_REQUEST * 400)  # 26 MiB of requests, 26 MiB of answers never read
            except OSError as exc:
                ended.append(exc)

        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", _port(gateway.url)))
            started = time.monotonic()
            sender = threading.Thread(target=send_all, args=(sock,), daemon=True)
            sender.start()
            # The timeout counts from when the gateway's writes pause; 10 s of slack for a busy host.
            sender.join(timeout=WRITE_TIMEOUT_S + 10)
            took_s = time.monotonic() - started
            if sender.is_alive():
                sock.shutdown(socket.SHUT_RDWR)  # unblock it: the test has failed
                sender.join(timeout=10)
                raise AssertionError(f"the connection was still open {took_s:.0f} s on")
        assert ended and isinstance(ended[0], (ConnectionResetError, BrokenPipeError)), ended
        assert took_s >= WRITE_TIMEOUT_S
        assert (
            httpx.post(f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}).status_code
            == 200
        )


def test_a_pipelining_client_that_reads_slowly_still_gets_every_answer_in_order(backend):
    # Backpressure must lose and reorder nothing: 100 pipelined requests, half of them with 64 KiB
    # answers (far past the transport's high-water mark), sent by one thread, read slowly by another.
    with start_gateway(gateway_config([backend])) as gateway:
        requests = b""
        for index in range(100):
            model = MODEL if index % 2 else _UNKNOWN_MODEL
            body = json.dumps({"model": model, "prompt": f"p{index}"}).encode()
            requests += (
                b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                b"x-request-id: r%d\r\ncontent-length: %d\r\n\r\n%s" % (index, len(body), body)
            )
        requests += b"GET /health HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n\r\n"
        received = b""
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(30)
            sock.connect(("127.0.0.1", _port(gateway.url)))
            sender = threading.Thread(target=sock.sendall, args=(requests,), daemon=True)
            sender.start()
            deadline = time.monotonic() + 60
            with contextlib.suppress(ConnectionResetError):
                while time.monotonic() < deadline and (chunk := sock.recv(4096)):
                    received += chunk
                    time.sleep(0.001)
            sender.join(timeout=10)
    ids = [int(line[15:]) for line in received.split(b"\r\n") if line.startswith(b"x-request-id: r")]
    assert ids == list(range(100))
    assert received.count(b"HTTP/1.1 200 OK\r\n") == 51
    assert received.count(b"HTTP/1.1 404 Not Found\r\n") == 50


# ---- headers named in `Connection:` ----


@pytest.mark.parametrize("target", ["/v1/completions", "/v1/completions?via=asgi"], ids=["direct", "asgi"])
def test_headers_named_in_connection_are_not_forwarded_upstream(backend, target):
    # RFC 9110 section 7.6.1: a proxy drops the headers its client names in `Connection:`, besides
    # the fixed hop-by-hop list. Before, they reached the backend.
    with start_gateway(gateway_config([backend])) as gateway:
        backend.reset()
        body = json.dumps({"model": MODEL, "prompt": "hop"}).encode()
        request = (
            f"POST {target} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            "connection: keep-alive, X-Hop-Secret\r\nconnection: x-hop-other\r\n"
            "x-hop-secret: for the gateway only\r\nx-hop-other: 1\r\nx-kept: 1\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        with socket.create_connection(("127.0.0.1", _port(gateway.url)), timeout=20) as sock:
            sock.sendall(request)
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(65536)
                assert chunk, answer
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        (received,) = backend.received()
        forwarded = received["headers"]
        assert "x-kept" in forwarded
        assert "x-hop-secret" not in forwarded and "x-hop-other" not in forwarded, forwarded


def test_requests_pipelined_behind_a_slow_one_hold_at_most_about_one_body_limit(backend):
    # 15 requests with bodies at limits.max_body_bytes (8 MiB here) pipelined behind one the backend
    # answers after 4 s. Before, 15 were read and held while the first was answered (120 MiB for
    # one connection; 16 x 32 MiB = 512 MiB at the default limit); now reading stops once the
    # queued bodies reach the limit.
    body_limit = 8 * MIB
    with start_gateway(gateway_config([backend], limits={"max_body_bytes": body_limit})) as gateway:
        pid = gateway.process.pid
        slow = json.dumps({"model": MODEL, "prompt": "slow"}).encode()
        requests = (
            b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b"x-test-delay-ms: 4000\r\ncontent-length: %d\r\n\r\n%s" % (len(slow), slow)
        )
        big = json.dumps({"model": MODEL, "prompt": "b" * (body_limit - 100)}).encode()
        big_request = (
            b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(big), big)
        )
        before = rss_bytes(pid)
        peak = 0
        received = b""
        with socket.create_connection(("127.0.0.1", _port(gateway.url)), timeout=30) as sock:
            sender = threading.Thread(target=sock.sendall, args=(requests + big_request * 15,), daemon=True)
            sender.start()
            deadline = time.monotonic() + 3.0  # while the slow one is answered
            while time.monotonic() < deadline:
                peak = max(peak, rss_bytes(pid) - before)
                time.sleep(0.1)
            sock.settimeout(30)
            with contextlib.suppress(TimeoutError):
                while received.count(b"HTTP/1.1 200 OK\r\n") < 16 and (chunk := sock.recv(65536)):
                    received += chunk
            sender.join(timeout=30)
        assert peak < 40 * MIB, f"gateway grew {peak / MIB:.0f} MiB behind one slow request"
        # Nothing lost: every request was answered once reading went on.
        assert received.count(b"HTTP/1.1 200 OK\r\n") == 16
