"""What vLLM refuses before it generates, refused by the simulated engine in the same words and shape,
so that nothing is served (or benchmarked) that a real engine would answer with a 400.

Two stages, as in vLLM:
- the request schema (vLLM's pydantic models): each known field must have its type, read leniently
  as pydantic reads JSON (`"0.5"` is a number, `3.0` an integer, `"hot"` is not a number); a miss is
  a 400 of type "Bad Request" whose `param` is the field's location (`body.temperature`);
- the sampling parameters' ranges (vLLM's SamplingParams checks): `n >= 1`, `temperature >= 0`,
  `top_p` in (0, 1], `top_k` -1, 0 or >= 1, `min_p` in [0, 1], penalties in [-2, 2],
  `repetition_penalty > 0`, max tokens >= 1, `min_tokens >= 0`; a miss is a BadRequestError whose
  `param` is the field.

Each API checks its own fields only (vLLM ignores fields a request model does not declare).
Message roles: /v1/chat/completions takes any role string, as vLLM does (its custom-role message
type); the Responses and Messages APIs' roles are checked where their bodies are read
(router/api_formats.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.errors import SCHEMA_ERROR_TYPE, KvgateError

_INT64 = 2**63


class RequestRefused(KvgateError):
    """A request vLLM would answer with an error; `error_type` None means the status's own type."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, error_type: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.param = param
        self.error_type = error_type


def schema_error(message: str, field: str) -> RequestRefused:
    """The 400 of a body that fails vLLM's request schema at `field`."""
    return RequestRefused(message, 400, f"body.{field}" if field else "body", SCHEMA_ERROR_TYPE)


_STOP = str | list[str] | None
# Each field's type, and how an error names it.
_NUMBER = (float | None, "a number")
_INTEGER = (int | None, "an integer")
_SAMPLING = {
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": _INTEGER,
    "seed": _INTEGER,
    "stream": (bool | None, "a boolean"),
}
_OPENAI = {
    **_SAMPLING,
    "n": _INTEGER,
    "min_p": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "repetition_penalty": _NUMBER,
    "max_tokens": _INTEGER,
    "min_tokens": _INTEGER,
    "stop": (_STOP, "a string or a list of strings"),
}
# The fields each API's request model declares.
FIELDS = {
    "completions": _OPENAI,
    "chat": {**_OPENAI, "max_completion_tokens": _INTEGER},
    "responses": {**_SAMPLING, "max_output_tokens": _INTEGER},
    "messages": {
        **_SAMPLING,
        "max_tokens": (int, "an integer"),
        "stop_sequences": (list[str] | None, "a list of strings"),
    },
}


def check_request(body: dict[str, Any], api: str) -> dict[str, Any]:
    """The known fields of `body` for `api` (a FIELDS key) read as their types, after vLLM's schema
    and range checks; raises RequestRefused at the first field that fails them."""
    values: dict[str, Any] = {}
    for name, (kind, described) in FIELDS[api].items():
        if name not in body:
            if not _optional(kind):
                raise schema_error(f"`{name}` is required", name)
            continue
        value = body[name]
        if isinstance(value, bool) and kind != bool | None:
            value = int(value)  # pydantic reads true/false as 1/0 where a number is expected
        try:
            values[name] = msgspec.convert(value, kind, strict=False)
        except msgspec.ValidationError:
            raise schema_error(f"`{name}` must be {described}, got {body[name]!r}", name) from None
    _check_ranges(values)
    return values


def _optional(kind: Any) -> bool:
    return kind is None or type(None) in getattr(kind, "__args__", ())


def _check_ranges(values: dict[str, Any]) -> None:
    def refuse(name: str, message: str) -> None:
        raise RequestRefused(f"{message}, got {values[name]}.", param=name)

    def present(name: str) -> bool:
        return values.get(name) is not None

    if present("n") and values["n"] < 1:
        refuse("n", "n must be at least 1")
    if present("temperature") and values["temperature"] < 0:
        refuse("temperature", "temperature must be non-negative")
    if present("top_p") and not 0 < values["top_p"] <= 1:
        refuse("top_p", "top_p must be in (0, 1]")
    if present("top_k") and values["top_k"] < -1:
        refuse("top_k", "top_k must be -1 or 0 (disable), or at least 1")
    if present("min_p") and not 0 <= values["min_p"] <= 1:
        refuse("min_p", "min_p must be in [0, 1]")
    for name in ("presence_penalty", "frequency_penalty"):
        if present(name) and not -2 <= values[name] <= 2:
            refuse(name, f"{name} must be in [-2, 2]")
    if present("repetition_penalty") and values["repetition_penalty"] <= 0:
        refuse("repetition_penalty", "repetition_penalty must be greater than zero")
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if present(name) and values[name] < 1:
            refuse(name, f"{name} must be at least 1")
    if present("min_tokens") and values["min_tokens"] < 0:
        refuse("min_tokens", "min_tokens must be greater than or equal to 0")
    if present("seed") and not -_INT64 <= values["seed"] < _INT64:
        refuse("seed", "seed must fit a 64-bit integer")


def check_chat_messages(messages: Any) -> None:
    """vLLM's chat message schema: a list of objects, each with a string `role` (any: vLLM takes
    custom roles) and a `content` that is a string, a list of parts or null."""
    if not isinstance(messages, list):
        raise schema_error("`messages` must be a list of {role, content} objects", "messages")
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if not isinstance(message, dict):
            raise schema_error(f"`messages[{index}]` must be an object with a `role`", where)
        if not isinstance(message.get("role"), str):
            raise schema_error(f"`messages[{index}].role` must be a string", f"{where}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise schema_error(
                f"`messages[{index}].content` must be a string, a list of parts or null", f"{where}.content"
            )
