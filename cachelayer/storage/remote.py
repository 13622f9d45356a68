"""The shared remote tier: KV chunks in Redis (or Valkey), readable by engines on any host.

It sits below L1 and L2 and holds no local index: Redis is the index. Every call is time-boxed
(socket timeouts, no client retries) and goes through a circuit breaker, so a Redis that is down,
slow or restarting makes the tier answer "miss" at once instead of raising or stalling the engine.

Keys: `cachelayer:v1:<layout digest>:<chunk key, 16 hex digits>`. The chunk key already folds in
the cache identity (model and revision, KV dtype, layout, TP size and rank, salt, LoRA); the layout
digest adds the KV geometry and the key algorithm, so engines that could not read each other's
bytes never even look at them.

Values: the payload first, then the codec and dtype names, then a fixed little-endian footer:
    chunk key u64, num_layers u32, num_tokens u32, channels u32, payload length u64,
    codec-name length u8, dtype-name length u8, version u8, reserved u8,
    checksum u64 = xxh3_64 over the payload, the names and the footer up to the checksum,
    magic b"CLKV".
Payload first lets the writer send a chunk straight from its L1 bytes (the value's pieces go to
the socket one after the other; no copy of the KV is assembled). A value whose footer or checksum
disagrees with what the reader expects is never loaded: the reader treats it as a miss and
deletes it.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

from cachelayer.errors import CacheLayerError

log = logging.getLogger(__name__)

MAGIC = b"CLKV"
VALUE_VERSION = 1
KEY_PREFIX = "cachelayer:v1"
# key, layers, tokens, channels, payload length, codec length, dtype length, version, reserved
_FOOTER_FIELDS = struct.Struct("<QIIIQBBBB")
_FOOTER = struct.Struct("<QIIIQBBBBQ4s")  # the fields, then checksum and magic

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview


class CorruptValue(CacheLayerError, ValueError):
    """A remote value that is not the chunk the reader asked for (or not a chunk at all)."""


@dataclass(frozen=True, slots=True)
class ChunkValue:
    """A decoded remote value: the chunk's stored bytes and how to read them."""

    codec: str  # "raw" (the KV in `dtype`), or the name of the codec that encoded `payload`
    dtype: str
    num_layers: int
    num_tokens: int
    channels: int
    payload: memoryview


def value_trailer(
    key: int,
    payload: Buffer,
    *,
    codec: str,
    dtype: str,
    num_layers: int,
    num_tokens: int,
    channels: int,
) -> bytes:
    """What follows `payload` in its remote value: the names and the footer with the checksum."""
    codec_name, dtype_name = codec.encode(), dtype.encode()
    payload = memoryview(payload).cast("B")
    fields = _FOOTER_FIELDS.pack(
        key, num_layers, num_tokens, channels, payload.nbytes, len(codec_name), len(dtype_name),
        VALUE_VERSION, 0,
    )  # fmt: skip
    hasher = xxhash.xxh3_64(payload)
    hasher.update(codec_name + dtype_name + fields)
    return codec_name + dtype_name + fields + struct.pack("<Q4s", hasher.intdigest(), MAGIC)


def encode_value(key: int, payload: Buffer, **chunk: Any) -> bytes:
    """One chunk as a self-checking remote value (`value_trailer` for the keyword arguments)."""
    return bytes(payload) + value_trailer(key, payload, **chunk)


