"""The cache daemon's wire format: msgpack headers (msgspec) plus raw KV bytes, over ZMQ.

A request is the frames `[b"", header]`, or `[b"", header, kv bytes]` for a store; a reply is
`[b"", header]` or `[b"", header, kv bytes]` for a retrieve that hit. Tokens travel as int64
little-endian bytes. KV travels as the engine's chunk `[num_layers, 2, num_tokens, channels]`,
C-contiguous, in the dtype named by the key space.

Same-host clients move no KV over the socket (cachelayer.server.shared_pool): `attach` answers
where the daemon's pool is; `reserve` + `commit` store (the client writes each chunk at its
`Slot` offset in between), `lease` + `release` retrieve (the client copies the slots out in
between). A lease belongs to the connection that opened it and its id is 16 random bytes; those
requests may carry the client's pid and process start time, so that its leases end as soon as
that process does (cachelayer.server.leases). Who may connect, and which key spaces a client may
name, is cachelayer.server.access.

The key space (`KeySpace`) is the cache identity contract: every field must agree between the
writer and the reader of a chunk, or it is a miss. `model` carries the model name, its revision,
the engine's block size and KV layout (see cachelayer.connectors.vllm.cache_model_identity);
`dtype`, `world_size` and `worker_id` are the KV dtype and the tensor-parallel size and rank.
The chunk size is the daemon's own (a client whose chunk size differs is refused), and a request's
`cache_salt` is folded into every key.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np
import torch

Operation = Literal[
    "lookup", "store", "retrieve", "hello", "attach", "reserve", "commit", "lease", "release", "feed"
]
# A client's remote-tier feed id (random, cachelayer.server.remote_feed): at most this many bytes.
MAX_FEED_ID_BYTES = 32


class KeySpace(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    dtype: str
    world_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    worker_id: Annotated[int, msgspec.Meta(ge=0)] = 0
    num_layers: Annotated[int, msgspec.Meta(ge=1)]
    num_kv_heads: Annotated[int, msgspec.Meta(ge=1)]
    head_dim: Annotated[int, msgspec.Meta(ge=1)]


class Request(msgspec.Struct, kw_only=True):
    op: Operation
    space: KeySpace | None = None
    tokens: bytes = b""
    cache_salt: str | None = None
    # The client's chunk size: a daemon with another chunk size refuses it (different key space).
    chunk_size: int = 0
    # Shared-memory operations: the client process (pid, start time in /proc ticks; only used to
    # end this connection's leases early when it dies) and the lease (its random id).
    pid: int = 0
    pid_start: int = 0
    lease: bytes = b""
    # The client's remote-tier feed (cachelayer.server.remote_feed): its random id, and the last
    # event number it has received (the daemon forgets what is acknowledged, resends the rest).
    feed: Annotated[bytes, msgspec.Meta(max_length=MAX_FEED_ID_BYTES)] = b""
    feed_ack: Annotated[int, msgspec.Meta(ge=0)] = 0


class Slot(msgspec.Struct, array_like=True):
    """Tokens [start, end) of a request live at `offset` of the shared pool, as one chunk
    [num_layers, 2, end - start, channels] in the key space's dtype."""

    start: int
    end: int
    offset: int


class SharedSegment(msgspec.Struct, kw_only=True):
    """How a same-host client maps the daemon's pool: `ticket` to the Unix socket `handout` (in the
    abstract namespace) gets its file descriptor once; the segment's header must hold `token`."""

    handout: bytes
    ticket: bytes
    pool_bytes: int
    token: bytes
    lease_ttl_s: float


class ChunkEvent(msgspec.Struct, array_like=True):
    """A chunk that entered ("stored") or left ("removed") the daemon's L1 while serving a request."""

    kind: Literal["stored", "removed"]
    key: int
    parent_key: int | None = None
    token_ids: list[int] = []


class FeedEvent(msgspec.Struct, array_like=True):
    """A chunk the daemon wrote through to its remote tier for this client's store ("stored"), one
    it announced so and the remote tier has since lost ("removed"), or "cleared": everything this
    client was told of the remote tier is void (its feed overflowed, or the daemon restarted)."""

    kind: Literal["stored", "removed", "cleared"]
    key: int = 0
    parent_key: int | None = None
    token_ids: list[int] = []
    # The chain's salt, on the chunk whose announcement carries it (vLLM's extra_keys).
    cache_salt: str | None = None


class Reply(msgspec.Struct, kw_only=True):
    ok: bool = True
    error: str | None = None
    # lookup / retrieve: leading tokens held; store: leading tokens now held.
    hit_tokens: int = 0
    chunk_size: int = 0
    events: list[ChunkEvent] = []
    # attach: the segment; reserve / lease: the lease and where its chunks are.
    segment: SharedSegment | None = None
    lease: bytes = b""
    slots: list[Slot] = []
    # The daemon process's random id, on every reply: a client that sees it change knows the
    # daemon restarted, its store empty (what it announced of the daemon's chunks is gone).
    boot_id: bytes = b""
    # The client's remote-tier feed: events after its acknowledgement, the last numbered feed_seq.
    feed_events: list[FeedEvent] = []
    feed_seq: int = 0


_request_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: Request | Reply) -> bytes:
    return _request_encoder.encode(message)


def decode_request(data: bytes | memoryview) -> Request:
    return _request_decoder.decode(data)


def decode_reply(data: bytes | memoryview) -> Reply:
    return _reply_decoder.decode(data)


def tokens_to_bytes(tokens: list[int] | np.ndarray) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


def tokens_from_bytes(data: bytes) -> np.ndarray:
    if len(data) % 8:
        raise ValueError(f"tokens must be int64 little-endian bytes, got {len(data)} bytes")
    return np.frombuffer(data, dtype="<i8")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV dtype {name!r}: use a torch dtype name such as 'bfloat16'")
    return dtype


def kv_nbytes(space: KeySpace, num_tokens: int) -> int:
    channels = space.num_kv_heads * space.head_dim
    return space.num_layers * 2 * num_tokens * channels * torch_dtype(space.dtype).itemsize


def check_kv_size(nbytes: int, space: KeySpace, num_tokens: int) -> None:
    """ValueError unless `nbytes` is exactly the KV of `num_tokens` tokens of `space`."""
    expected = kv_nbytes(space, num_tokens)
    if nbytes != expected:
        raise ValueError(
            f"KV payload has {nbytes} bytes, expected {expected} for {num_tokens} tokens of "
            f"{space.num_layers} layers x 2 x {space.num_kv_heads * space.head_dim} channels of {space.dtype}"
        )


def kv_from_bytes(data: bytes | memoryview, space: KeySpace, num_tokens: int) -> torch.Tensor:
    """The chunk tensor [num_layers, 2, num_tokens, channels] over `data` (a private copy)."""
    dtype = torch_dtype(space.dtype)
    channels = space.num_kv_heads * space.head_dim
    check_kv_size(len(data), space, num_tokens)
    expected = len(data)
    if expected == 0:
        return torch.empty(space.num_layers, 2, 0, channels, dtype=dtype)
    # A private, writable copy: the frame's memory belongs to ZMQ and is read-only.
    flat = torch.frombuffer(bytearray(data), dtype=dtype)
    return flat.view(space.num_layers, 2, num_tokens, channels)


def kv_to_bytes(kv: torch.Tensor) -> memoryview:
    """The chunk's bytes, without a copy when it is already contiguous on the CPU."""
    contiguous = kv.detach().to("cpu").contiguous()
    return memoryview(contiguous.view(torch.uint8).numpy()).cast("B")
