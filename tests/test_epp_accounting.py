"""`kvgate epp` closes every pick's accounting, whatever becomes of the request: answered, aborted by
the client (the stream cancelled), or never answered (no response headers: released after
epp.response_timeout_s); sheds load with a 429 past epp.max_in_flight; reads `usage` from response
bodies; and serves gRPC health that follows the backends. A real process, a real gRPC client."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgate_testing.backend import BackendProcess, start_backend
from kvgate_testing.ext_proc_client import (
    FULL_DUPLEX_STREAMED,
    BodySendMode,
    ExtProcStream,
    Picked,
    exchange,
    headers_message,
    response_body_message,
    response_headers_message,
)
from kvgate_testing.metrics import metric_samples, sample_key
from kvgate_testing.picker import PickerProcess, start_picker

MODEL = "test-model"
MAX_IN_FLIGHT = 12
# Long enough for every other test's streams on a busy machine.
STREAM_TIMEOUT_S = 6.0
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Count my load."}]}).encode()


@pytest.fixture(scope="module")
def backend() -> Iterator[BackendProcess]:
    backend = start_backend("e0", [MODEL])
    yield backend
    backend.stop()


@pytest.fixture(scope="module")
def epp(backend: BackendProcess) -> Iterator[PickerProcess]:
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": backend.name, "url": backend.url}],
        "policy": {"name": "least_loaded"},
        "health": {"interval_s": 0.2},
        "epp": {
            "response_timeout_s": 1.0,
            "max_in_flight": MAX_IN_FLIGHT,
            "stream_timeout_s": STREAM_TIMEOUT_S,
        },
    }
    with start_picker(config) as epp:
        yield epp


@pytest.fixture(scope="module")
def channel(epp: PickerProcess) -> Iterator[grpc.Channel]:
    with epp.channel() as channel:
        yield channel


def samples(epp: PickerProcess) -> dict:
    import httpx

    return metric_samples(httpx.get(f"{epp.url}/metrics", timeout=10).text)


def backend_in_flight(epp: PickerProcess) -> int:
    import httpx

    (backend,) = httpx.get(f"{epp.url}/backends", timeout=10).json()["backends"]
    return backend["in_flight"]


def wait_until_idle(epp: PickerProcess, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if backend_in_flight(epp) == 0 and samples(epp)[sample_key("kvgate_epp_in_flight")] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(
        f"in-flight never returned to zero: backend {backend_in_flight(epp)}, "
        f"picker {samples(epp)[sample_key('kvgate_epp_in_flight')]}"
    )


def answered(stream: ExtProcStream) -> None:
    stream.send(response_headers_message(200, content_type="text/event-stream"))
    stream.recv()
    stream.send(response_body_message(b'data: {"choices": []}\n\ndata: [DONE]\n\n', True))
    stream.recv()
    stream.close()


def test_in_flight_returns_to_zero_after_a_burst_with_answers_aborts_and_silence(
    epp: PickerProcess, channel: grpc.Channel
) -> None:
    wait_until_idle(epp)
    before = samples(epp)
    picked: list[ExtProcStream] = []
    lock = threading.Lock()

    def one(index: int) -> None:
        stream = ExtProcStream(channel)
        mode = FULL_DUPLEX_STREAMED if index % 2 else None
        result = exchange(stream, "/v1/chat/completions", BODY, **({"mode": mode} if mode else {}))
        assert result.header, result.body
        with lock:
            picked.append(stream)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(MAX_IN_FLIGHT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(picked) == MAX_IN_FLIGHT
    # Every pick counts on the engine until its answer ends.
    assert backend_in_flight(epp) == MAX_IN_FLIGHT
    third = MAX_IN_FLIGHT // 3
    for stream in picked[:third]:
        answered(stream)
    for stream in picked[third : 2 * third]:
        stream.cancel()  # the client went away: Envoy resets the stream
    # The last third never hear back: no response headers, the stream left open.
    wait_until_idle(epp)
    after = samples(epp)

    def finished(how: str) -> float:
        key = sample_key("kvgate_epp_finished_total", how=how)
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert finished("response_end") == third
    assert finished("stream_closed") == third
    assert finished("response_timeout") == MAX_IN_FLIGHT - 2 * third
    for stream in picked[2 * third :]:
        stream.close()


def test_past_max_in_flight_new_requests_get_a_429(epp: PickerProcess, channel: grpc.Channel) -> None:
    wait_until_idle(epp)
    held = []
    for _ in range(MAX_IN_FLIGHT):
        stream = ExtProcStream(channel)
        assert exchange(stream, "/v1/chat/completions", BODY).header
        held.append(stream)
    stream = ExtProcStream(channel)
    refused = exchange(stream, "/v1/chat/completions", BODY)
    assert refused.status == 429 and refused.details == "kvgate_epp_shed"
    assert "epp.max_in_flight" in json.loads(refused.body)["error"]["message"]
    for stream in held:
        answered(stream)
    wait_until_idle(epp)
    stream = ExtProcStream(channel)
    assert exchange(stream, "/v1/chat/completions", BODY).header  # admitted again
    answered(stream)


def test_usage_in_a_streamed_answer_is_read_across_chunks(epp: PickerProcess, channel: grpc.Channel) -> None:
    cached = sample_key("kvgate_epp_usage_tokens_total", kind="cached")
    prompt = sample_key("kvgate_epp_usage_tokens_total", kind="prompt")
    before = samples(epp)
    stream = ExtProcStream(channel)
    assert exchange(stream, "/v1/chat/completions", BODY).header
    stream.send(response_headers_message(200, content_type="text/event-stream"))
    stream.recv()
    event = b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,'
    event += b'"prompt_tokens_details":{"cached_tokens":32}}}\n\ndata: [DONE]\n\n'
    # The usage event split across two body messages, as TCP may cut it.
    stream.send(response_body_message(b'data: {"choices":[{"delta":{}}]}\n\n' + event[:30], False))
    stream.recv()
    stream.send(response_body_message(event[30:], True))
    stream.recv()
    stream.close()
    wait_until_idle(epp)
    after = samples(epp)
    assert after[cached] - before.get(cached, 0.0) == 32
    assert after[prompt] - before.get(prompt, 0.0) == 40


def test_grpc_health_follows_the_backends(
    epp: PickerProcess, backend: BackendProcess, channel: grpc.Channel
) -> None:
    stub = health_pb2_grpc.HealthStub(channel)

    def status(service: str) -> int:
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def wait_for(service: str, wanted: int) -> None:
        deadline = time.monotonic() + 15
        while status(service) != wanted:
            assert time.monotonic() < deadline, f"{service!r} never became {wanted}"
            time.sleep(0.05)

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert status(service) == serving
    backend.set_mode(health_status=503)
    try:
        wait_for("readiness", not_serving)
        assert status("envoy.service.ext_proc.v3.ExternalProcessor") == not_serving
        assert status("liveness") == serving  # alive, only not ready
    finally:
        backend.reset()
    wait_for("readiness", serving)


@pytest.mark.parametrize("mode", ["NONE", "STREAMED", "BUFFERED_PARTIAL"])
def test_a_body_mode_where_no_pick_can_be_made_is_refused_not_let_through(
    channel: grpc.Channel, mode: str
) -> None:
    """With these modes Envoy would send the request on before the picker could name its endpoint
    (STREAMED without send_body_without_waiting_for_header_response: it waits for the headers'
    answer before it sends the body)."""
    stream = ExtProcStream(channel)
    stream.send(
        headers_message(
            "/v1/chat/completions", body_mode=BodySendMode.Value(mode), send_body_without_waiting=False
        )
    )
    picked = Picked()
    picked.take(stream.recv())
    assert picked.status == 500 and picked.details == "kvgate_epp_body_mode_unsupported"
    message = json.loads(picked.body)["error"]["message"]
    assert mode in message and "send_body_without_waiting_for_header_response: true" in message
    assert stream.recv() is None


def test_a_stream_that_never_sends_its_body_is_ended_after_the_stream_timeout(channel: grpc.Channel) -> None:
    stream = ExtProcStream(channel)
    started = time.monotonic()
    stream.send(headers_message("/v1/chat/completions"))
    assert stream.recv().WhichOneof("response") == "request_headers"
    # No body follows: the picker holds nothing for it past epp.stream_timeout_s.
    assert stream.recv(timeout_s=STREAM_TIMEOUT_S + 20) is None
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started >= STREAM_TIMEOUT_S - 0.5
