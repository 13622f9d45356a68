"""Messages between the controller and the cache engines' workers (msgpack over ZMQ).

- Worker -> controller, PUSH to the controller's monitor PULL socket (`controller_pull_url`):
  `WorkerReport` with kind "register", "heartbeat" or "deregister". A heartbeat carries the
  whole registration, so a restarted controller relearns its workers within one interval.
- With a shared secret, every message starts with an authentication frame (auth.py); the frames
  below follow it.
- Controller -> worker, REQ to the worker's REP command socket (the `url` it registered):
  `Command` answered by `Reply`. A move between instances relays chunks through the controller
  one at a time: "export_chunk" is answered by a `Reply` frame followed by the chunk's stored
  bytes as a second raw frame, and "import_chunk" carries them the same way after its `Command`.

The error body of the cache layer's HTTP endpoints (`lmcache_error_body`) is defined here too: it is
LMCache's shape, like the messages above.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

_json = msgspec.json.Encoder()


def lmcache_error_body(detail: str) -> bytes:
    """The JSON body of an HTTP error answer: `{"detail": "..."}`.

    This is the shape LMCache's controller (FastAPI) gives every error, and the one its clients and
    tools read, so the controller and the daemon's HTTP endpoints answer in it rather than in the
    gateway's OpenAI shape (`{"error": {...}}`, router.errors)."""
    return _json.encode({"detail": detail})


# Tokens one request or command may carry unless configured otherwise (--max-tokens,
# controller_max_tokens): a bound on the work and memory one call can cost.
DEFAULT_MAX_TOKENS = 1 << 20
# A token id takes at most this many bytes in msgpack (uint64) and in JSON (with its comma).
MAX_BYTES_PER_TOKEN = 21

ReportKind = Literal["register", "heartbeat", "deregister"]
Operation = Literal[
    "lookup",
    "clear",
    "pin",
    "compress",
    "decompress",
    "move",
    "health",
    "info",
    "identity",
    "export_chunk",
    "import_chunk",
    "drop",
]


class WorkerReport(msgspec.Struct, kw_only=True):
    kind: ReportKind
    instance_id: str
    worker_id: int
    world_size: int = 1
    ip: str = "127.0.0.1"
    port: int = 0
    heartbeat_interval_s: float = 2.0
    chunk_size: int = 256
    # Bytes of KV a token holds in this engine (all layers, K and V): the controller's timeout for
    # commands whose work follows the tokens' KV grows with it. 0: not reported (an older worker).
    kv_bytes_per_token: int = 0


class Command(msgspec.Struct, kw_only=True):
    op: Operation
    tokens: list[int] = []
    location: str | None = None
    destination: str | None = None
    method: str | None = None
    copy: bool = False
    chunk_index: int = 0
    chunk_format: str | None = None  # import_chunk: the format export_chunk reported
    # lookup: the namespace of the tokens' chunks (not LMCache's: its lookup has none).
    cache_salt: str | None = None
    lora: str | None = None


class Reply(msgspec.Struct, kw_only=True):
    ok: bool = True
    num_tokens: int = 0
    location: str | None = None
    error: str | None = None
    info: dict[str, Any] | None = None
    # A refusal for now (the worker is not ready for this command yet): the same command, sent
    # again after about this many seconds, is expected to run. The controller answers 503.
    retry_after_s: float | None = None
    chunk_format: str | None = None  # export_chunk: "raw" or the codec the bytes are encoded with


def encode(message: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(message)


def normalize_url(url: str) -> str:
    """LMCache writes `host:port`; ZMQ wants `tcp://host:port`."""
    return url if "://" in url else f"tcp://{url}"
