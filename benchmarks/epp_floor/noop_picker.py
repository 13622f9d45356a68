"""The no-op endpoint picker of noop_picker.cc on Python's grpc.aio (generic handlers: raw bytes,
no protobuf parsing): the part of a picker's cost that is Python's gRPC transport alone
(benchmarks/epp_floor.py).

    python noop_picker.py 127.0.0.1:PORT HEADERS_ANSWER_FILE BODY_ANSWER_FILE
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

import grpc

T = TypeVar("T", bound=bytes)

REQUEST_HEADERS, REQUEST_BODY = 2, 4  # ProcessingRequest's oneof fields, serialized first


def servicers(headers_answer: T, body_answer: T, empty: T) -> tuple[Callable, Callable]:
    """The no-op ext_proc and access-log servicers, on messages as raw bytes (noop_picker_kvgate.py
    serves the same two on kvgate's own server)."""

    async def process(requests: AsyncIterator[T], context: object) -> AsyncIterator[T]:
        async for message in requests:
            field = message[0] >> 3 if message else 0
            if field == REQUEST_HEADERS:
                yield headers_answer
            elif field == REQUEST_BODY:
                yield body_answer

    async def access_logs(requests: AsyncIterator[T], context: object) -> T:
        async for _ in requests:
            pass
        return empty

    return process, access_logs


async def main(address: str, headers_answer: bytes, body_answer: bytes) -> None:
    process, access_logs = servicers(headers_answer, body_answer, b"")

    class Handler(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            if details.method.endswith("/Process"):
                return grpc.stream_stream_rpc_method_handler(process)
            if details.method.endswith("/StreamAccessLogs"):
                return grpc.stream_unary_rpc_method_handler(access_logs)
            return None

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((Handler(),))
    server.add_insecure_port(address)
    await server.start()
    print("listening", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]).read_bytes(), Path(sys.argv[3]).read_bytes()))
