"""An engine that crashes on every request it is sent: a real process on a loopback port that answers
GET /health like an engine (so the gateway's probes find it up) and closes the connection on any
other request once it has read it, before a byte of answer: what a gateway sees of an engine that
died under the request. Run it as `python -m kvgate_testing.crashing_engine --port P`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
# A request head or body past this is not one this stand-in reads (bounded, as a test's loops must be).
_MAX_BODY = 16 << 20


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = min(int(value), _MAX_BODY)
            if length:
                await reader.readexactly(length)
            if not head.startswith(b"GET /health "):
                return  # the crash: the connection closes with no answer
            writer.write(_HEALTH)
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
        return
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _main(host: str, port: int) -> None:
    async with await asyncio.start_server(_serve, host, port) as server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(_main(args.host, args.port))


if __name__ == "__main__":
    main()
