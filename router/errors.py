"""How the gateway's request paths fail: the one error shape it answers with (OpenAI's
`{"error": {"message", "type", "code"}}`), request bodies decoded so that bad JSON is always the
client's 400, and unexpected errors logged without letting a flood of them flood the log."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

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
# One traceback per kind of unexpected error (exception type and the line that raised it) per this
# many seconds; the others are counted and the count is logged with the next traceback.
TRACEBACK_INTERVAL_S = 60.0
# Kinds remembered at most (they are code locations, so few; the bound is for safety).
_MAX_KINDS = 1024


class KvgateError(Exception):
    """The root of every error the gateway (`router`) raises on purpose: `except KvgateError` catches
    them all and nothing else."""


class GatewayError(KvgateError):
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
