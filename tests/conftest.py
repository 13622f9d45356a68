"""Shared pytest fixtures; the helpers themselves live in kvgate_testing/ (shared with the benchmarks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvgate_testing.backend import TEST_MODEL, BackendProcess, running_backends
from kvgate_testing.ports import free_port
from kvgate_testing.redis_server import RedisServer, running_redis


@pytest.fixture
def port() -> int:
    """A free loopback port."""
    return free_port()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh redis-server on a free loopback port for one test, killed afterwards."""
    with running_redis() as server:
        yield server


@pytest.fixture(scope="module")
def backend() -> Iterator[BackendProcess]:
    """One test backend, "a", serving TEST_MODEL, shared by the tests of one module."""
    with running_backends("a", models=[TEST_MODEL]) as (started,):
        yield started


@pytest.fixture(scope="module")
def backends() -> Iterator[list[BackendProcess]]:
    """Two test backends, "a" and "b", serving TEST_MODEL, shared by the tests of one module."""
    with running_backends("a", "b", models=[TEST_MODEL]) as started:
        yield started


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reverse-order",
        action="store_true",
        help="run the collected tests last to first: a test that passes only after the ones before "
        "it (state left in a module-scoped fixture) fails this way",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--reverse-order"):
        items.reverse()
