"""The gateway's own HTTP/1.1 protocol (router/http_server.py), over raw sockets to the real process:
the direct path for the generation routes and uvicorn's ASGI path share one connection correctly."""

from __future__ import annotations

import json
import socket
import time

import httptools
import pytest

from kvgate_testing.backend import TEST_MODEL
from kvgate_testing.gateway import BUG_LOG_LINES, gateway_config, start_gateway

MODEL = TEST_MODEL


@pytest.fixture(scope="module")
def gateway(backend):
    with start_gateway(gateway_config([backend])) as running:
        yield running


class _Responses:
    """Parses the HTTP/1.1 responses read from one socket, in order."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[dict] = []
        self._current: dict = {}

    def on_message_begin(self) -> None:
        self._current = {"headers": {}, "body": b""}

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current["headers"][name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self._current["status"] = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._current["body"] += body

    def on_message_complete(self) -> None:
        self.done.append(self._current)


def _request(port: int, method: str, target: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"host: 127.0.0.1:{port}", f"content-length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _exchange(gateway, raw: bytes, expected: int, timeout_s: float = 20.0) -> tuple[list[dict], bool]:
    """Send `raw` at once on a fresh connection; the first `expected` responses, and whether the
    gateway then closed the connection."""
    port = int(gateway.url.rsplit(":", 1)[1])
    responses = _Responses()
    closed = False
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(raw)
        deadline = time.monotonic() + timeout_s
        while len(responses.done) < expected and time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                closed = True
                break
            responses.parser.feed_data(data)
        if not closed:
            sock.settimeout(0.3)
            try:
                closed = sock.recv(1) == b""
            except TimeoutError:
                closed = False
    return responses.done, closed


def _completion(prompt: str, **extra) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, **extra}).encode()


def test_pipelined_requests_on_both_paths_are_answered_in_order(gateway):
    port = int(gateway.url.rsplit(":", 1)[1])
    raw = b"".join(
        [
            _request(port, "POST", "/v1/completions", _completion("first"), {"x-request-id": "r1"}),
            _request(port, "GET", "/health"),
            _request(port, "POST", "/v1/completions", _completion("third"), {"x-request-id": "r3"}),
            _request(port, "POST", "/v1/completions?via=asgi", _completion("fourth"), {"x-request-id": "r4"}),
            _request(port, "POST", "/v1/completions", b"{broken", {"x-request-id": "r5"}),
            _request(port, "POST", "/v1/completions", _completion("sixth"), {"x-request-id": "r6"}),
        ]
    )
    responses, closed = _exchange(gateway, raw, 6)
    assert [response["status"] for response in responses] == [200, 200, 200, 200, 400, 200]
    assert json.loads(responses[1]["body"])["status"] == "ok"
    ids = [response["headers"].get("x-request-id") for response in responses]
    assert ids == ["r1", None, "r3", "r4", "r5", "r6"]
    for index in (0, 2, 3, 5):
        # The backend's answer names the request it answered: each answer is its own request's.
        assert json.loads(responses[index]["body"])["request_id"] == ids[index]
        assert responses[index]["headers"]["x-kvgate-backend"] == "a"
    assert not closed  # keep-alive throughout


def test_a_json_answer_keeps_the_backends_content_length(gateway):
    port = int(gateway.url.rsplit(":", 1)[1])
    [response], closed = _exchange(gateway, _request(port, "POST", "/v1/completions", _completion("x")), 1)
    assert response["status"] == 200
    assert int(response["headers"]["content-length"]) == len(response["body"])
    assert "transfer-encoding" not in response["headers"]
    assert not closed


def test_a_stream_is_sent_chunked_and_the_connection_stays_open(gateway):
    port = int(gateway.url.rsplit(":", 1)[1])
    body = _completion("streamed", stream=True)
    raw = _request(port, "POST", "/v1/completions", body, {"x-test-chunks": "5"}) * 2
    responses, closed = _exchange(gateway, raw, 2)
    assert len(responses) == 2
    for response in responses:
        assert response["status"] == 200
        assert response["headers"]["transfer-encoding"] == "chunked"
        events = [event for event in response["body"].split(b"\n\n") if event]
        assert events[-1] == b"data: [DONE]"
    assert not closed


def test_an_event_streams_head_is_relayed_before_its_first_event(gateway):
    # The engine sends an event stream's head at once and its first event after the prefill; the
    # client reads the head meanwhile. Held back to go out with the first event, the head's handling
    # would land on the time to the first token (benchmarks/real_added_latency.py, streamed shapes).
    port = int(gateway.url.rsplit(":", 1)[1])
    body = _completion("head first", stream=True)
    headers = {"x-test-chunks": "2", "x-test-first-chunk-delay-ms": "1500"}
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(_request(port, "POST", "/v1/completions", body, headers))
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        head_at = time.monotonic()
        assert received.startswith(b"HTTP/1.1 200")
        assert b"text/event-stream" in received
        assert received.endswith(b"\r\n\r\n"), "the first event came with the head"
        while b"data: " not in received:
            received += sock.recv(65536)
        # A lower bound only: the event waited the backend's delay after the head.
        assert time.monotonic() - head_at > 1.0


def test_connection_close_is_honoured_on_a_generation_route(gateway):
    port = int(gateway.url.rsplit(":", 1)[1])
    headers = {"connection": "close", "x-request-id": "bye"}
    raw = _request(port, "POST", "/v1/completions", _completion("bye"), headers)
    [response], closed = _exchange(gateway, raw, 1)
    assert response["status"] == 200
    assert json.loads(response["body"])["request_id"] == "bye"
    assert closed


def test_a_declared_body_over_the_limit_is_refused_before_it_is_sent(gateway):
    port = int(gateway.url.rsplit(":", 1)[1])
    head = _request(port, "POST", "/v1/completions", headers={"x-request-id": "big"})
    # Declares 64 MiB (over the default 32 MiB) and sends none of it: the 413 must not wait for it.
    raw = head.replace(b"content-length: 0", b"content-length: %d" % (64 << 20))
    [response], _ = _exchange(gateway, raw, 1, timeout_s=10)
    assert response["status"] == 413
    assert response["headers"]["x-request-id"] == "big"
    assert "over the limit" in json.loads(response["body"])["error"]["message"]


def test_a_client_that_leaves_before_the_answer_frees_its_backend_at_once(gateway):
    port = int(gateway.url.rsplit(":", 1)[1])
    raw = _request(port, "POST", "/v1/completions", _completion("slow"), {"x-test-delay-ms": "3000"})
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        deadline = time.monotonic() + 2
        while _in_flight(gateway) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _in_flight(gateway) == 1
    left_at = time.monotonic()
    while _in_flight(gateway) != 0 and time.monotonic() - left_at < 2:
        time.sleep(0.02)
    # Well before the backend's 3 s answer: the request was cancelled when the connection closed.
    # (A bound under the backend's delay, not a timing: the cancellation takes milliseconds.)
    assert _in_flight(gateway) == 0
    assert time.monotonic() - left_at < 2


def _in_flight(gateway) -> int:
    with socket.create_connection(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(b"GET /backends HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    return sum(backend["in_flight"] for backend in body["backends"])


def _new_log(gateway, start: int) -> str:
    return gateway.process.output()[start:]


def test_a_client_that_leaves_in_the_middle_of_a_body_is_no_gateway_error(gateway):
    port = int(gateway.url.rsplit(":", 1)[1])
    start = len(gateway.process.output())
    head = _request(port, "POST", "/lookup", headers={"content-type": "application/json"})
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.replace(b"content-length: 0", b"content-length: 1000") + b'{"model": ')
        time.sleep(0.2)  # the body is being read
    time.sleep(0.5)
    log = _new_log(gateway, start)
    assert not any(line in log for line in BUG_LOG_LINES), log
    assert _in_flight(gateway) == 0  # and the gateway answers


def test_an_invalid_request_pipelined_behind_asgi_ones_closes_cleanly(gateway):
    """Two ASGI requests, then an invalid one, in one read. Parsing pauses behind the queued second
    request (the rest of the read waits, as unread bytes would), so the first is answered; the
    invalid one is parsed once reading resumes, while the second is being answered (the debug page
    awaits its snapshot): it is answered 400 and the connection closed, and the second answer is
    dropped, not written to the closed connection (uvloop refuses that with a RuntimeError, which
    was logged as an unhandled error when uvicorn's `cycle` was not the running request's)."""
    port = int(gateway.url.rsplit(":", 1)[1])
    start = len(gateway.process.output())
    page = _request(port, "GET", "/debug/prefix-map")
    for _ in range(10):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(page + page + b"\x00not http\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 200 ")
        assert data.count(b"HTTP/1.1 400 ") == 1, data[-300:]
        assert data.endswith(b"Invalid HTTP request received."), data[-300:]
    time.sleep(0.3)
    log = _new_log(gateway, start)
    assert not any(line in log for line in BUG_LOG_LINES), log


def test_a_head_over_the_limit_behind_a_direct_answer_ends_it_cleanly(gateway):
    """A pipelined head over limits.max_header_bytes while a generation request is answered: no
    431 is written into that answer, the gateway sends its FIN and drops the answer when it comes
    (a write after the FIN, which uvloop refuses with a RuntimeError, is never tried)."""
    port = int(gateway.url.rsplit(":", 1)[1])
    start = len(gateway.process.output())
    slow = _request(port, "POST", "/v1/completions", _completion("slow"), {"x-test-delay-ms": "400"})
    huge = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (80 << 10) + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(slow)
        time.sleep(0.1)  # being answered
        sock.sendall(huge)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert b" 431 " not in data  # not written into the answer being made
    time.sleep(0.6)  # the backend's answer has come and gone
    log = _new_log(gateway, start)
    assert not any(line in log for line in BUG_LOG_LINES), log
    assert _in_flight(gateway) == 0


@pytest.mark.parametrize("first", ["a GET", "a POST with a body"])
def test_a_pipelined_head_over_the_limit_in_the_same_read_is_refused(gateway, first):
    """A head over limits.max_header_bytes that begins inside the read holding the request before
    it (after its head, or after its content-length body) is counted from its first byte: refused,
    never answered (the count used to restart inside the read, and such a head passed)."""
    port = int(gateway.url.rsplit(":", 1)[1])
    start = len(gateway.process.output())
    before = (
        _request(port, "GET", "/health")
        if first == "a GET"
        else _request(port, "POST", "/v1/completions", _completion("first"))
    )
    huge = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (80 << 10) + b"\r\n\r\n"
    responses, closed = _exchange(gateway, before + huge, 2, timeout_s=10)
    assert closed
    # Not the oversized request's: at most the one before it, and never a 431 read as its answer.
    assert len(responses) <= 1 and all(response["status"] == 200 for response in responses)
    log = _new_log(gateway, start)
    assert not any(line in log for line in BUG_LOG_LINES), log


def test_pipelined_requests_split_anywhere_across_reads_are_all_answered(gateway):
    """The head and body accounting (a head ends at its empty line, a body at its content-length)
    holds wherever the reads cut the stream: every request of a pipelined burst sent in pieces of
    1 to 7 bytes is answered, in order."""
    port = int(gateway.url.rsplit(":", 1)[1])
    raw = b"".join(
        [
            _request(port, "POST", "/v1/completions", _completion("one"), {"x-request-id": "p1"}),
            _request(port, "GET", "/health"),
            _request(port, "POST", "/v1/completions", _completion("three"), {"x-request-id": "p3"}),
        ]
    )
    responses = _Responses()
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        at, size = 0, 1
        while at < len(raw):
            sock.sendall(raw[at : at + size])
            at, size = at + size, size % 7 + 1
            time.sleep(0.0005)
        deadline = time.monotonic() + 20
        while len(responses.done) < 3 and time.monotonic() < deadline:
            responses.parser.feed_data(sock.recv(65536))
    assert [response["status"] for response in responses.done] == [200, 200, 200]
    assert [response["headers"].get("x-request-id") for response in responses.done] == ["p1", None, "p3"]


def test_requests_queued_behind_an_answer_are_dropped_cleanly_when_the_client_leaves(gateway):
    """A generation request queued behind a slow one on the same connection, and the client
    gone before either is answered: the queued one never starts (nothing reaches a backend for it)
    and leaves no unawaited coroutine behind."""
    port = int(gateway.url.rsplit(":", 1)[1])
    start = len(gateway.process.output())
    slow = _request(port, "POST", "/v1/completions", _completion("slow"), {"x-test-delay-ms": "300"})
    queued = _request(port, "POST", "/v1/completions", _completion("queued"))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(slow + queued)
        time.sleep(0.1)
    time.sleep(0.6)
    assert _in_flight(gateway) == 0
    log = _new_log(gateway, start)
    assert not any(line in log for line in BUG_LOG_LINES), log
