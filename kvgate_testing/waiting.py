"""Polling until a condition holds, for tests that watch another thread or process change state."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "condition") -> T:
    """Return the first truthy value of `predicate()`; fail the test if none comes within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"{what} not reached in {timeout_s}s")
