"""A real gRPC client speaking Envoy's ext_proc v3 to an endpoint picker, as Envoy does: one
bidirectional stream per HTTP request (`ExtProcStream`), and `exchange` for a whole request in
any body mode the picker serves (BUFFERED: waits for the headers' answer before the body, as Envoy
does; STREAMED with send_body_without_waiting_for_header_response and FULL_DUPLEX_STREAMED: sends
headers and chunks without waiting)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from google.protobuf import struct_pb2

BodySendMode = processing_mode_pb2.ProcessingMode.BodySendMode
BUFFERED = BodySendMode.Value("BUFFERED")
STREAMED = BodySendMode.Value("STREAMED")  # announced with send_body_without_waiting_for_header_response
FULL_DUPLEX_STREAMED = BodySendMode.Value("FULL_DUPLEX_STREAMED")
# The request body modes the picker serves, by the names tests parametrize with.
BODY_MODES = {"buffered": BUFFERED, "streamed": STREAMED, "full_duplex_streamed": FULL_DUPLEX_STREAMED}
_END = object()


class ExtProcStream:
    """One ext_proc stream: `send` messages, `recv` answers (None once the picker ended the stream)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._outgoing: queue.Queue = queue.Queue()
        self._incoming: queue.Queue = queue.Queue()
        stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
        self.call = stub.Process(iter(self._outgoing.get, _END))
        self.error: grpc.RpcError | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self._incoming.put(response)
        except grpc.RpcError as exc:
            self.error = exc
        self._incoming.put(None)

    def send(self, message: ext_proc.ProcessingRequest) -> None:
        self._outgoing.put(message)

    def recv(self, timeout_s: float = 10.0) -> ext_proc.ProcessingResponse | None:
        return self._incoming.get(timeout=timeout_s)

    def close(self) -> None:
        """End the stream as Envoy does when the HTTP exchange is over."""
        self._outgoing.put(_END)

    def cancel(self) -> None:
        """Drop the stream (the client aborted, Envoy reset it)."""
        self.call.cancel()


def headers_message(
    path: str,
    *,
    method: str = "POST",
    end_of_stream: bool = False,
    extra: Sequence[tuple[str, str]] = (),
    subset: Sequence[str] | None = None,
    body_mode: int | None = BUFFERED,
    response_body_mode: int = BodySendMode.Value("NONE"),
    send_body_without_waiting: bool | None = None,
) -> ext_proc.ProcessingRequest:
    """Envoy's first message of a stream: the request headers and the modes it announces
    (`send_body_without_waiting`: None, on for STREAMED, the mode the picker serves)."""
    if send_body_without_waiting is None:
        send_body_without_waiting = body_mode == STREAMED
    pairs = [(":method", method), (":path", path), (":authority", "gateway"), *extra]
    if not end_of_stream:
        pairs.append(("content-type", "application/json"))
    headers = ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=key, raw_value=value.encode()) for key, value in pairs]
        ),
        end_of_stream=end_of_stream,
    )
    message = ext_proc.ProcessingRequest(request_headers=headers)
    if body_mode is not None:
        message.protocol_config.request_body_mode = body_mode
        message.protocol_config.response_body_mode = response_body_mode
        message.protocol_config.send_body_without_waiting_for_header_response = send_body_without_waiting
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(list(subset))
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def body_message(chunk: bytes, end_of_stream: bool) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=chunk, end_of_stream=end_of_stream))


def response_headers_message(
    status: int,
    served: str | None = None,
    content_type: str = "application/json",
    end_of_stream: bool = False,
) -> ext_proc.ProcessingRequest:
    pairs = [(":status", str(status)), ("content-type", content_type)]
    headers = ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=key, raw_value=value.encode()) for key, value in pairs]
        ),
        end_of_stream=end_of_stream,
    )
    message = ext_proc.ProcessingRequest(response_headers=headers)
    if served is not None:
        lb = struct_pb2.Struct()
        lb.fields["x-gateway-destination-endpoint-served"].string_value = served
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
    return message


def response_body_message(chunk: bytes, end_of_stream: bool) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(
        response_body=ext_proc.HttpBody(body=chunk, end_of_stream=end_of_stream)
    )


