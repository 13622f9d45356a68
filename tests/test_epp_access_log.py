"""`kvgate epp` ends a pick's accounting on Envoy's access-log entry (router/epp/access_log.py) when its
ext_proc stream ended before the answer: a real picker process, a real gRPC client playing Envoy on
both services (ext_proc, and envoy.service.accesslog.v3 with entries as Envoy sends them), and the
real Envoy for the first request after it starts."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from envoy.config.core.v3 import address_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import wrappers_pb2

from kvgate_testing.backend import BackendProcess, start_backend
from kvgate_testing.envoy import ResponseBodyMode
from kvgate_testing.ext_proc_client import ExtProcStream, exchange
from kvgate_testing.picker import PickerProcess, start_picker
from kvgate_testing.routers import start_envoy_and_picker_with_modes
from kvgate_testing.waiting import wait_for

MODEL = "test-model"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Log my end."}]}).encode()
_END = object()


@pytest.fixture(scope="module")
def backends() -> Iterator[list[BackendProcess]]:
    started = [start_backend(f"e{i}", [MODEL]) for i in range(2)]
    yield started
    for backend in started:
        backend.stop()


@pytest.fixture(scope="module")
def epp(backends: list[BackendProcess]) -> Iterator[PickerProcess]:
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": backend.name, "url": backend.url} for backend in backends],
        "policy": {"name": "least_loaded"},
        "health": {"interval_s": 0.2},
    }
    with start_picker(config) as epp:
        yield epp


@pytest.fixture(scope="module")
def channel(epp: PickerProcess) -> Iterator[grpc.Channel]:
    with epp.channel() as channel:
        yield channel


class AccessLogStream:
    """Envoy's side of the access-log service: one long-lived stream, entries sent as batches."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._outgoing: queue.Queue = queue.Queue()
        stub = als_pb2_grpc.AccessLogServiceStub(channel)
        self.future = stub.StreamAccessLogs.future(iter(self._outgoing.get, _END))
        self._first = True

    def send(self, *entries: accesslog_pb2.HTTPAccessLogEntry) -> None:
        message = als_pb2.StreamAccessLogsMessage()
        if self._first:  # Envoy names itself and the log in the stream's first message only
            message.identifier.log_name = "kvgate_epp"
            message.identifier.node.id = "test-envoy"
            self._first = False
        message.http_logs.log_entry.extend(entries)
        self._outgoing.put(message)

    def close(self) -> None:
        self._outgoing.put(_END)
        self.future.result(timeout=10)


def entry(request_id: str, status: int, served: str | None) -> accesslog_pb2.HTTPAccessLogEntry:
    log = accesslog_pb2.HTTPAccessLogEntry()
    log.request.request_id = request_id
    if status:
        log.response.response_code.CopyFrom(wrappers_pb2.UInt32Value(value=status))
    if served is not None:
        host, port = served.rsplit(":", 1)
        log.common_properties.upstream_remote_address.CopyFrom(
            address_pb2.Address(socket_address=address_pb2.SocketAddress(address=host, port_value=int(port)))
        )
    return log


def in_flight(epp: PickerProcess) -> dict[str, int]:
    listed = httpx.get(f"{epp.url}/backends", timeout=10).json()["backends"]
    return {backend["name"]: backend["in_flight"] for backend in listed}


def endpoint_of(backend: BackendProcess) -> str:
    return backend.url.removeprefix("http://")


def pick_and_end_stream(channel: grpc.Channel, request_id: str) -> str:
    """A BUFFERED pick whose ext_proc stream Envoy then ends normally, as with the response not sent."""
    stream = ExtProcStream(channel)
    picked = exchange(stream, "/v1/chat/completions", BODY, extra=[("x-request-id", request_id)])
    assert picked.header, picked.body
    stream.close()
    assert stream.recv() is None  # the picker ended its side too
    return picked.header


