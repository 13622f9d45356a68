"""How the gateway's request paths fail: the one error shape it answers with (vLLM's ErrorResponse,
`{"error": {"message", "type", "param", "code"}}`, which the simulated engine answers with too),
request bodies decoded so that bad JSON is always the client's 400, and unexpected errors logged
without letting a flood of them flood the log."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()

# The error `type` of each HTTP status, as vLLM names it. vLLM's handlers name the errors they raise
# after their class (create_error_response: BadRequestError, NotFoundError, ...); what its framework
# answers (an unknown route, a method not allowed, a body that fails the request schema) carries the
# status's reason phrase (its HTTP-exception and validation handlers). The phrases are written out
# here, not read from http.HTTPStatus, whose wording changed in Python 3.13 (413, 422).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    404: "NotFoundError",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Request Entity Too Large",
    422: "UnprocessableEntityError",
    431: "Request Header Fields Too Large",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
# vLLM's type for a request body that fails its request schema before any handler runs: JSON that
# does not parse, a required field missing, a field of the wrong type (its validation handler).
SCHEMA_ERROR_TYPE = "Bad Request"
# vLLM's type for a route that does not exist (its HTTP-exception handler).
NO_ROUTE_ERROR_TYPE = "Not Found"
# One traceback per kind of unexpected error (exception type and the line that raised it) per this
# many seconds; the others are counted and the count is logged with the next traceback.
TRACEBACK_INTERVAL_S = 60.0
# Kinds remembered at most (they are code locations, so few; the bound is for safety).
_MAX_KINDS = 1024


class KvgateError(Exception):
    """The root of every error the gateway (`router`) raises on purpose: `except KvgateError` catches
    them all and nothing else."""


class GatewayError(KvgateError):
    """An error the client must see, with its HTTP status; raised anywhere on the request path.
    `param` names the request field at fault; `error_type` overrides the status's ERROR_TYPES entry."""

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type


def error_body(status: int, message: str, param: str | None = None, error_type: str | None = None) -> bytes:
    """The JSON bytes of vLLM's ErrorResponse: `{"error": {"message", "type", "param", "code"}}`,
    `code` the HTTP status (an integer, as vLLM sends it)."""
    error = {
        "message": message,
        "type": error_type or status_error_type(status),
        "param": param,
        "code": status,
    }
    return _encoder.encode({"error": error})


def status_error_type(status: int) -> str:
    """vLLM's error `type` for an HTTP status (ERROR_TYPES; its class names for the others)."""
    return ERROR_TYPES.get(status) or ("InternalServerError" if status >= 500 else "BadRequestError")


def gateway_error_body(error: GatewayError) -> bytes:
    return error_body(error.status, error.message, error.param, error.error_type)


async def send_error(
    send,
    status: int,
    message: str,
    extra_headers: list[tuple[bytes, bytes]] = (),
    body: bytes | None = None,
) -> None:
    """Answer an ASGI request with vLLM's error shape (`body`, when given, is the encoded error)."""
    if body is None:
        body = error_body(status, message)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def decode_json_body(decoder: msgspec.json.Decoder, body: bytes) -> Any:
    """`decoder.decode(body)`; JSON nested deeper than the decoder can follow is a msgspec.DecodeError
    like any other invalid body (msgspec raises RecursionError, which would otherwise be a 500)."""
    try:
        return decoder.decode(body)
    except RecursionError:
        raise msgspec.DecodeError(
            "JSON nested too deeply to decode (an OpenAI request nests a few levels, not hundreds)"
        ) from None


class _TracebackThrottle:
    """Per kind of error: when its last traceback was logged, and how many were not logged since."""

    def __init__(self) -> None:
        self._kinds: dict[tuple[str, str, int], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def admit(self, kind: tuple[str, str, int], interval_s: float) -> int | None:
        """The count suppressed since the last traceback of `kind` if one may be logged now, else None."""
        now = time.monotonic()
        with self._lock:
            logged_at, suppressed = self._kinds.get(kind, (float("-inf"), 0))
            if now - logged_at < interval_s:
                self._kinds[kind] = (logged_at, suppressed + 1)
                return None
            if kind not in self._kinds and len(self._kinds) >= _MAX_KINDS:
                self._kinds.clear()
            self._kinds[kind] = (now, 0)
            return suppressed


_throttle = _TracebackThrottle()


def log_unexpected(
    logger: logging.Logger,
    exc: BaseException,
    message: str,
    *args: object,
    level: int = logging.ERROR,
    interval_s: float = TRACEBACK_INTERVAL_S,
) -> None:
    """Log an error the gateway did not expect (a bug, a broken tokenizer) with its traceback, at most
    once per kind per `interval_s`: one request that triggers it again and again must not fill the
    disk nor drown the other messages. The next traceback of that kind says how many were skipped."""
    frame = exc.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    where = ("", 0) if frame is None else (frame.tb_frame.f_code.co_filename, frame.tb_lineno)
    suppressed = _throttle.admit((type(exc).__qualname__, *where), interval_s)
    if suppressed is None:
        return
    if suppressed:
        message += f" ({suppressed} more like it since the last one were not logged)"
    logger.log(level, message, *args, exc_info=exc)