def decode_value(value: bytes, key: int) -> ChunkValue:
    """The chunk in a remote value, after checking it names `key` and its checksum holds."""
    if len(value) < _FOOTER.size:
        raise CorruptValue(f"{len(value)} bytes: shorter than a footer")
    footer_start = len(value) - _FOOTER.size
    (stored_key, layers, tokens, channels, length, codec_len, dtype_len, version, _, checksum, magic) = (
        _FOOTER.unpack_from(value, footer_start)
    )
    if magic != MAGIC or version != VALUE_VERSION:
        raise CorruptValue(f"not a version-{VALUE_VERSION} chunk value (magic {magic!r}, version {version})")
    if length + codec_len + dtype_len != footer_start:
        expected = length + codec_len + dtype_len + _FOOTER.size
        raise CorruptValue(f"{len(value)} bytes, the footer says {expected}")
    if stored_key != key:
        raise CorruptValue(f"holds chunk {stored_key:#x}, not {key:#x}")
    view = memoryview(value)
    hasher = xxhash.xxh3_64(view[: footer_start + _FOOTER_FIELDS.size])
    if hasher.intdigest() != checksum:
        raise CorruptValue("checksum mismatch")
    try:
        codec = bytes(view[length : length + codec_len]).decode()
        dtype = bytes(view[length + codec_len : footer_start]).decode()
    except UnicodeDecodeError:
        raise CorruptValue("codec or dtype name is not text") from None
    return ChunkValue(codec, dtype, layers, tokens, channels, view[:length])