def test_before_envoy_opens_its_log_stream_a_pick_waits_for_its_entry(
    epp: PickerProcess, channel: grpc.Channel
) -> None:
    """epp.envoy_access_log (the default): Envoy opens the log's stream with its first entry, so the
    first picks after it starts wait for theirs with no stream connected yet."""
    before = epp.finished().get("stream_closed", 0)
    pick_and_end_stream(channel, "first-1")
    time.sleep(0.5)
    assert sum(in_flight(epp).values()) == 1
    log = AccessLogStream(channel)
    try:
        log.send(entry("first-1", 200, None))  # the entry that opens the stream
        wait_for(lambda: sum(in_flight(epp).values()) == 0, 10, "the load released on the first entry")
    finally:
        log.close()
    assert epp.finished().get("stream_closed", 0) == before, epp.finished()


def test_with_envoy_access_log_false_and_no_log_stream_a_pick_closes_at_its_stream_end(
    backends: list[BackendProcess],
) -> None:
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": backend.name, "url": backend.url} for backend in backends],
        "epp": {"envoy_access_log": False},
    }
    with start_picker(config) as epp, epp.channel() as channel:
        pick_and_end_stream(channel, "no-log-1")
        wait_for(lambda: sum(in_flight(epp).values()) == 0, 10, "the load released at the stream's end")
        assert epp.finished()["stream_closed"] == 1


def test_an_entry_that_never_comes_ends_the_wait_at_the_stream_timeout_with_a_warning(
    backends: list[BackendProcess],
) -> None:
    """epp.envoy_access_log true and an Envoy that does not log here: the wait is bounded, and the
    picker says what to fix."""
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": backend.name, "url": backend.url} for backend in backends],
        "epp": {"stream_timeout_s": 1.0},
    }
    with start_picker(config) as epp, epp.channel() as channel:
        pick_and_end_stream(channel, "never-logged")
        assert sum(in_flight(epp).values()) == 1
        wait_for(lambda: sum(in_flight(epp).values()) == 0, 10, "the load released at the timeout")
        assert epp.finished() == {"access_log_timeout": 1}
        assert "set epp.envoy_access_log: false" in epp.output()


def test_with_the_access_log_connected_the_entry_ends_the_pick_and_names_the_engine(
    epp: PickerProcess, channel: grpc.Channel, backends: list[BackendProcess]
) -> None:
    log = AccessLogStream(channel)
    try:
        log.send()  # connect: Envoy opens the stream with its first batch
        time.sleep(0.3)
        picked = pick_and_end_stream(channel, "logged-1")
        other = next(backend for backend in backends if endpoint_of(backend) != picked)
        time.sleep(0.5)
        # The stream ended, the answer did not: the load stays on the picked engine.
        assert sum(in_flight(epp).values()) == 1
        # An entry naming no open pick changes nothing.
        log.send(entry("someone-else", 200, picked))
        time.sleep(0.3)
        assert sum(in_flight(epp).values()) == 1
        # Envoy says another engine served it (a retry down the fallback list) and how it ended.
        log.send(entry("logged-1", 200, endpoint_of(other)))
        wait_for(lambda: sum(in_flight(epp).values()) == 0, 10, "the load released on the entry")
        assert epp.finished()["access_log"] >= 1
        # A pick still waiting when Envoy's log stream goes away is closed with it.
        pick_and_end_stream(channel, "logged-2")
        time.sleep(0.3)
        assert sum(in_flight(epp).values()) == 1
    finally:
        log.close()
    wait_for(lambda: sum(in_flight(epp).values()) == 0, 10, "the waiting pick closed with the log stream")
    assert epp.finished()["access_log_closed"] >= 1


def test_a_pick_made_before_the_log_stream_closed_no_longer_waits_and_one_made_after_does(
    epp: PickerProcess, channel: grpc.Channel
) -> None:
    """The closed stream may have been Envoy going away with its requests: a pick it made no longer
    waits for an entry. An Envoy still there opens a stream again with its next entry: the picks made
    after the close wait for theirs (epp.envoy_access_log)."""
    log = AccessLogStream(channel)
    log.send()
    time.sleep(0.3)
    before = epp.finished()
    stream = ExtProcStream(channel)
    picked = exchange(stream, "/v1/chat/completions", BODY, extra=[("x-request-id", "before-close")])
    assert picked.header, picked.body
    log.close()
    time.sleep(0.3)
    stream.close()  # the pick's stream ends after the log's
    assert stream.recv() is None
    wait_for(lambda: sum(in_flight(epp).values()) == 0, 10, "the pick made before the close closed at once")
    assert epp.finished().get("stream_closed", 0) == before.get("stream_closed", 0) + 1
    pick_and_end_stream(channel, "after-close")
    time.sleep(0.5)
    assert sum(in_flight(epp).values()) == 1
    log = AccessLogStream(channel)
    try:
        log.send(entry("after-close", 200, None))  # Envoy, still there, logs again
        wait_for(lambda: sum(in_flight(epp).values()) == 0, 10, "the load released on the new stream's entry")
    finally:
        log.close()


