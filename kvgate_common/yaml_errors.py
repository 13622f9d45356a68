"""A configuration file's errors as one line each: a YAML syntax error as `file:line:column: problem`,
and the bad value beside a validation error. The gateway's proxy.yaml (router/config.py) and the
cache layer's file (cachelayer/config.py) word theirs through it; each raises its own package's
error with the message (tests/test_config.py and tests/test_cachelayer_config.py check them)."""

from __future__ import annotations

import re
from typing import Any

import yaml

_MISSING = object()
# One step of a msgspec error path (`$.backends[0].url`): a key or an index.
_PATH_STEP = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")
_MAX_VALUE_CHARS = 80


def yaml_syntax_error(file: object, exc: yaml.YAMLError) -> str:
    """`file:line:column: not valid YAML: problem (context)` in one line, instead of PyYAML's
    several-line message that names "<unicode string>"."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return f"{file}: not valid YAML: {' '.join(str(exc).split())}"
    mark = exc.problem_mark  # 0-based; editors count from 1
    message = f"{file}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {exc.problem}"
    if exc.context:
        started = f" at line {exc.context_mark.line + 1}" if exc.context_mark is not None else ""
        message += f" ({exc.context}{started})"
    return message


def value_at(data: Any, msgspec_path: str) -> Any:
    """The value a msgspec error path (`$.listen.port`, `$.backends[0]`) names in `data`, or
    `_MISSING` when the path does not lead to one."""
    value = data
    for key, index in _PATH_STEP.findall(msgspec_path.removeprefix("$")):
        try:
            value = value[int(index)] if index else value[key]
        except (KeyError, IndexError, TypeError, ValueError):
            return _MISSING
    return value


def with_bad_value(message: str, data: Any, msgspec_path: str) -> str:
    """msgspec's `Expected `int`, got `str`` with the value it got: `...: got 'eighty'`."""
    if not message.startswith("Expected"):
        return message
    value = value_at(data, msgspec_path)
    if value is _MISSING:
        return message
    shown = repr(value)
    if len(shown) > _MAX_VALUE_CHARS:
        shown = shown[: _MAX_VALUE_CHARS - 3] + "..."
    return f"{message} (the value given: {shown})"
