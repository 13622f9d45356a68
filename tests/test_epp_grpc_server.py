"""The picker's own gRPC server (router/epp/grpc_server.py) against grpcio's real client, and against
raw HTTP/2 bytes where a client that breaks the protocol is the point: every call kind, statuses
and their messages, cancellation and deadlines reaching the servicer, messages larger than the
windows and the frames both ways, the limits (message size, concurrent streams, connections and
their handshake's time), a broken peer
closed without harm to the next, graceful stop."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import hpack
import pytest
import uvloop
from google.protobuf import wrappers_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.epp import grpc_server, http2
from router.epp.grpc_server import RESET_BURST, GrpcServer, ServicerContext
from router.epp.health import HealthServicer
from router.epp.http2 import Method, StatusCode

Bytes = wrappers_pb2.BytesValue
SERVICE = "/test.Echo"
MAX_MESSAGE = 4 * 1024 * 1024


class Echo:
    """Servicers of each kind, recording what the server did to them."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.concurrent = 0
        self.most_concurrent = 0

    async def unary(self, request: Bytes, context: ServicerContext) -> Bytes:
        if request.value == b"abort":
            await context.abort(StatusCode.NOT_FOUND, "nothing here: caf\u00e9 100%")
        if request.value == b"raise":
            raise RuntimeError("a bug in the servicer")
        if request.value == b"too big":
            return Bytes(value=b"x" * (MAX_MESSAGE + 1))
        return Bytes(value=request.value)

    async def server_stream(self, request: Bytes, context: ServicerContext) -> AsyncIterator[Bytes]:
        for index in range(3):
            yield Bytes(value=request.value + str(index).encode())

    async def client_stream(self, requests: AsyncIterator[Bytes], context: ServicerContext) -> Bytes:
        return Bytes(value=b"".join([request.value async for request in requests]))

    async def bidi(self, requests: AsyncIterator[Bytes], context: ServicerContext) -> AsyncIterator[Bytes]:
        self.concurrent += 1
        self.most_concurrent = max(self.most_concurrent, self.concurrent)
        try:
            async for request in requests:
                yield Bytes(value=request.value)
        finally:
            self.concurrent -= 1

    async def hang(self, request: Bytes, context: ServicerContext) -> Bytes:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return request

    def methods(self) -> list[Method]:
        return [
            Method(f"{SERVICE}/Unary", "unary_unary", Bytes, self.unary),
            Method(f"{SERVICE}/ServerStream", "unary_stream", Bytes, self.server_stream),
            Method(f"{SERVICE}/ClientStream", "stream_unary", Bytes, self.client_stream),
            Method(f"{SERVICE}/Bidi", "stream_stream", Bytes, self.bidi),
            Method(f"{SERVICE}/Hang", "unary_unary", Bytes, self.hang),
        ]


