"""Shared pytest fixtures; the helpers themselves live in tests/support/."""

from __future__ import annotations

import pytest

from tests.support import free_port


@pytest.fixture
def port() -> int:
    """A free loopback port."""
    return free_port()
