"""A hostile Redis for the tests: speaks RESP on a loopback port, answers the connection handshake at
once, then trickles every other reply one byte at a time (a server that keeps a connection just
alive enough that no per-read socket timeout ever fires).

Run: `python -m kvgate_testing.trickling_redis PORT INTERVAL_S VALUE_BYTES STEP_BYTES`: STEP_BYTES of
each reply every INTERVAL_S (1 byte: a trickle; 64 KiB every 1/64 s: a steady but slow 4 MiB/s
link). EXISTS answers `:1` (every key held); MGET answers an array of VALUE_BYTES-long values of
junk. Each connection trickles for at most LIMIT_S seconds and is then closed, so a client that
waits for the whole reply is released in bounded time (the test's bound is far below it). Start it
with `start_trickling_redis`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import Iterator

from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, python_command

LIMIT_S = 30.0
_HANDSHAKE = {b"CLIENT": b"+OK\r\n", b"SELECT": b"+OK\r\n", b"AUTH": b"+OK\r\n", b"PING": b"+PONG\r\n"}


async def _read_command(reader: asyncio.StreamReader) -> list[bytes]:
    """One RESP command (an array of bulk strings)."""
    header = await reader.readline()
    if not header.startswith(b"*"):
        raise ConnectionError("not a RESP command")
    parts = []
    for _ in range(int(header[1:])):
        length = int((await reader.readline())[1:])
        parts.append((await reader.readexactly(length + 2))[:-2])
    return parts


def _reply_to(command: list[bytes], value_bytes: int) -> bytes:
    name = command[0].upper()
    if name in _HANDSHAKE:
        return _HANDSHAKE[name]
    if name == b"EXISTS":
        return b":1\r\n"
    if name == b"MGET":
        keys = len(command) - 1
        return b"*%d\r\n" % keys + (b"$%d\r\n%s\r\n" % (value_bytes, b"x" * value_bytes)) * keys
    return b"+OK\r\n"


async def _serve(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, interval_s: float, value_bytes: int, step: int
) -> None:
    started = time.monotonic()
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError):
        while time.monotonic() - started < LIMIT_S:
            command = await _read_command(reader)
            reply = _reply_to(command, value_bytes)
            if command[0].upper() in _HANDSHAKE:
                writer.write(reply)
                await writer.drain()
                continue
            for position in range(0, len(reply), step):
                if time.monotonic() - started >= LIMIT_S:
                    break
                writer.write(reply[position : position + step])
                await writer.drain()
                await asyncio.sleep(interval_s)
    writer.close()


async def _main(port: int, interval_s: float, value_bytes: int, step: int) -> None:
    server = await asyncio.start_server(
        lambda r, w: _serve(r, w, interval_s, value_bytes, step), "127.0.0.1", port
    )
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def start_trickling_redis(
    interval_s: float = 0.05, value_bytes: int = 4096, step_bytes: int = 1
) -> Iterator[str]:
    """The fake server as a process of its own; yields its redis:// URL once it accepts."""
    port = free_port()
    args = [str(port), str(interval_s), str(value_bytes), str(step_bytes)]
    process = ManagedProcess(python_command("-m", "kvgate_testing.trickling_redis", *args))
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.alive(), process.output()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline, f"the trickling Redis never listened:\n{process.output()}"
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.stop()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