class ServerThread:
    """A GrpcServer on its own event loop in a thread (the tests' clients block)."""

    def __init__(self, methods: list[Method], **options: Any) -> None:
        self.loop = uvloop.new_event_loop()  # the loop `kvgate epp` runs on
        self.server = GrpcServer(
            methods, max_streams=options.pop("max_streams", 100), max_message_bytes=MAX_MESSAGE, **options
        )
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.port = self.loop.run_until_complete(self.server.start("127.0.0.1", 0))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)

    def call(self, coroutine: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.stop(1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def echo() -> Echo:
    return Echo()


@pytest.fixture
def served(echo: Echo) -> Iterator[ServerThread]:
    running = ServerThread(echo.methods())
    yield running
    running.stop()


@pytest.fixture
def channel(served: ServerThread) -> Iterator[grpc.Channel]:
    options = [
        ("grpc.max_receive_message_length", 2 * MAX_MESSAGE),
        ("grpc.max_send_message_length", 2 * MAX_MESSAGE),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{served.port}", options=options) as opened:
        yield opened


def _stub(channel: grpc.Channel, kind: str, name: str) -> Any:
    return getattr(channel, kind)(
        f"{SERVICE}/{name}",
        request_serializer=Bytes.SerializeToString,
        response_deserializer=Bytes.FromString,
    )


def test_every_call_kind_answers_as_grpcio_expects(channel: grpc.Channel) -> None:
    assert _stub(channel, "unary_unary", "Unary")(Bytes(value=b"hello"), timeout=10).value == b"hello"
    streamed = _stub(channel, "unary_stream", "ServerStream")(Bytes(value=b"n"), timeout=10)
    assert [response.value for response in streamed] == [b"n0", b"n1", b"n2"]
    parts = iter([Bytes(value=b"a"), Bytes(value=b"b"), Bytes(value=b"c")])
    assert _stub(channel, "stream_unary", "ClientStream")(parts, timeout=10).value == b"abc"


def test_a_bidirectional_stream_answers_each_message_before_the_next_is_sent(channel: grpc.Channel) -> None:
    outgoing: list[Bytes] = []
    ready = threading.Semaphore(0)

    def requests() -> Iterator[Bytes]:
        for index in range(5):
            ready.acquire()  # the previous answer came back first: nothing waits for the stream's end
            outgoing.append(Bytes(value=b"m%d" % index))
            yield outgoing[-1]

    ready.release()
    answers = []
    for response in _stub(channel, "stream_stream", "Bidi")(requests(), timeout=10):
        answers.append(response.value)
        ready.release()
    assert answers == [b"m0", b"m1", b"m2", b"m3", b"m4"]


def test_an_abort_reaches_the_client_with_its_code_and_message(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        _stub(channel, "unary_unary", "Unary")(Bytes(value=b"abort"), timeout=10)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert raised.value.details() == "nothing here: caf\u00e9 100%"  # percent-encoded on the wire


def test_a_servicer_that_raises_answers_unknown_and_the_server_serves_on(channel: grpc.Channel) -> None:
    unary = _stub(channel, "unary_unary", "Unary")
    with pytest.raises(grpc.RpcError) as raised:
        unary(Bytes(value=b"raise"), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNKNOWN
    assert "RuntimeError" in raised.value.details()
    assert unary(Bytes(value=b"after"), timeout=10).value == b"after"


def test_an_unknown_method_is_unimplemented(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        _stub(channel, "unary_unary", "Nope")(Bytes(value=b"x"), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert f"{SERVICE}/Nope" in raised.value.details()


def test_messages_larger_than_the_windows_and_frames_pass_both_ways_intact(channel: grpc.Channel) -> None:
    # 3 MiB: many 16 KiB frames, past HTTP/2's 64 KiB default windows in both directions.
    payload = bytes(range(256)) * (3 * 4096)
    assert _stub(channel, "unary_unary", "Unary")(Bytes(value=payload), timeout=20).value == payload
    streamed = _stub(channel, "stream_stream", "Bidi")(iter([Bytes(value=payload)] * 3), timeout=30)
    assert [response.value == payload for response in streamed] == [True] * 3


def test_messages_over_the_limit_are_refused_either_way(channel: grpc.Channel) -> None:
    unary = _stub(channel, "unary_unary", "Unary")
    with pytest.raises(grpc.RpcError) as raised:
        unary(Bytes(value=b"x" * (MAX_MESSAGE + 16)), timeout=20)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over the limit" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        unary(Bytes(value=b"too big"), timeout=20)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert unary(Bytes(value=b"still serving"), timeout=10).value == b"still serving"


def test_a_cancelled_call_cancels_its_servicer(channel: grpc.Channel, echo: Echo) -> None:
    future = _stub(channel, "unary_unary", "Hang").future(Bytes(value=b"x"))
    time.sleep(0.3)
    future.cancel()
    assert echo.cancelled.wait(5), "RST_STREAM did not reach the servicer"


def test_a_deadline_cancels_the_servicer_and_answers_deadline_exceeded(
    channel: grpc.Channel, echo: Echo
) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        _stub(channel, "unary_unary", "Hang")(Bytes(value=b"x"), timeout=0.3)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert echo.cancelled.wait(5), "grpc-timeout did not cancel the servicer"


def test_streams_over_the_limit_wait_for_a_free_one(echo: Echo) -> None:
    running = ServerThread(echo.methods(), max_streams=2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            gates = [threading.Event() for _ in range(4)]

            def requests(gate: threading.Event) -> Iterator[Bytes]:
                yield Bytes(value=b"open")
                gate.wait(10)

            bidi = _stub(channel, "stream_stream", "Bidi")
            calls = [bidi(requests(gate), timeout=20) for gate in gates]
            results: list[list[bytes]] = []
            readers = [
                threading.Thread(target=lambda call=call: results.append([r.value for r in call]))
                for call in calls
            ]
            for reader in readers:
                reader.start()
            time.sleep(0.5)
            assert echo.most_concurrent == 2  # the advertised limit held the other two back
            for gate in gates:
                gate.set()
            for reader in readers:
                reader.join(20)
            assert results == [[b"open"]] * 4
            assert echo.most_concurrent == 2
    finally:
        running.stop()


def test_past_the_limit_across_connections_a_call_is_resource_exhausted(echo: Echo) -> None:
    running = ServerThread(echo.methods(), max_streams=2)
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    try:
        with (
            grpc.insecure_channel(f"127.0.0.1:{running.port}", options=own_connection) as first,
            grpc.insecure_channel(f"127.0.0.1:{running.port}", options=own_connection) as second,
        ):
            gate = threading.Event()

            def requests() -> Iterator[Bytes]:
                yield Bytes(value=b"open")
                gate.wait(10)

            held = [_stub(first, "stream_stream", "Bidi")(requests(), timeout=20) for _ in range(2)]
            assert [next(call).value for call in held] == [b"open", b"open"]
            with pytest.raises(grpc.RpcError) as raised:
                _stub(second, "unary_unary", "Unary")(Bytes(value=b"third"), timeout=5)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "epp.max_streams" in raised.value.details()
            gate.set()
            assert [list(call) for call in held] == [[], []]
            assert _stub(second, "unary_unary", "Unary")(Bytes(value=b"now"), timeout=5).value == b"now"
    finally:
        running.stop()


def _raw_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def _read_frames(sock: socket.socket, until: int, limit_s: float = 5.0) -> list[tuple[int, int, int, bytes]]:
    """Frames read until one of type `until` arrives (or the peer closes)."""
    frames, buffer, deadline = [], b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        while len(buffer) >= 9:
            high, low, kind, flags, stream = struct.unpack_from(">HBBBI", buffer)
            length = (high << 8) | low
            if len(buffer) < 9 + length:
                break
            frames.append((kind, flags, stream, buffer[9 : 9 + length]))
            buffer = buffer[9 + length :]
            if kind == until:
                return frames
        chunk = sock.recv(65536)
        if not chunk:
            return frames
        buffer += chunk
    raise AssertionError(f"no frame of type {until} in {limit_s} s: {frames}")


def _goaway_code(frames: list[tuple[int, int, int, bytes]]) -> int:
    goaway = [payload for kind, _, _, payload in frames if kind == http2.GOAWAY]
    assert goaway, frames
    return struct.unpack_from(">I", goaway[0], 4)[0]


_SETTINGS = http2.frame(http2.SETTINGS, 0, 0)


def _call_headers(method: str) -> list[tuple[str, str]]:
    """A gRPC call's request headers, for HEADERS frames sent raw."""
    return [(":method", "POST"), (":scheme", "http"), (":path", f"{SERVICE}/{method}"), (":authority", "x"),
            ("content-type", "application/grpc")]  # fmt: skip


@pytest.mark.parametrize(
    ("sent", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", http2.PROTOCOL_ERROR),
        # A 32 KiB frame's header: over the 16 KiB accepted.
        (http2.PREFACE + _SETTINGS + b"\x00\x80\x00\x00\x00\x00\x00\x00\x01", http2.FRAME_SIZE_ERROR),
        # An index far past the HPACK tables.
        (
            http2.PREFACE + http2.frame(http2.HEADERS, http2.END_HEADERS, 1, b"\xff\xff\xff\xff\x0f"),
            http2.COMPRESSION_ERROR,
        ),
        (http2.PREFACE + http2.frame(http2.DATA, 0, 0, b"x"), http2.PROTOCOL_ERROR),
        (http2.PREFACE + http2.frame(http2.PING, 0, 0, b"short"), http2.FRAME_SIZE_ERROR),
        (http2.PREFACE + http2.frame(http2.HEADERS, http2.END_HEADERS, 2, b"\x83"), http2.PROTOCOL_ERROR),
        (
            http2.PREFACE + http2.frame(http2.CONTINUATION, http2.END_HEADERS, 1, b"\x83"),
            http2.PROTOCOL_ERROR,
        ),
    ],
    ids=[
        "http1",
        "frame_too_large",
        "bad_hpack",
        "data_on_stream_0",
        "short_ping",
        "even_stream",
        "lone_continuation",
    ],
)
def test_a_peer_that_breaks_http2_gets_goaway_and_the_next_is_served(
    served: ServerThread, channel: grpc.Channel, sent: bytes, code: int
) -> None:
    with _raw_connection(served.port) as sock:
        sock.sendall(sent)
        frames = _read_frames(sock, http2.GOAWAY)
    assert _goaway_code(frames) == code
    assert _stub(channel, "unary_unary", "Unary")(Bytes(value=b"next"), timeout=10).value == b"next"


def test_a_peer_that_opens_and_resets_streams_without_end_is_cut_off(
    served: ServerThread, channel: grpc.Channel
) -> None:
    """The "rapid reset" attack: each stream opened and reset at once costs the loop a task; past
    the allowance the connection gets GOAWAY ENHANCE_YOUR_CALM, and others are served."""
    encoder = hpack.Encoder()
    headers = _call_headers("Hang")
    sent = bytearray(http2.PREFACE + _SETTINGS)
    for stream_id in range(1, 2 * (RESET_BURST + 1000), 2):
        sent += http2.frame(http2.HEADERS, http2.END_HEADERS, stream_id, encoder.encode(headers))
        sent += http2.frame(http2.RST_STREAM, 0, stream_id, struct.pack(">I", http2.CANCEL))
    with _raw_connection(served.port) as sock:
        sock.sendall(sent)
        frames = _read_frames(sock, http2.GOAWAY)
    assert _goaway_code(frames) == http2.ENHANCE_YOUR_CALM
    assert _stub(channel, "unary_unary", "Unary")(Bytes(value=b"next"), timeout=10).value == b"next"


def _goaway_reason(frames: list[tuple[int, int, int, bytes]]) -> bytes:
    return next(payload for kind, _, _, payload in frames if kind == http2.GOAWAY)[8:]


def test_a_connection_past_the_limit_is_told_why_and_closed(echo: Echo) -> None:
    running = ServerThread(echo.methods(), max_connections=2)
    try:
        with _raw_connection(running.port) as first, _raw_connection(running.port) as second:
            for held in (first, second):
                held.sendall(http2.PREFACE + _SETTINGS)
                _read_frames(held, http2.SETTINGS)
            with _raw_connection(running.port) as third:
                frames = _read_frames(third, http2.GOAWAY)
                assert _goaway_code(frames) == http2.ENHANCE_YOUR_CALM
                assert b"epp.max_connections" in _goaway_reason(frames)
                assert third.recv(1024) == b""  # closed after it
            with grpc.insecure_channel(f"127.0.0.1:{running.port}") as refused:
                with pytest.raises(grpc.RpcError) as raised:
                    _stub(refused, "unary_unary", "Unary")(Bytes(value=b"third"), timeout=2)
                # grpcio retries a connection told GOAWAY until the deadline, never served.
                assert raised.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        # The two held ones closed: their places are free again.
        deadline = time.monotonic() + 5
        while running.call(_connections_open(running.server)) and time.monotonic() < deadline:
            time.sleep(0.02)
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as served_now:
            assert _stub(served_now, "unary_unary", "Unary")(Bytes(value=b"now"), timeout=5).value == b"now"
    finally:
        running.stop()


async def _connections_open(server: GrpcServer) -> int:
    return len(server.connections)


@pytest.mark.parametrize("sent", [b"", http2.PREFACE[:10]], ids=["silent", "half_a_preface"])
def test_a_connection_without_its_preface_in_time_is_closed(echo: Echo, sent: bytes) -> None:
    running = ServerThread(echo.methods(), handshake_timeout_s=0.3)
    try:
        with _raw_connection(running.port) as sock:
            sock.sendall(sent)
            started = time.monotonic()
            frames = _read_frames(sock, http2.GOAWAY)
            assert time.monotonic() - started >= 0.2
            assert _goaway_code(frames) == http2.PROTOCOL_ERROR
            assert b"epp.handshake_timeout_s" in _goaway_reason(frames)
            assert sock.recv(1024) == b""
        assert running.call(_connections_open(running.server)) == 0
        # A connection that speaks in time outlives the timeout.
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            unary = _stub(channel, "unary_unary", "Unary")
            assert unary(Bytes(value=b"one"), timeout=5).value == b"one"
            time.sleep(0.5)
            assert unary(Bytes(value=b"two"), timeout=5).value == b"two"
    finally:
        running.stop()


def test_a_peer_that_resets_each_stream_after_its_answer_as_envoy_does_is_not_cut_off(
    echo: Echo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Envoy's ext_proc client ends every stream with END_STREAM then RST_STREAM, after the picker has
    answered: at any request rate that is no attack (the server answered at its own pace), so it
    must not count against the rapid-reset allowance (here made small: 20, then 10 a second)."""
    monkeypatch.setattr(grpc_server, "RESET_BURST", 20)
    monkeypatch.setattr(grpc_server, "RESETS_PER_S", 10.0)
    running = ServerThread(echo.methods())
    encoder = hpack.Encoder()
    headers = _call_headers("Bidi")
    message = Bytes(value=b"hello").SerializeToString()
    try:
        with _raw_connection(running.port) as sock:
            sock.sendall(http2.PREFACE + _SETTINGS)
            for stream_id in range(1, 2 * 100, 2):
                sock.sendall(
                    http2.frame(http2.HEADERS, http2.END_HEADERS, stream_id, encoder.encode(headers))
                    + http2.frame(http2.DATA, 0, stream_id, struct.pack(">BI", 0, len(message)) + message)
                )
                answered = _read_frames(sock, http2.DATA)
                assert http2.GOAWAY not in [kind for kind, *_ in answered], answered
                assert answered[-1][2] == stream_id
                sock.sendall(
                    http2.frame(http2.DATA, http2.END_STREAM, stream_id, b"")
                    + http2.frame(http2.RST_STREAM, 0, stream_id, struct.pack(">I", http2.CANCEL))
                )
            # Still served: a PING is answered on the same connection, no GOAWAY before it.
            sock.sendall(http2.frame(http2.PING, 0, 0, b"12345678"))
            frames = _read_frames(sock, http2.PING)
            assert http2.GOAWAY not in [kind for kind, *_ in frames]
    finally:
        running.stop()


def test_pings_are_acknowledged_with_their_payload(served: ServerThread) -> None:
    with _raw_connection(served.port) as sock:
        sock.sendall(
            http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + http2.frame(http2.PING, 0, 0, b"12345678")
        )
        frames = _read_frames(sock, http2.PING)
    _, flags, _, payload = frames[-1]
    assert (flags & http2.ACK, payload) == (http2.ACK, b"12345678")
    settings = [
        payload for kind, flags, _, payload in frames if kind == http2.SETTINGS and not flags & http2.ACK
    ]
    advertised = dict(struct.iter_unpack(">HI", settings[0]))
    assert advertised[http2.SETTINGS_MAX_CONCURRENT_STREAMS] == 100


def test_stop_lets_open_calls_end_and_refuses_new_ones(echo: Echo) -> None:
    running = ServerThread(echo.methods())
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        gate = threading.Event()

        def requests() -> Iterator[Bytes]:
            yield Bytes(value=b"before")
            gate.wait(10)
            yield Bytes(value=b"during")

        call = _stub(channel, "stream_stream", "Bidi")(requests(), timeout=20)
        assert next(call).value == b"before"
        stopping = asyncio.run_coroutine_threadsafe(running.server.stop(5.0), running.loop)
        time.sleep(0.3)
        gate.set()
        assert [response.value for response in call] == [b"during"]
        stopping.result(10)
        with pytest.raises(grpc.RpcError) as raised:
            _stub(channel, "unary_unary", "Unary")(Bytes(value=b"after"), timeout=3)
        assert raised.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    running.loop.call_soon_threadsafe(running.loop.stop)
    running.thread.join(10)


def test_health_check_and_watch_follow_the_statuses_set() -> None:
    health = HealthServicer()
    methods = [
        Method("/grpc.health.v1.Health/Check", "unary_unary", health_pb2.HealthCheckRequest, health.Check),
        Method("/grpc.health.v1.Health/Watch", "unary_stream", health_pb2.HealthCheckRequest, health.Watch),
    ]
    running = ServerThread(methods)
    serving = health_pb2.HealthCheckResponse
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as raised:
                stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
            assert next(watch).status == serving.SERVICE_UNKNOWN
            running.loop.call_soon_threadsafe(health.set, "readiness", serving.SERVING)
            assert next(watch).status == serving.SERVING
            assert (
                stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5).status
                == serving.SERVING
            )
            running.loop.call_soon_threadsafe(health.enter_graceful_shutdown)
            assert next(watch).status == serving.NOT_SERVING
            running.loop.call_soon_threadsafe(health.set, "readiness", serving.SERVING)  # ignored now
            time.sleep(0.2)
            check = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
            assert check.status == serving.NOT_SERVING
            watch.cancel()
    finally:
        running.stop()


def test_kept_header_lists_follow_the_dynamic_table() -> None:
    decoder = http2.HeaderBlockDecoder(http2.MAX_HEADER_LIST_BYTES)
    # A literal with incremental indexing adds x-a: 1 at index 62; "\xbe" (indexed 62) reads it.
    add_one, add_two, read_62 = b"\x40\x03x-a\x011", b"\x40\x03x-a\x012", b"\xbe"
    assert decoder.decode(add_one) == [(b"x-a", b"1")]
    assert decoder.decode(read_62) == [(b"x-a", b"1")]
    assert read_62 in decoder._kept and add_one not in decoder._kept
    assert decoder.decode(add_two) == [(b"x-a", b"2")]  # index 62 is now x-a: 2
    assert decoder.decode(read_62) == [(b"x-a", b"2")]  # not the list kept before
    # Envoy's steady-state block: an indexed field, a literal not indexed with an indexed name.
    envoy_like = b"\x83\x04\x0c/test.Echo/X"
    assert http2.leaves_table_untouched(envoy_like)
    assert decoder.decode(envoy_like) == [(b":method", b"POST"), (b":path", b"/test.Echo/X")]
    assert decoder.decode(envoy_like) is decoder.decode(envoy_like)
    assert not http2.leaves_table_untouched(b"\x04\x0b/test")  # cut short
    assert not http2.leaves_table_untouched(b"\x20")  # a table size update
