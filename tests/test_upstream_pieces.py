"""UpstreamResponse.pieces() against a real streaming HTTP server on loopback: every piece arrives in
order, and leaving the loop at the last piece (as the relay does, router/forward.py) leaves nothing
for the event loop to finalize afterwards. An async generator left before its end is closed by the
loop's asyncgen hook as a task of its own, scheduled through call_soon_threadsafe: a wake-up system
call and a loop turn per request, after the answer's last write."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from kvgate_testing.in_thread_server import serving_in_thread
from router.upstream import UpstreamPool

PIECES = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]


@pytest.fixture(scope="module")
def stream_server() -> Iterator[tuple[str, int]]:
    async def stream(request: Request) -> StreamingResponse:
        async def pieces() -> AsyncIterator[bytes]:
            for piece in PIECES:
                yield piece
                await asyncio.sleep(0.01)  # each piece its own chunk on the wire

        return StreamingResponse(pieces(), media_type="text/event-stream")

    with serving_in_thread(Starlette(routes=[Route("/stream", stream)]), log_level="error") as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


def _relay(origin: tuple[str, int], stop_at_end: bool) -> tuple[list[bytes], list[object]]:
    """The pieces of GET /stream read as the relay reads them, and the async generators the loop saw
    first iterated meanwhile (sys.set_asyncgen_hooks: the loop's own hook is kept and called)."""

    async def run() -> tuple[list[bytes], list[object]]:
        first_iterated: list[object] = []
        loop_hooks = sys.get_asyncgen_hooks()

        def firstiter(agen: object) -> None:
            first_iterated.append(agen)
            if loop_hooks.firstiter is not None:
                loop_hooks.firstiter(agen)

        pool = UpstreamPool(connect_timeout_s=5.0, max_connections=2)
        received: list[bytes] = []
        sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=loop_hooks.finalizer)
        try:
            response = await pool.request(origin, b"GET", b"/stream", [], b"", 5.0)
            try:
                async for piece in response.pieces(5.0):
                    received.append(piece)
                    if stop_at_end and response.at_end:
                        break  # the relay's early exit: the last piece ends the answer in one write
            finally:
                response.close()
        finally:
            sys.set_asyncgen_hooks(*loop_hooks)
            pool.close()
        return received, first_iterated

    return asyncio.run(run())


@pytest.mark.parametrize("stop_at_end", [True, False], ids=["left-at-the-last-piece", "read-to-the-end"])
def test_pieces_arrive_in_order_and_leave_nothing_to_finalize(
    stream_server: tuple[str, int], stop_at_end: bool
) -> None:
    received, first_iterated = _relay(stream_server, stop_at_end)
    assert b"".join(received) == b"".join(PIECES)
    assert first_iterated == [], "pieces() made an async generator the event loop has to close"
