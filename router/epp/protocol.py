"""The endpoint picker protocol's messages, on Envoy's ext_proc v3 types: what the picker reads from a
ProcessingRequest (headers, subset hint, served endpoint) and the ProcessingResponses it answers with.

The Gateway API Inference Extension (docs/proposals/004-endpoint-picker-protocol) names the keys:
the pick goes out as the `x-gateway-destination-endpoint` request header and under the `envoy.lb`
namespace of the dynamic metadata, where it is followed by the next best endpoint (`ip:port,ip:port`:
a proxy that retries goes down the list). The header stays one endpoint: Envoy's ORIGINAL_DST reads
it as one address (a list there is 503 UH). The spec asks for the same value in both; the first
endpoint, the one every proxy takes, is the same. The gateway's subset hint comes in under
`envoy.lb.subset_hint`, and the endpoint that served a response under `envoy.lb` as
`x-gateway-destination-endpoint-served`.
"""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"

BodySendMode = processing_mode_pb2.ProcessingMode.BodySendMode
BUFFERED = BodySendMode.Value("BUFFERED")
STREAMED = BodySendMode.Value("STREAMED")
FULL_DUPLEX_STREAMED = BodySendMode.Value("FULL_DUPLEX_STREAMED")
# The request body modes in which the pick can still set the destination header, whatever else
# Envoy announces: BUFFERED (Envoy holds the headers until the body's answer) and
# FULL_DUPLEX_STREAMED (until the headers' answer, which the picker sends after the body's end).
# STREAMED is pickable only with send_body_without_waiting_for_header_response (router/epp/stream.py
# checks it): without it Envoy waits for the headers' answer before it sends the body.
PICKABLE_BODY_MODES = frozenset({BUFFERED, FULL_DUPLEX_STREAMED})
_OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.Value("OVERWRITE_IF_EXISTS_OR_ADD")

ProcessingRequest = ext_proc.ProcessingRequest
ProcessingResponse = ext_proc.ProcessingResponse


def header_pairs(headers: ext_proc.HttpHeaders) -> list[tuple[bytes, bytes]]:
    """The headers as (lower-case name, value) byte pairs, pseudo-headers (`:path`) included.
    Envoy sends values in raw_value; older senders in value."""
    return [
        (header.key.lower().encode(), header.raw_value or header.value.encode())
        for header in headers.headers.headers
    ]


def subset_hint(request: ProcessingRequest) -> frozenset[str] | None:
    """The `ip:port` endpoints the gateway allows this request (None: no hint, every endpoint).
    A hint that is present but empty or malformed allows nothing: the caller answers 503."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return frozenset(item.string_value for item in value.list_value.values if item.string_value)
    if value.HasField("string_value"):
        # Tolerated: one comma-separated string, the form the destination header itself takes.
        return frozenset(part.strip() for part in value.string_value.split(",") if part.strip())
    return frozenset()


def served_endpoint(request: ProcessingRequest) -> str | None:
    """The endpoint Envoy says served the response (`envoy.lb` / SERVED_KEY), None when it says none."""
    namespace = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if namespace is None:
        return None
    value = namespace.fields.get(SERVED_KEY)
    if value is None or not value.string_value:
        return None
    # A list (Envoy tried several) ends with the one that answered.
    return value.string_value.split(",")[-1].strip() or None


def _pick_mutation(endpoints: str) -> ext_proc.CommonResponse:
    header = base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=endpoints.encode())
    return ext_proc.CommonResponse(
        header_mutation=ext_proc.HeaderMutation(
            set_headers=[base_pb2.HeaderValueOption(header=header, append_action=_OVERWRITE)]
        )
    )


def _replace_buffered_body(common: ext_proc.CommonResponse, body: bytes) -> None:
    """Send `body` on in place of the buffered one. In BUFFERED mode Envoy keeps the client's
    content-length: setting it to the new length is the processor's job (processing_mode.proto)."""
    common.body_mutation.body = body
    length = base_pb2.HeaderValue(key="content-length", raw_value=str(len(body)).encode())
    option = base_pb2.HeaderValueOption(header=length, append_action=_OVERWRITE)
    common.header_mutation.set_headers.append(option)


def _pick_metadata(endpoints: str) -> struct_pb2.Struct:
    """`envoy.lb` / DESTINATION_HEADER: the pick, then the fallbacks a proxy with retries may try."""
    metadata = struct_pb2.Struct()
    metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = endpoints
    return metadata


