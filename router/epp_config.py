"""The `epp:` section of proxy.yaml: the endpoint picker `kvgate epp` runs for Envoy (router/epp/,
docs/gateway.md "The endpoint picker"). Schema only; router/config.py loads it with the rest of the
file and checks what needs the file's directory (the TLS files) or the listen address (exposure)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

EppBodyMode = Literal["auto", "buffered", "streamed", "full_duplex_streamed"]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class EppTls(_Section):
    """TLS on the endpoint picker's gRPC listener (`epp.tls`); with `client_ca_file`, mutual TLS:
    only a client (Envoy) holding a certificate that CA signed may open a stream."""

    cert_file: Annotated[str, msgspec.Meta(min_length=1)]
    key_file: Annotated[str, msgspec.Meta(min_length=1)]
    client_ca_file: Annotated[str, msgspec.Meta(min_length=1)] | None = None


class Epp(_Section):
    """`kvgate epp`: the endpoint picker Envoy calls over ext_proc (router/epp/, docs/gateway.md)."""

    # The gRPC listener; 9002 is the Gateway API Inference Extension's conventional port.
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9002
    # A request body over this many bytes gets a 413 immediate response; null: limits.max_body_bytes.
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # The largest gRPC message read or sent; null: the body limit plus 1 MiB (a BUFFERED body
    # arrives in one message, with its headers beside it).
    max_message_bytes: Annotated[int, msgspec.Meta(ge=65536)] | None = None
    # gRPC streams open at once across connections (ext_proc: one per HTTP request); advertised as
    # each connection's HTTP/2 limit; past it a stream gets RESOURCE_EXHAUSTED and Envoy applies its
    # failure_mode_allow.
    max_streams: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 4096
    # gRPC connections open at once (Envoy opens one per worker thread); one past it is told GOAWAY
    # ENHANCE_YOUR_CALM and closed.
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 1024
    # From a connection's accept to its HTTP/2 preface (the TLS handshake included): past it the
    # connection is closed, so connections that never speak cannot hold the limit's places.
    handshake_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 10.0
    # The longest one ext_proc stream may stay open (the whole HTTP exchange, streamed answer included),
    # and the longest a pick whose stream ended first waits for its answer's access-log entry.
    stream_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 900.0
    # From the pick to the response headers: past it the request's load on its engine is released
    # (a request the gateway dropped, or one that never reached the engine, must not hold it).
    response_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    # Picked requests still running past which new ones get a 429 (load shedding); null: never.
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # How Envoy sends request bodies: "auto" reads the mode Envoy announces in the stream's first
    # message (protocol_config) and takes BUFFERED when it announces none. "streamed" is STREAMED
    # with send_body_without_waiting_for_header_response (STREAMED without it cannot be picked on).
    request_body_mode: EppBodyMode = "auto"
    # Envoy sends its gRPC access log to the picker (deploy/envoy/envoy-epp.yaml does). Envoy opens
    # the log's stream with its first entry only, so true lets a pick whose ext_proc stream ended
    # before its answer wait for the answer's entry before any log stream has connected (the first
    # requests after Envoy starts, or after the stream dropped); false waits only while one is
    # connected, and closes the accounting at the ext_proc stream's end otherwise.
    envoy_access_log: bool = True
    # Read `usage` (prompt, cached, completion tokens) from response bodies Envoy sends the
    # picker, chunk by chunk, never holding a streamed answer back.
    usage_from_body: bool = True
    tls: EppTls | None = None
    # Listen beyond loopback without mutual TLS (whoever reaches the port steers routing).
    open: bool = False
