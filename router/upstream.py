"""The gateway's one HTTP client: pooled HTTP/1.1 keep-alive connections to the backends.

Built on asyncio protocols and httptools (the C parser uvicorn uses) because the forwarding hot
path must cost about as much CPU as the Rust peers, and httpx cost tens of times more CPU per
request (docs/benchmarks.md, "Figures behind choices in the code"). It does only what a
reverse proxy needs: write a request as bytes, hand back the status, the raw header list and the
body pieces as they arrive (chunked transfer decoded, content untouched), and reuse the connection.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import httptools

from router.errors import KvgateError

# Idle keep-alive connections are dropped after this long; engines behind uvicorn close theirs
# after 5 s, and reusing a connection the server is closing costs a failed attempt.
KEEPALIVE_EXPIRY_S = 4.0
# Read from the backend no further ahead of the client than this (back-pressure on slow clients).
MAX_BUFFERED_BYTES = 1 << 20
# A response's status line and headers, at most (as a client's request head, limits.max_header_bytes'
# default), and so the most bytes a response may send in a row without a byte of body (trailers,
# chunk framing): a backend that sends more (a head that never ends) fails the request with a 502
# instead of growing the parser's buffers without end. Engines send a few hundred bytes of head.
MAX_RESPONSE_HEAD_BYTES = 64 * 1024


class UpstreamError(KvgateError):
    """The backend could not be reached or broke the connection."""

    def __init__(self, message: str, *, before_response: bool):
        super().__init__(message)
        # True when the backend sent nothing at all: safe to retry elsewhere.
        self.before_response = before_response


class UpstreamConnectError(UpstreamError):
    def __init__(self, message: str):
        super().__init__(message, before_response=True)


class UpstreamTimeout(UpstreamError):
    pass


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(UpstreamTimeout("upstream timed out", before_response=False))


class _Connection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time."""

    __slots__ = (
        "_body",
        "_body_bytes",
        "_buffered",
        "_bytes_without_body",
        "_complete",
        "_error",
        "_headers_waiter",
        "_paused",
        "_waiter",
        "closed",
        "headers",
        "idle_since",
        "keep_alive",
        "loop",
        "origin",
        "parser",
        "reused",
        "status",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: tuple[str, int]):
        self.loop = loop
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        # One parser for the connection's life: after a complete response it is ready for the next
        # one, and a connection whose response went wrong is never reused.
        self.parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self._body_bytes = 0  # of the response's body, received so far
        self._bytes_without_body = 0  # received in a row with no body byte among them
        self.keep_alive = False
        self.headers: list[tuple[bytes, bytes]] = []
        self._body: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._complete = False
        self._error: UpstreamError | None = None
        self._headers_waiter: asyncio.Future | None = None
        self._waiter: asyncio.Future | None = None

    # ---- asyncio.Protocol ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # uvloop and asyncio both set it already; stated here because streaming depends on it.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self._complete:
            # Nothing was asked: a backend sending on an idle keep-alive connection is not reused.
            self.abort()
            return
        body_bytes = self._body_bytes
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("backend tried to upgrade the connection", before_response=False))
            return
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"backend sent invalid HTTP: {exc}", before_response=self.status == 0))
            return
        if self._body_bytes != body_bytes or self._complete:
            self._bytes_without_body = 0
            return
        # Counted per read (a read is at most the loop's buffer): the parser holds a head's (or a
        # trailer's) lines until they end, so bytes that never end are stopped here.
        self._bytes_without_body += len(data)
        if self._bytes_without_body > MAX_RESPONSE_HEAD_BYTES:
            what = "a response head" if self.status == 0 else "trailers or chunk framing"
            self._fail(
                UpstreamError(
                    f"backend sent {what} over {MAX_RESPONSE_HEAD_BYTES} bytes without ending it",
                    before_response=False,
                )
            )

    def eof_received(self) -> bool:
        self.closed = True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._complete:
            # A response without a length ends with the connection (HTTP/1.0 style).
            with contextlib.suppress(httptools.HttpParserError):
                self.parser.feed_data(b"")
        if not self._complete:
            self._fail(
                UpstreamError(
                    f"backend closed the connection{': ' + str(exc) if exc else ''}",
                    before_response=self.status == 0,
                )
            )

    def pause_writing(self) -> None:  # request bodies are written at once; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # ---- httptools callbacks ----

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.status:
            return  # a trailer (after a chunked body): never forwarded
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        # Only meaningful while the message is being parsed, so read it here.
        self.keep_alive = self.parser.should_keep_alive()
        waiter = self._headers_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        self._body_bytes += len(body)
        if self._buffered > MAX_BUFFERED_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._wake()

    # ---- used by UpstreamPool / UpstreamResponse ----

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        for waiter in (self._headers_waiter, self._waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def send(self, request: bytes) -> None:
        self._reset()
        self.transport.write(request)  # type: ignore[union-attr]

    async def wait_headers(self, timeout_s: float) -> None:
        if self.status:
            return
        if self._error is not None:
            raise self._error
        waiter = self._headers_waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._headers_waiter = None

    async def next_piece(self, timeout_s: float) -> bytes | None:
        """The body received since the last call (waiting for some if none), or None at the end."""
        if not (self._body or self._complete):
            await self.body_started(timeout_s)  # (only when there is nothing yet: the relay's hot path)
        body = self._body
        if not body:
            return None  # complete, and everything was handed out
        # Everything that has already arrived goes out in one piece: no delay is added, and a
        # backend faster than the client costs one write per wake-up instead of per chunk.
        piece = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        if self._paused and self._buffered <= MAX_BUFFERED_BYTES // 2:
            self._paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        return piece

    async def body_started(self, timeout_s: float) -> None:
        """Wait, without taking any, until some of the body has arrived or it is complete; raises
        the connection's error if it failed first (UpstreamTimeout after timeout_s)."""
        while not (self._body or self._complete):
            if self._error is not None:
                raise self._error
            waiter = self._waiter = self.loop.create_future()
            timer = self.loop.call_later(timeout_s, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None

    @property
    def drained(self) -> bool:
        return self._complete and not self._body

    @property
    def reusable(self) -> bool:
        return self._complete and not self.closed and self.keep_alive

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class _Pieces:
    """UpstreamResponse.pieces(): an iterator object, not an async generator. A generator left
    before its end (the relay returns at the last piece) is finalized by the event loop's asyncgen
    hook, which schedules its aclose() as a task through call_soon_threadsafe: a wake-up system
    call, a task and a loop turn per request, after the answer's last write, on the client's path."""

    __slots__ = ("_connection", "_timeout_s")

    def __init__(self, connection: _Connection, timeout_s: float) -> None:
        self._connection = connection
        self._timeout_s = timeout_s

    def __aiter__(self) -> _Pieces:
        return self

    async def __anext__(self) -> bytes:
        piece = await self._connection.next_piece(self._timeout_s)
        if piece is None:
            raise StopAsyncIteration
        return piece


class UpstreamResponse:
    """A response whose headers have arrived; read the body with pieces() or read(), then close()."""

    __slots__ = ("_connection", "_pool", "headers", "status")

    def __init__(self, pool: UpstreamPool, connection: _Connection):
        self._pool = pool
        self._connection = connection
        self.status = connection.status
        self.headers = connection.headers

    def pieces(self, timeout_s: float) -> AsyncIterator[bytes]:
        """Body pieces as they arrive; each wait for the next one is bounded by timeout_s."""
        return _Pieces(self._connection, timeout_s)

    async def body_started(self, timeout_s: float) -> None:
        """Until the body starts (or the response ends empty); raises UpstreamError if the backend
        failed first, UpstreamTimeout after timeout_s. Takes nothing: pieces() still yields it all."""
        await self._connection.body_started(timeout_s)

    async def read(self, timeout_s: float) -> bytes:
        parts = [piece async for piece in self.pieces(timeout_s)]
        return b"".join(parts)

    @property
    def at_end(self) -> bool:
        """True when the whole body has arrived and every piece was handed out."""
        connection = self._connection
        return connection is not None and connection.drained

    def close(self) -> None:
        """Give the connection back when the body was read to the end; otherwise drop it."""
        connection = self._connection
        if connection is None:
            return
        self._connection = None  # type: ignore[assignment]
        if connection.reusable:
            self._pool._release(connection)
        else:
            connection.abort()
            self._pool._forget(connection)


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections per backend origin, at most `max_connections` per origin."""

    def __init__(self, connect_timeout_s: float, max_connections: int):
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: dict[tuple[str, int], int] = {}
        self._slot_waiters: dict[tuple[str, int], collections.deque[asyncio.Future]] = {}
        self._host_headers: dict[tuple[str, int], bytes] = {}

    @staticmethod
    def origin_of(url: str) -> tuple[str, int]:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"only http:// backends are supported, got {url!r}")
        return parts.hostname or "127.0.0.1", parts.port or 80

    async def request(
        self,
        origin: tuple[str, int],
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeout_s: float,
        placed: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send one request; return once the response headers are in.

        `headers` must not hold host, content-length, connection or transfer-encoding: this
        client writes those. Raises UpstreamConnectError (nothing sent), UpstreamTimeout or
        UpstreamError.

        `placed`, when given, runs once, before anything else on the loop: right after the request
        is written to an idle connection, or, when none is idle, before waiting for one. Work that
        later routing decisions must see but the engine need not wait for (the policy's record of
        the placement) goes there: on the hot path it runs while the engine reads the request, not
        before it is sent. When it raises, the request's connection is dropped.
        """
        host_header = self._host_headers.get(origin)
        if host_header is None:
            host_header = self._host_headers[origin] = f"{origin[0]}:{origin[1]}".encode()
        head = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host_header]
        head.append(b"\r\ncontent-length: %d\r\n" % len(body))
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head += (b"\r\n", body)
        request_bytes = b"".join(head)
        while True:
            connection = self._take_idle(origin)
            if connection is None:
                if placed is not None:
                    # The wait for a connection lets other requests be routed: they must see this one.
                    run, placed = placed, None
                    run()
                connection = await self._acquire(origin)
            connection.send(request_bytes)
            if placed is not None:
                run, placed = placed, None
                try:
                    run()
                except BaseException:
                    connection.abort()
                    self._forget(connection)
                    raise
            try:
                await connection.wait_headers(timeout_s)
            except UpstreamTimeout:
                connection.abort()
                self._forget(connection)
                raise
            except asyncio.CancelledError:
                connection.abort()
                self._forget(connection)
                raise
            except UpstreamError as exc:
                self._forget(connection)
                if connection.reused and exc.before_response:
                    # The backend closed an idle keep-alive connection as we wrote to it; it has
                    # not read the request, so a fresh connection is safe.
                    continue
                raise UpstreamError(str(exc), before_response=exc.before_response) from None
            return UpstreamResponse(self, connection)

    def _take_idle(self, origin: tuple[str, int]) -> _Connection | None:
        """An idle keep-alive connection to `origin` still fit for reuse, or None; those expired
        or closed on the way are dropped."""
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < KEEPALIVE_EXPIRY_S:
                connection.reused = True
                return connection
            connection.abort()
            self._forget(connection)
        return None

    async def _acquire(self, origin: tuple[str, int]) -> _Connection:
        """A new connection to `origin`, once one more may be open (after `_take_idle` found none);
        or an idle one that a finished request gave back while this one waited for a slot."""
        while self._open.get(origin, 0) >= self.max_connections:
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.setdefault(origin, collections.deque()).append(waiter)
            await waiter
            idle = self._idle.get(origin)
            if idle:
                connection = idle.pop()
                if not connection.closed:
                    connection.reused = True
                    return connection
                self._forget(connection)
        self._open[origin] = self._open.get(origin, 0) + 1
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop, origin), origin[0], origin[1]),
                self.connect_timeout_s,
            )
        except asyncio.CancelledError:
            self._open[origin] -= 1
            self._wake_slot_waiter(origin)
            raise
        except (OSError, TimeoutError) as exc:
            self._open[origin] -= 1
            self._wake_slot_waiter(origin)
            reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
            raise UpstreamConnectError(f"cannot connect to {origin[0]}:{origin[1]}: {reason}") from None
        return connection

    def _release(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.origin, []).append(connection)
        self._wake_slot_waiter(connection.origin)

    def _forget(self, connection: _Connection) -> None:
        origin = connection.origin
        self._open[origin] = self._open.get(origin, 1) - 1
        self._wake_slot_waiter(origin)

    def _wake_slot_waiter(self, origin: tuple[str, int]) -> None:
        waiters = self._slot_waiters.get(origin)
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        """A small GET (health probes, model lists): status and whole body, bounded by timeout_s."""
        parts = urlsplit(url)
        origin = self.origin_of(url)
        target = (parts.path or "/").encode() + (b"?" + parts.query.encode() if parts.query else b"")
        response = await asyncio.wait_for(self.request(origin, b"GET", target, [], b"", timeout_s), timeout_s)
        try:
            body = await asyncio.wait_for(response.read(timeout_s), timeout_s)
        finally:
            response.close()
        return response.status, body

    def close(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.abort()
        self._idle.clear()
        self._open.clear()
