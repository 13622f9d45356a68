"""A hostile backend for the gateway's security tests: a real process on a loopback port that answers
GET /health like an engine, and every other request with header lines that never end, for as long
as the gateway keeps reading: `--mode head` right after `HTTP/1.1 200 OK` (a head that never
ends), `--mode trailer` after a short chunked body (trailers that never end).

Run it as `python -m kvgate_testing.hostile_upstream --port P [--mode head|trailer]`. Bounded, as a
test's loops must be: one answer sends at most --max-bytes of header lines, and stops after
--max-seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, python_command, start_process

_HEALTH = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{"status":"ok"}'
# 64 header lines of 1 KiB each per write.
_HEADER_LINES = b"".join(b"x-endless-%d: %s\r\n" % (i, b"h" * 1000) for i in range(64))


_STARTS = {
    "head": b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n",
    "trailer": (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        b"d\r\ndata: hello\n\n\r\n0\r\n"
    ),
}


async def _serve(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, mode: str, max_bytes: int, max_seconds: float
) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line = head.split(b"\r\n", 1)[0]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length:
                await reader.readexactly(length)
            if request_line.startswith(b"GET /health "):
                writer.write(_HEALTH)
                await writer.drain()
                continue
            writer.write(_STARTS[mode])
            sent, started = 0, time.monotonic()
            while sent < max_bytes and time.monotonic() - started < max_seconds:
                writer.write(_HEADER_LINES)
                sent += len(_HEADER_LINES)
                await writer.drain()  # as fast as the gateway reads, no faster
            return
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
        return
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _main(host: str, port: int, mode: str, max_bytes: int, max_seconds: float) -> None:
    server = await asyncio.start_server(
        lambda reader, writer: _serve(reader, writer, mode, max_bytes, max_seconds), host, port
    )
    async with server:
        await server.serve_forever()


@contextmanager
def running_endless_head_upstream(
    mode: str = "head", max_bytes: int = 4 << 30, max_seconds: float = 60.0
) -> Iterator[str]:
    """Start the hostile backend on a free loopback port; yields its URL, stops it afterwards."""
    port = free_port()
    args = ["-m", "kvgate_testing.hostile_upstream", "--port", str(port), "--mode", mode]
    args += ["--max-bytes", str(max_bytes), "--max-seconds", str(max_seconds)]
    process: ManagedProcess = start_process(python_command(*args), f"http://127.0.0.1:{port}/health")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=sorted(_STARTS), default="head", help="where the endless lines go")
    parser.add_argument(
        "--max-bytes", type=int, default=4 << 30, help="header bytes one answer sends at most"
    )
    parser.add_argument("--max-seconds", type=float, default=60.0, help="how long one answer lasts at most")
    args = parser.parse_args()
    asyncio.run(_main(args.host, args.port, args.mode, args.max_bytes, args.max_seconds))


if __name__ == "__main__":
    main()
