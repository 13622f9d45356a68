"""The no-op endpoint picker of noop_picker.cc on kvgate's own gRPC server (router/epp/grpc_server.py,
uvloop, raw bytes, no protobuf parsing): the part of `kvgate epp`'s cost that is its transport
(benchmarks/epp_floor.py).

    python noop_picker_kvgate.py 127.0.0.1:PORT HEADERS_ANSWER_FILE BODY_ANSWER_FILE
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import uvloop
from noop_picker import servicers  # beside this file

from router.epp.grpc_server import GrpcServer
from router.epp.http2 import Method

EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
ACCESS_LOG = "envoy.service.accesslog.v3.AccessLogService"


class Raw(bytes):
    """A message left as its bytes, both ways."""

    @classmethod
    def FromString(cls, data: bytes) -> Raw:  # protobuf's names
        return cls(data)

    def SerializeToString(self) -> bytes:
        return bytes(self)


async def main(address: str, headers_answer: Raw, body_answer: Raw) -> None:
    process, access_logs = servicers(headers_answer, body_answer, Raw())
    server = GrpcServer(
        [
            Method(f"/{EXT_PROC}/Process", "stream_stream", Raw, process),
            Method(f"/{ACCESS_LOG}/StreamAccessLogs", "stream_unary", Raw, access_logs),
        ],
        max_streams=4096,
        max_message_bytes=16 * 1024 * 1024,
    )
    host, port = address.rsplit(":", 1)
    await server.start(host, int(port))
    print("listening", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    headers, body = (Raw(Path(path).read_bytes()) for path in sys.argv[2:4])
    uvloop.run(main(sys.argv[1], headers, body))
