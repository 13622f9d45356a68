"""UpstreamPool.request's `placed` hook against a real HTTP server on loopback (a socket server in
a thread): on a reused connection it runs once the request is on the wire, so the policy's record of
a placement (router/forward.py) no longer delays the engine's start; with no idle connection it runs
before the pool waits to connect, so requests routed during that wait still see the placement; when
it raises, the request's connection is dropped and the pool serves the next request."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from router.upstream import UpstreamPool

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
REQUEST_BODY = b'{"prompt": "placed"}'


class _Backend:
    """A keep-alive HTTP/1.1 server that sets `accepted` on each new connection and `received` once
    a whole request (head and body) has been read, then answers it."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.origin = ("127.0.0.1", self.listener.getsockname()[1])
        self.accepted = threading.Event()
        self.received = threading.Event()
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self.accepted.set()
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        buffered = b""
        with connection:
            while True:
                while not buffered.endswith(REQUEST_BODY):
                    try:
                        data = connection.recv(65536)
                    except ConnectionResetError:  # the pool aborted the connection (a failed request)
                        return
                    if not data:
                        return
                    buffered += data
                buffered = b""
                self.received.set()
                connection.sendall(ANSWER)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def backend() -> Iterator[_Backend]:
    server = _Backend()
    yield server
    server.close()


async def _post(pool: UpstreamPool, origin: tuple[str, int], placed=None) -> bytes:
    response = await pool.request(origin, b"POST", b"/v1/completions", [], REQUEST_BODY, 5.0, placed)
    try:
        return await response.read(5.0)
    finally:
        response.close()


def test_placed_runs_after_the_request_reached_the_engine_on_a_reused_connection(backend: _Backend) -> None:
    seen_by_backend_during_placed: list[bool] = []

    def placed() -> None:
        # The server thread reads the request while the loop is blocked here: it can only see it
        # if the request was written before `placed` ran.
        seen_by_backend_during_placed.append(backend.received.wait(timeout=5.0))

    async def run() -> bytes:
        pool = UpstreamPool(connect_timeout_s=5.0, max_connections=2)
        try:
            await _post(pool, backend.origin)  # opens the connection that the next request reuses
            backend.received.clear()
            return await _post(pool, backend.origin, placed)
        finally:
            pool.close()

    assert asyncio.run(run()) == b"{}"
    assert seen_by_backend_during_placed == [True]
    assert backend.connections == 1, "the second request did not reuse the idle connection"


def test_placed_runs_before_the_wait_for_a_new_connection(backend: _Backend) -> None:
    accepted_before_placed: list[bool] = []

    def placed() -> None:
        accepted_before_placed.append(backend.accepted.is_set())

    async def run() -> bytes:
        pool = UpstreamPool(connect_timeout_s=5.0, max_connections=2)
        try:
            return await _post(pool, backend.origin, placed)
        finally:
            pool.close()

    assert asyncio.run(run()) == b"{}"
    assert accepted_before_placed == [False]
    assert backend.connections == 1


def test_placed_that_raises_drops_the_connection_and_the_pool_serves_on(backend: _Backend) -> None:
    class PlacementFailed(Exception):
        pass

    def placed() -> None:
        raise PlacementFailed

    async def run() -> bytes:
        pool = UpstreamPool(connect_timeout_s=5.0, max_connections=1)
        try:
            await _post(pool, backend.origin)
            with pytest.raises(PlacementFailed):
                await _post(pool, backend.origin, placed)
            # One connection at most: the dropped one must have given its slot back.
            return await asyncio.wait_for(_post(pool, backend.origin), 5.0)
        finally:
            pool.close()

    assert asyncio.run(run()) == b"{}"
    assert backend.connections == 2, "the connection the failed request was written to was reused"