def pick_on_headers(endpoint: str, listed: str | None = None) -> ProcessingResponse:
    """The answer to the request headers that carries the pick (FULL_DUPLEX_STREAMED, or a request
    with no body to read): `endpoint` in the header (ORIGINAL_DST reads one address), `listed` (it,
    then fallbacks; default: it alone) in the metadata."""
    return ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=_pick_mutation(endpoint)),
        dynamic_metadata=_pick_metadata(listed or endpoint),
    )


def pick_on_body(endpoint: str, listed: str | None = None, body: bytes | None = None) -> ProcessingResponse:
    """The answer to a BUFFERED body that carries the pick (Envoy applies the header mutation to the
    request headers it still holds); header and metadata as in pick_on_headers. `body`, when given,
    replaces the request's body (salted, renamed: router/request_routing.py engine_body), content-length
    set to match."""
    common = _pick_mutation(endpoint)
    if body is not None:
        _replace_buffered_body(common, body)
    return ProcessingResponse(
        request_body=ext_proc.BodyResponse(response=common),
        dynamic_metadata=_pick_metadata(listed or endpoint),
    )


def request_headers_continue() -> ProcessingResponse:
    return ProcessingResponse(request_headers=ext_proc.HeadersResponse())


def request_body_continue() -> ProcessingResponse:
    return ProcessingResponse(request_body=ext_proc.BodyResponse())


def pick_on_headers_with_body(endpoint: str, listed: str, body: bytes) -> ProcessingResponse:
    """pick_on_headers for a STREAMED body read to its end whose replacement `body` the chunks'
    answers carry (request_body_replaced): content-length set to its length."""
    answer = pick_on_headers(endpoint, listed)
    length = base_pb2.HeaderValue(key="content-length", raw_value=str(len(body)).encode())
    option = base_pb2.HeaderValueOption(header=length, append_action=_OVERWRITE)
    answer.request_headers.response.header_mutation.set_headers.append(option)
    return answer


def request_body_replaced(body: bytes) -> ProcessingResponse:
    """A STREAMED request body chunk's answer that puts `body` in its place (b"": the chunk dropped):
    the first chunk carries a whole replacement body, the others are cleared."""
    mutation = ext_proc.BodyMutation(body=body) if body else ext_proc.BodyMutation(clear_body=True)
    return ProcessingResponse(
        request_body=ext_proc.BodyResponse(response=ext_proc.CommonResponse(body_mutation=mutation))
    )


def _streamed_body(body: bytes, end_of_stream: bool) -> ext_proc.BodyResponse:
    """A FULL_DUPLEX_STREAMED body chunk (request or response), sent back as it came."""
    return ext_proc.BodyResponse(
        response=ext_proc.CommonResponse(
            body_mutation=ext_proc.BodyMutation(
                streamed_response=ext_proc.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
            )
        )
    )


def request_body_chunk(body: bytes, end_of_stream: bool) -> ProcessingResponse:
    """A FULL_DUPLEX_STREAMED request body chunk: one re-emitted unchanged, or a whole replacement
    body sent in place of the chunks read (Envoy needs no answer per chunk in this mode)."""
    return ProcessingResponse(request_body=_streamed_body(body, end_of_stream))


def request_trailers_continue() -> ProcessingResponse:
    return ProcessingResponse(request_trailers=ext_proc.TrailersResponse())


def response_headers_continue() -> ProcessingResponse:
    return ProcessingResponse(response_headers=ext_proc.HeadersResponse())


def response_body_continue() -> ProcessingResponse:
    return ProcessingResponse(response_body=ext_proc.BodyResponse())


def response_body_chunk(body: bytes, end_of_stream: bool) -> ProcessingResponse:
    """A FULL_DUPLEX_STREAMED response body chunk, passed on unchanged."""
    return ProcessingResponse(response_body=_streamed_body(body, end_of_stream))


def response_trailers_continue() -> ProcessingResponse:
    return ProcessingResponse(response_trailers=ext_proc.TrailersResponse())


def immediate(status: int, body: bytes, details: str) -> ProcessingResponse:
    """Envoy answers the client itself with `status` and the JSON `body` (vLLM's error shape);
    `details` is what Envoy's access log shows as the response code details."""
    content_type = base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")
    return ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext_proc.HeaderMutation(
                set_headers=[base_pb2.HeaderValueOption(header=content_type, append_action=_OVERWRITE)]
            ),
            body=body,
            details=details,
        )
    )
