"""The one error shape the gateway answers with: OpenAI's `{"error": {"message", "type", "code"}}`."""

from __future__ import annotations

import msgspec

_encoder = msgspec.json.Encoder()

# HTTP status -> OpenAI error type, as vLLM and OpenAI name them.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


class GatewayError(Exception):
    """An error the client must see, with its HTTP status; raised anywhere on the request path."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(status: int, message: str) -> bytes:
    """The JSON bytes of an OpenAI-shaped error."""
    error = {"message": message, "type": ERROR_TYPES.get(status, "error"), "code": status}
    return _encoder.encode({"error": error})


async def send_error(send, status: int, message: str, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Answer an ASGI request with an OpenAI-shaped error."""
    body = error_body(status, message)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