class Picked:
    """What the picker answered for one request: the pick (header and metadata), or an immediate
    response, the request headers it set, the body it sent in place of the client's (None: none;
    STREAMED: the first chunk's replacement), in FULL_DUPLEX_STREAMED mode the body chunks it emitted,
    and in STREAMED mode each chunk's answer (None: passed on as it came, else the bytes put in its
    place, b"" for a chunk cleared)."""

    def __init__(self) -> None:
        self.header: str | None = None
        self.metadata: str | None = None
        self.status: int | None = None
        self.body: bytes = b""
        self.details = ""
        self.echoed: list[tuple[bytes, bool]] = []
        self.kinds: list[str] = []
        self.set_headers: dict[str, str] = {}
        self.replaced_body: bytes | None = None
        self.chunk_answers: list[bytes | None] = []

    def take(self, response: ext_proc.ProcessingResponse) -> None:
        kind = response.WhichOneof("response")
        self.kinds.append(kind)
        if kind == "immediate_response":
            immediate = response.immediate_response
            self.status, self.body, self.details = immediate.status.code, immediate.body, immediate.details
            return
        common = getattr(response, kind).response
        for option in common.header_mutation.set_headers:
            self.set_headers[option.header.key] = option.header.raw_value.decode()
            if option.header.key == "x-gateway-destination-endpoint":
                self.header = option.header.raw_value.decode()
        if common.body_mutation.HasField("body"):
            self.replaced_body = common.body_mutation.body
        if common.body_mutation.HasField("streamed_response"):
            streamed = common.body_mutation.streamed_response
            self.echoed.append((streamed.body, streamed.end_of_stream))
        elif kind == "request_body":
            mutation = common.body_mutation
            self.chunk_answers.append(
                mutation.body if mutation.HasField("body") else b"" if mutation.clear_body else None
            )
        lb = response.dynamic_metadata.fields.get("envoy.lb")
        if lb is not None:
            self.metadata = lb.struct_value.fields["x-gateway-destination-endpoint"].string_value


def exchange(
    stream: ExtProcStream,
    path: str,
    body: bytes,
    *,
    mode: int = BUFFERED,
    chunk_size: int | None = None,
    subset: Sequence[str] | None = None,
    extra: Sequence[tuple[str, str]] = (),
    timeout_s: float = 10.0,
) -> Picked:
    """Send one request's headers and body as Envoy would in `mode` and read the picker's answers up
    to the pick (or its immediate response). The stream stays open for the response phase."""
    picked = Picked()
    stream.send(headers_message(path, end_of_stream=not body, extra=extra, subset=subset, body_mode=mode))
    if not body:
        response = stream.recv(timeout_s)
        if response is not None:
            picked.take(response)
        return picked
    if mode == BUFFERED:
        response = stream.recv(timeout_s)
        assert response is not None, f"the picker ended the stream: {stream.error}"
        picked.take(response)
        if picked.status is not None:
            return picked
        stream.send(body_message(body, True))
        response = stream.recv(timeout_s)
        if response is not None:
            picked.take(response)
        return picked
    size = chunk_size or len(body)
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    for index, chunk in enumerate(chunks):
        stream.send(body_message(chunk, index == len(chunks) - 1))
    # The headers' answer, then one answer per chunk (or one immediate response).
    while True:
        response = stream.recv(timeout_s)
        if response is None:
            return picked
        picked.take(response)
        if picked.status is not None or (picked.echoed and picked.echoed[-1][1]):
            return picked
        if mode == STREAMED and len(picked.chunk_answers) == len(chunks):
            return picked


def bearer(key: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {key}")


def exchange_with_key(
    channel: grpc.Channel, key: str, body: bytes, mode: str, path: str = "/v1/chat/completions"
) -> Picked:
    """One request from a client holding API key `key`, on a stream of its own, in body mode `mode`
    (a BODY_MODES name; streamed bodies in 40-byte chunks), read up to the pick."""
    stream = ExtProcStream(channel)
    try:
        return exchange(stream, path, body, mode=BODY_MODES[mode], chunk_size=40, extra=[bearer(key)])
    finally:
        stream.close()
