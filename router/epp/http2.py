"""HTTP/2 (RFC 9113) and gRPC wire pieces for the picker's gRPC server (router/epp/grpc_server.py):
frame types, flags, error codes and settings, frame and header-block encoding (HPACK literals never
indexed, RFC 7541), gRPC's status codes, trailers and `grpc-timeout`, and what a method is."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal

from hpack import Decoder

from router.errors import KvgateError

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types and flags (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
# Error codes (section 7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
# Settings (section 6.5.2).
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
# The largest frame accepted: the protocol's default, never raised (bodies come in 16 KiB frames).
MAX_FRAME_BYTES = 16_384
MAX_HEADER_LIST_BYTES = 64 * 1024
FRAME_HEADER = struct.Struct(">HBBBI")  # length (24 bits as 16 + 8), type, flags, stream id
UINT32 = struct.Struct(">I")
MESSAGE_PREFIX = struct.Struct(">BI")  # gRPC's: compressed flag, length
# Response headers: `:status: 200` (static index 8), then content-type (static name 31) as a literal
# never indexed. Nothing is ever added to the peer's dynamic table.
RESPONSE_HEADERS = b"\x88\x0f\x10\x10application/grpc"
# Sent once at the head of the connection's first header block: our dynamic table is empty, and
# stays so whatever SETTINGS_HEADER_TABLE_SIZE the peer sets later.
TABLE_SIZE_ZERO = b"\x20"


class StatusCode(IntEnum):
    """gRPC status codes (grpc/doc/statuscodes.md), the ones this server and its servicers use."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class RpcAbort(KvgateError):
    """Raised by `ServicerContext.abort`: the call ends with this status."""

    def __init__(self, code: StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


CallKind = Literal["unary_unary", "unary_stream", "stream_unary", "stream_stream"]


@dataclass(frozen=True)
class Method:
    """One gRPC method: its path (`/package.Service/Method`), its kind, the request's protobuf type
    and the servicer's coroutine (or async generator, for a streaming answer), called as grpc.aio
    calls its servicers: `handler(request or request_iterator, context)`."""

    path: str
    kind: CallKind
    request_type: Any
    handler: Callable[..., Any]


def hpack_integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal never added to the table, with a new name, no Huffman."""
    return b"\x00" + hpack_integer(len(name), 7) + name + hpack_integer(len(value), 7) + value


def percent_encode(text: str) -> bytes:
    """grpc-message's encoding: printable ASCII but '%' as is, every other byte %XX (of UTF-8)."""
    return b"".join(
        bytes((byte,)) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte
        for byte in text.encode()[:1024]
    )


def trailers(code: StatusCode, details: str) -> bytes:
    block = literal(b"grpc-status", str(int(code)).encode())
    if details:
        block += literal(b"grpc-message", percent_encode(details))
    return block


def frame(kind: int, flags: int, stream_id: int, payload: bytes | memoryview = b"") -> bytes:
    length = len(payload)
    return FRAME_HEADER.pack(length >> 8, length & 0xFF, kind, flags, stream_id) + payload


def parse_timeout(value: bytes) -> float | None:
    """`grpc-timeout` (1 to 8 digits and a unit) in seconds; None when malformed."""
    units = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
    digits, unit = value[:-1], value[-1:]
    if not digits.isdigit() or len(digits) > 8 or unit not in units:
        return None
    return int(digits) * units[unit]


class ProtocolBreach(KvgateError, ValueError):
    """A peer broke HTTP/2: its connection gets GOAWAY with `code` (RFC 9113 section 7) and closes."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _skip_integer(block: bytes, position: int, prefix_bits: int) -> tuple[int, int]:
    """An HPACK integer at `position`: (its value, the position after it)."""
    limit = (1 << prefix_bits) - 1
    value = block[position] & limit
    position += 1
    if value < limit:
        return value, position
    shift = 0
    while True:
        byte = block[position]
        position += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position


def leaves_table_untouched(block: bytes) -> bool:
    """Whether a header block only reads the dynamic table: indexed fields and literals not indexed
    (RFC 7541 section 6), no incremental indexing, no table size update. Malformed: False."""
    position, size = 0, len(block)
    try:
        while position < size:
            first = block[position]
            if first & 0x80:
                _, position = _skip_integer(block, position, 7)
                continue
            if first & 0x40 or first & 0x20:
                return False
            index, position = _skip_integer(block, position, 4)
            for _ in range(1 if index else 2):  # the name when it is not indexed, then the value
                length, position = _skip_integer(block, position, 7)
                position += length
        return position == size
    except IndexError:
        return False


class HeaderBlockDecoder:
    """hpack's Decoder with the header lists of recent blocks kept: Envoy's gRPC client sends every
    stream's request headers as the same bytes (indexed fields and literals not indexed), and
    hpack, pure Python, spends ~80 us on each. A kept list is valid while the dynamic table is as it
    was when the block was decoded: a block that changes the table starts a new generation and
    drops what was kept."""

    _KEPT = 64

    def __init__(self, max_header_list_size: int) -> None:
        self._decoder = Decoder(max_header_list_size=max_header_list_size)
        self._kept: dict[bytes, list[tuple[bytes, bytes]]] = {}

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        kept = self._kept.get(block)
        if kept is not None:
            return kept
        headers = self._decoder.decode(block, raw=True)
        if not leaves_table_untouched(block):
            self._kept.clear()  # the table changed: lists decoded before may read other entries now
        elif len(self._kept) < self._KEPT:
            self._kept[block] = headers
        return headers