class CircuitBreaker:
    """Closed until `failure_threshold` consecutive failures; then open (calls refused) for
    `retry_after_s`; then half-open: one probe call, whose outcome closes or reopens it."""

    def __init__(
        self, failure_threshold: int, retry_after_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.failure_threshold = failure_threshold
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False
        self.times_opened = 0

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    def allow(self) -> bool:
        with self._lock:
            if self._opened_at is None:
                return True
            if self._probing or self._clock() - self._opened_at < self.retry_after_s:
                return False
            self._probing = True  # half-open: this caller is the probe
            return True

    def succeeded(self) -> None:
        with self._lock:
            if self._opened_at is not None:
                log.warning("cachelayer: remote tier reachable again; circuit closed")
            self._failures, self._opened_at, self._probing = 0, None, False

    def failed(self) -> None:
        with self._lock:
            self._failures += 1
            if self._probing or (self._opened_at is None and self._failures >= self.failure_threshold):
                if self._opened_at is None:
                    self.times_opened += 1
                self._opened_at, self._probing = self._clock(), False


@dataclass(slots=True)
class RemoteCounters:
    """What the remote tier did, for stats() and /metrics."""

    hit_chunks: int = 0
    miss_chunks: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    written_chunks: int = 0
    dropped_writes: int = 0
    corrupt_chunks: int = 0


class RemoteTier:
    """Chunks in one Redis database under one layout's key prefix; every method degrades to a
    miss (or a skipped write) when Redis fails, and counts it."""

    name = "RemoteBackend"  # the controller's location name, as LMCache's remote backend
    medium = "remote"  # the KV-event medium

    def __init__(
        self,
        url: str,
        *,
        layout: Sequence[Any],
        timeout_s: float,
        failure_threshold: int,
        retry_after_s: float,
    ) -> None:
        self.url = url
        digest = xxhash.xxh3_64_hexdigest(repr(tuple(layout)).encode())
        self._prefix = f"{KEY_PREFIX}:{digest}:"
        self.breaker = CircuitBreaker(failure_threshold, retry_after_s)
        self.counters = RemoteCounters()
        self._counters_lock = threading.Lock()
        # No client-side retries: a retry multiplies the time an engine can wait on a dead server.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )

    def redis_key(self, key: int) -> str:
        return f"{self._prefix}{key:016x}"

    def close(self) -> None:
        self._client.close()

    def _count(self, **increments: int) -> None:
        with self._counters_lock:
            for field, amount in increments.items():
                setattr(self.counters, field, getattr(self.counters, field) + amount)

    def _call(self, what: str, call: Callable[[], T]) -> T | None:
        """`call()` through the breaker; None when the breaker is open or the call failed."""
        if not self.breaker.allow():
            return None
        try:
            result = call()
        except (redis.RedisError, OSError) as exc:
            self.breaker.failed()
            self._count(errors=1)
            log.warning(
                "cachelayer: remote tier %s failed (%s: %s); treated as a miss", what, type(exc).__name__, exc
            )
            return None
        self.breaker.succeeded()
        return result

    def _pipelined(self, commands: Callable[[Any], None]) -> list[Any]:
        pipeline = self._client.pipeline(transaction=False)
        commands(pipeline)
        return pipeline.execute(raise_on_error=True)

    def _present(self, what: str, keys: Sequence[int]) -> list[bool] | None:
        """Whether Redis holds each key, in one round trip (EXISTS per key, pipelined); None
        when Redis failed."""

        def exists(pipeline: Any) -> None:
            for key in keys:
                pipeline.exists(self.redis_key(key))

        answers = self._call(what, lambda: self._pipelined(exists))
        return None if answers is None else [bool(answer) for answer in answers]

    def held_prefix(self, keys: Sequence[int]) -> int:
        """How many leading `keys` Redis holds (0 when Redis failed): one round trip."""
        present = self._present("lookup", keys) if keys else None
        if present is None:
            return 0
        return next((index for index, held in enumerate(present) if not held), len(present))

    def fetch(self, keys: Sequence[int]) -> list[bytes | None]:
        """The values of `keys` in one round trip (MGET); None for a key not held, and for all of
        them when Redis failed."""
        if not keys:
            return []
        values = self._call("fetch", lambda: self._client.mget([self.redis_key(key) for key in keys]))
        if values is None:
            return [None] * len(keys)
        self._count(bytes_in=sum(len(value) for value in values if value is not None))
        return values

    def missing(self, keys: Sequence[int]) -> list[int] | None:
        """The keys Redis does not hold (one round trip), or None when Redis failed."""
        present = self._present("exists", keys) if keys else []
        if present is None:
            return None
        return [key for key, held in zip(keys, present, strict=True) if not held]

    def put(self, values: Sequence[tuple[int, Sequence[Buffer]]]) -> bool:
        """SET every key to its value, given as pieces sent one after the other (no copy made), in
        one round trip; False when Redis failed."""
        if not values:
            return True
        if self._call("write", lambda: self._send_sets(values)) is None:
            return False
        sent = sum(memoryview(piece).nbytes for _, pieces in values for piece in pieces)
        self._count(bytes_out=sent, written_chunks=len(values))
        return True

    def _send_sets(self, values: Sequence[tuple[int, Sequence[Buffer]]]) -> bool:
        # redis-py joins a value's pieces into one bytes object first; a chunk is tens of MB, so the
        # SETs are written here in RESP, each value's pieces straight to the socket.
        pool = self._client.connection_pool
        connection = pool.get_connection()
        try:
            for key, pieces in values:
                name = self.redis_key(key).encode()
                length = sum(memoryview(piece).nbytes for piece in pieces)
                head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, length)
                connection.send_packed_command([head, *pieces, b"\r\n"], check_health=False)
            for _ in values:
                connection.read_response()  # raises the server's error, if any
        except BaseException:
            connection.disconnect()  # replies may be pending: never reuse this connection
            raise
        finally:
            pool.release(connection)
        return True

    def delete(self, key: int) -> None:
        self._call("delete", lambda: self._client.delete(self.redis_key(key)))

    def note_lookup(self, hit_chunks: int, miss_chunks: int) -> None:
        self._count(hit_chunks=hit_chunks, miss_chunks=miss_chunks)

    def note_dropped_write(self, chunks: int) -> None:
        self._count(dropped_writes=chunks)

    def note_corrupt(self) -> None:
        self._count(corrupt_chunks=1)

    def stats(self) -> dict[str, int | bool]:
        with self._counters_lock:
            counters = self.counters
            return {
                "remote_hit_chunks": counters.hit_chunks,
                "remote_miss_chunks": counters.miss_chunks,
                "remote_errors": counters.errors,
                "remote_bytes_in": counters.bytes_in,
                "remote_bytes_out": counters.bytes_out,
                "remote_written_chunks": counters.written_chunks,
                "remote_dropped_writes": counters.dropped_writes,
                "remote_corrupt_chunks": counters.corrupt_chunks,
                "remote_circuit_open": self.breaker.is_open,
            }