def test_a_reset_stream_is_closed_by_its_entry_with_no_status(
    epp: PickerProcess, channel: grpc.Channel
) -> None:
    """A client that left: Envoy resets the ext_proc stream and logs the request with no response."""
    log = AccessLogStream(channel)
    try:
        log.send()
        time.sleep(0.3)
        before = epp.finished().get("access_log", 0)
        stream = ExtProcStream(channel)
        picked = exchange(stream, "/v1/chat/completions", BODY, extra=[("x-request-id", "reset-1")])
        assert picked.header
        stream.cancel()
        time.sleep(0.3)
        log.send(entry("reset-1", 0, None))
        wait_for(lambda: sum(in_flight(epp).values()) == 0, 10, "the load released on the reset's entry")
        assert epp.finished()["access_log"] == before + 1
    finally:
        log.close()


def test_entries_arrive_batched_from_one_stream(epp: PickerProcess, channel: grpc.Channel) -> None:
    log = AccessLogStream(channel)
    try:
        log.send()
        time.sleep(0.3)
        ids = [f"batch-{i}" for i in range(6)]
        threads = [threading.Thread(target=pick_and_end_stream, args=(channel, rid)) for rid in ids]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        time.sleep(0.3)
        assert sum(in_flight(epp).values()) == len(ids)
        log.send(*(entry(rid, 200, None) for rid in ids))
        wait_for(lambda: sum(in_flight(epp).values()) == 0, 10, "one batch closed every pick")
    finally:
        log.close()


# Envoy ends the ext_proc stream right after the response headers' answer in these modes (the request
# body streamed, the response headers sent, its body not): only the access log tells the answer's end.
STREAM_ENDS_AT_RESPONSE_HEADERS = {
    "request_body_mode": "FULL_DUPLEX_STREAMED",
    "request_trailer_mode": "SEND",
    "response_header_mode": "SEND",
    "response_body_mode": "NONE",
    "response_trailer_mode": "SKIP",
}


def test_the_first_request_after_envoy_starts_holds_its_load_until_its_answer_ends(
    backends: list[BackendProcess],
) -> None:
    """The real Envoy, fresh, in front of a fresh picker: its first request is a long streamed answer
    (20 chunks 0.1 s apart). Envoy has no access-log stream open yet (it opens it with its first
    entry) and closes the ext_proc stream at the response headers: the load stays on the engine
    until the answer's last chunk, then goes."""
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": backend.name, "url": backend.url} for backend in backends],
        "policy": {"name": "least_loaded"},
        "health": {"interval_s": 0.2},
    }
    modes = STREAM_ENDS_AT_RESPONSE_HEADERS
    with start_envoy_and_picker_with_modes(config, ResponseBodyMode.NONE, modes, 60.0) as pair:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a long one"}], "stream": True}
        headers = {"x-test-chunks": "20", "x-test-chunk-delay-ms": "100"}
        loads = []
        with httpx.stream(
            "POST", f"{pair.url}/v1/chat/completions", json=body, headers=headers, timeout=30
        ) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()
            next(chunks)
            # Envoy has closed the picker's stream for this request: the answer goes on without it.
            stats = pair.envoy.stats("http.inference.ext_proc.")
            assert stats["http.inference.ext_proc.streams_closed"] == 1, stats
            for _ in range(5):
                loads.append(in_flight(pair.picker))
                time.sleep(0.2)
            rest = b"".join(chunks)
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert all(sorted(load.values()) == [0, 1] for load in loads), loads
        wait_for(lambda: sum(in_flight(pair.picker).values()) == 0, 10, "the load released at the end")
        assert pair.picker.finished() == {"access_log": 1}, pair.picker.finished()
