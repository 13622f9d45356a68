"""The shared remote tier: KV chunks in Redis (or Valkey), readable by engines on any host.

It sits below L1 and L2 and holds no local index: Redis is the index. Every call has one total
deadline (`remote_timeout_s`, from the first byte sent to the last byte read, whatever the server's
pace; extended only by the bytes actually moved, at `remote_min_transfer_mb_per_s`), no client
retries, and goes through a circuit breaker, so a Redis that is down, slow, restarting or trickling
its answers makes the tier answer "miss" in bounded time instead of raising or stalling the engine.

Keys: `cachelayer:v1:<layout digest>:<chunk key, 16 hex digits>`. The chunk key already folds in
the cache identity (model and revision, KV dtype, layout, TP size and rank, salt, LoRA); the layout
digest adds the KV geometry and the key algorithm, so engines that could not read each other's
bytes never even look at them.

Values: the payload first, then the codec and dtype names, then (version 2) an HMAC tag, then a
fixed little-endian footer:
    chunk key u64, num_layers u32, num_tokens u32, channels u32, payload length u64,
    codec-name length u8, dtype-name length u8, version u8, reserved u8,
    checksum u64 = xxh3_64 over the payload, the names, the tag and the footer up to the checksum,
    magic b"CLKV".
Version 1 values carry no tag: the checksum catches accidents, never forgeries (anyone who can
write to Redis can recompute it). Version 2 values, written when the engines share a secret
(`remote_auth_secret_env`), carry HMAC-SHA256(secret, Redis key, payload, names, footer fields):
a value forged without the secret, or a genuine value copied under another key (another model's,
another layout's), fails it. Payload first lets the writer send a chunk straight from its L1 bytes
(the value's pieces go to the socket one after the other; no copy of the KV is assembled). A value
whose footer, checksum or tag disagrees with what the reader expects is never loaded: the reader
treats it as a miss and deletes it.

The commands are spoken in RESP here, not through redis-py's parser, for two reasons: the deadline
covers a whole call (redis-py's socket timeout restarts at every read), and a fetched value's length
is read from its reply header and checked against the largest value the chunk can have before its
body is read (a huge junk value is refused without being fetched: the connection is dropped).
redis-py still opens the connections (URL forms, AUTH, SELECT, TLS).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import select
import socket
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
VALUE_VERSION = 1  # checksum only
AUTHENTICATED_VALUE_VERSION = 2  # checksum and HMAC tag
TAG_BYTES = 32  # HMAC-SHA256
KEY_PREFIX = "cachelayer:v1"
# key, layers, tokens, channels, payload length, codec length, dtype length, version, reserved
_FOOTER_FIELDS = struct.Struct("<QIIIQBBBB")
_FOOTER = struct.Struct("<QIIIQBBBBQ4s")  # the fields, then checksum and magic
# What a value holds besides its payload, at most: both names (255 bytes each), a tag, the footer.
MAX_TRAILER_BYTES = 2 * 255 + TAG_BYTES + _FOOTER.size
# A RESP reply line (a type byte, a length or an integer, CRLF) is never longer than this.
_MAX_REPLY_LINE = 64
# Idle connections kept for the next call.
_IDLE_CONNECTIONS = 8
# The keyevent notifications that say a key is gone: eviction (maxmemory), expiry, DEL/UNLINK.
_REMOVAL_KEYEVENTS = (b"evicted", b"expired", b"del")
# A notification's longest part: a channel name or one of this tier's keys (about 60 bytes).
_MAX_NOTIFICATION_BYTES = 256

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview


class CorruptValue(CacheLayerError, ValueError):
    """A remote value that is not the chunk the reader asked for (or not a chunk at all)."""


class UnauthenticatedValue(CorruptValue):
    """A value without the tag this engine's secret requires, or with a wrong one: forged, or a
    genuine value copied under another key."""


class UnverifiableValue(CorruptValue):
    """An authenticated value read by an engine without the secret: a miss, but not deleted (the
    engines that hold the secret can still use it)."""


class OversizedValue(CorruptValue):
    """A remote value larger than the chunk it is stored for can be; refused before its body was read."""


class DeadlineExceeded(CacheLayerError, redis.TimeoutError):
    """A remote call that did not finish within its total deadline."""


@dataclass(frozen=True, slots=True)
class ChunkValue:
    """A decoded remote value: the chunk's stored bytes and how to read them."""

    codec: str  # "raw" (the KV in `dtype`), or the name of the codec that encoded `payload`
    dtype: str
    num_layers: int
    num_tokens: int
    channels: int
    payload: memoryview


def _tag(secret: bytes, context: bytes, payload: memoryview, names: bytes, fields: bytes) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    # Lengths first: no two (context, payload, names) splits of the same bytes give one tag.
    mac.update(struct.pack("<QQQ", len(context), payload.nbytes, len(names)))
    mac.update(context)
    mac.update(payload)
    mac.update(names)
    mac.update(fields)
    return mac.digest()


def value_trailer(
    key: int,
    payload: Buffer,
    *,
    codec: str,
    dtype: str,
    num_layers: int,
    num_tokens: int,
    channels: int,
    secret: bytes | None = None,
    context: bytes = b"",
) -> bytes:
    """What follows `payload` in its remote value: the names, the tag (with `secret`: an HMAC over
    `context`, the Redis key it is written under, and everything else) and the footer."""
    codec_name, dtype_name = codec.encode(), dtype.encode()
    payload = memoryview(payload).cast("B")
    version = VALUE_VERSION if secret is None else AUTHENTICATED_VALUE_VERSION
    fields = _FOOTER_FIELDS.pack(
        key, num_layers, num_tokens, channels, payload.nbytes, len(codec_name), len(dtype_name),
        version, 0,
    )  # fmt: skip
    names = codec_name + dtype_name
    tag = b"" if secret is None else _tag(secret, context, payload, names, fields)
    hasher = xxhash.xxh3_64(payload)
    hasher.update(names + tag + fields)
    return names + tag + fields + struct.pack("<Q4s", hasher.intdigest(), MAGIC)


def encode_value(key: int, payload: Buffer, **chunk: Any) -> bytes:
    """One chunk as a self-checking remote value (`value_trailer` for the keyword arguments)."""
    return bytes(payload) + value_trailer(key, payload, **chunk)


def decode_value(value: Buffer, key: int, *, secret: bytes | None = None, context: bytes = b"") -> ChunkValue:
    """The chunk in a remote value, after checking it names `key`, its checksum holds and, with
    `secret`, that its tag proves it was written under `context` by an engine holding the secret."""
    if len(value) < _FOOTER.size:
        raise CorruptValue(f"{len(value)} bytes: shorter than a footer")
    footer_start = len(value) - _FOOTER.size
    (stored_key, layers, tokens, channels, length, codec_len, dtype_len, version, _, checksum, magic) = (
        _FOOTER.unpack_from(value, footer_start)
    )
    if magic != MAGIC or version not in (VALUE_VERSION, AUTHENTICATED_VALUE_VERSION):
        raise CorruptValue(f"not a chunk value (magic {magic!r}, version {version})")
    tag_len = TAG_BYTES if version == AUTHENTICATED_VALUE_VERSION else 0
    if length + codec_len + dtype_len + tag_len != footer_start:
        expected = length + codec_len + dtype_len + tag_len + _FOOTER.size
        raise CorruptValue(f"{len(value)} bytes, the footer says {expected}")
    if stored_key != key:
        raise CorruptValue(f"holds chunk {stored_key:#x}, not {key:#x}")
    view = memoryview(value).cast("B")
    hasher = xxhash.xxh3_64(view[: footer_start + _FOOTER_FIELDS.size])
    if hasher.intdigest() != checksum:
        raise CorruptValue("checksum mismatch")
    names_end = length + codec_len + dtype_len
    if secret is not None:
        if tag_len == 0:
            raise UnauthenticatedValue(
                "not authenticated (a version-1 value): this engine shares a secret and loads only "
                "values tagged with it"
            )
        expected_tag = _tag(
            secret, context, view[:length], bytes(view[length:names_end]),
            bytes(view[footer_start : footer_start + _FOOTER_FIELDS.size]),
        )  # fmt: skip
        if not hmac.compare_digest(expected_tag, bytes(view[names_end:footer_start])):
            raise UnauthenticatedValue("authentication tag mismatch (forged, or written under another key)")
    elif tag_len:
        raise UnverifiableValue("authenticated with a secret this engine was not given")
    try:
        codec = bytes(view[length : length + codec_len]).decode()
        dtype = bytes(view[length + codec_len : names_end]).decode()
    except UnicodeDecodeError:
        raise CorruptValue("codec or dtype name is not text") from None
    return ChunkValue(codec, dtype, layers, tokens, channels, view[:length])


class _Exchange:
    """One call on one connection: commands out and replies in, all before one deadline. Each
    socket wait gets only the time left, so a server that trickles bytes cannot stretch the call.

    The deadline is `deadline` plus one second per `bytes_per_s` bytes moved so far: a chunk of
    tens of MB is not cut off for being large, and a server sending slower than that floor still
    ends within remote_timeout_s plus the time the call's bounded bytes take at the floor rate."""

    def __init__(self, sock: socket.socket, deadline: float, bytes_per_s: float) -> None:
        self._sock = sock
        self._deadline = deadline
        self._bytes_per_s = bytes_per_s
        self._moved = 0
        self._buffer = bytearray()
        self._start = 0

    def _time_left(self, allowance_bytes: int = 0) -> float:
        left = self._deadline + (self._moved + allowance_bytes) / self._bytes_per_s - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(
                "the call did not finish within remote_timeout_s (and its bytes' share of it)"
            )
        return left

    def send(self, pieces: Sequence[Buffer]) -> None:
        for piece in pieces:
            size = memoryview(piece).nbytes
            # sendall's timeout bounds the whole piece: it gets the piece's own allowance up front.
            self._sock.settimeout(self._time_left(size))
            try:
                self._sock.sendall(piece)
            except TimeoutError:
                raise DeadlineExceeded("sending did not finish within its deadline") from None
            self._moved += size

    def _receive_into(self, target: memoryview) -> int:
        self._sock.settimeout(self._time_left())
        try:
            received = self._sock.recv_into(target)
        except TimeoutError:
            raise DeadlineExceeded("the reply did not arrive within its deadline") from None
        if not received:
            raise redis.ConnectionError("Redis closed the connection mid-reply")
        self._moved += received
        return received

    def _line(self) -> bytes:
        while True:
            end = self._buffer.find(b"\r\n", self._start)
            if 0 <= end <= self._start + _MAX_REPLY_LINE:
                line = bytes(self._buffer[self._start : end])
                self._start = end + 2
                return line
            if len(self._buffer) - self._start > _MAX_REPLY_LINE:
                raise redis.InvalidResponse("a reply line longer than any Redis sends")
            if self._start:
                del self._buffer[: self._start]
                self._start = 0
            chunk = bytearray(65536)
            received = self._receive_into(memoryview(chunk))
            self._buffer += memoryview(chunk)[:received]

    def _bulk_body(self, length: int) -> bytearray:
        """`length` bytes then CRLF; the body is read straight into its own buffer (one copy)."""
        body = bytearray(length)
        view = memoryview(body)
        buffered = min(length, len(self._buffer) - self._start)
        view[:buffered] = self._buffer[self._start : self._start + buffered]
        self._start += buffered
        filled = buffered
        while filled < length:
            filled += self._receive_into(view[filled:])
        if self._line() != b"":
            raise redis.InvalidResponse("a bulk string not followed by CRLF")
        return body

    def reply(self, max_bulk_bytes: int | None = None) -> Any:
        """One reply: bytes for a status, int, bytearray or None for a bulk string, a list of
        bulk replies for an array (each bounded by `max_bulk_bytes`[i]); a server error is raised."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        try:
            if kind == b"+":
                return rest
            if kind == b"-":
                raise redis.ResponseError(rest.decode(errors="replace"))
            if kind == b":":
                return int(rest)
            if kind == b"$":
                length = int(rest)
                if length < 0:
                    return None
                if max_bulk_bytes is not None and length > max_bulk_bytes:
                    raise OversizedValue(f"{length} bytes, more than the {max_bulk_bytes} its chunk can take")
                return self._bulk_body(length)
        except ValueError as exc:
            if isinstance(exc, CorruptValue):
                raise
            raise redis.InvalidResponse(f"an unreadable reply line {line[:32]!r}") from None
        raise redis.InvalidResponse(f"an unexpected reply {line[:32]!r}")

    @property
    def buffered(self) -> bool:
        """Whether bytes already read wait to be parsed."""
        return len(self._buffer) > self._start

    def restart_deadline(self, deadline: float) -> None:
        """A new deadline for the next reply (a subscription's messages come one by one, at any time)."""
        self._deadline = deadline
        self._moved = 0

    def array_length(self) -> int:
        line = self._line()
        if line[:1] != b"*":
            if line[:1] == b"-":
                raise redis.ResponseError(line[1:].decode(errors="replace"))
            raise redis.InvalidResponse(f"an array expected, got {line[:32]!r}")
        try:
            return int(line[1:])
        except ValueError:
            raise redis.InvalidResponse(f"an unreadable array length {line[:32]!r}") from None


def _notification(exchange: _Exchange) -> list[Any]:
    """A pub/sub message, a subscription's confirmation or a CONFIG GET answer: an array of at most
    three short parts (anything longer is no answer Redis gives to these, and drops the connection)."""
    count = exchange.array_length()
    if count > 3:
        raise redis.InvalidResponse(f"an array of {count} parts where at most 3 were expected")
    return [exchange.reply(max_bulk_bytes=_MAX_NOTIFICATION_BYTES) for _ in range(count)]


def resp_command(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(part), part) for part in parts)


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

    # Values refused because their tag was missing or wrong (also counted in corrupt_chunks).
    unauthenticated_chunks: int = 0


def _shut(connection: Any) -> None:
    """End a connection's socket from another thread: a read or write blocked on it returns at once."""
    sock = getattr(connection, "_sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class RemoteTier:
    """Chunks in one Redis database under one layout's key prefix; every method degrades to a
    miss (or a skipped write) when Redis fails or misses its deadline, and counts it."""

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
        secret: bytes | None = None,
        min_transfer_bytes_per_s: float = 64 << 20,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.min_transfer_bytes_per_s = min_transfer_bytes_per_s
        digest = xxhash.xxh3_64_hexdigest(repr(tuple(layout)).encode())
        self._prefix = f"{KEY_PREFIX}:{digest}:"
        # With a secret, values are written with an HMAC tag and only tagged values are loaded.
        self._secret = secret
        self.breaker = CircuitBreaker(failure_threshold, retry_after_s)
        self.counters = RemoteCounters()
        self._counters_lock = threading.Lock()
        # redis-py parses the URL and opens connections (AUTH, SELECT, TLS); no client-side retries:
        # a retry multiplies the time an engine can wait on a dead server.
        pool = redis.ConnectionPool.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._connection_class = pool.connection_class
        self._connection_kwargs = dict(pool.connection_kwargs)
        self._idle: list[Any] = []
        self._idle_lock = threading.Lock()
        self._closed = False

    @property
    def database(self) -> int:
        """The Redis database number the URL selects (its keyevent channels are named after it)."""
        return int(self._connection_kwargs.get("db") or 0)

    @property
    def authenticated(self) -> bool:
        return self._secret is not None

    def redis_key(self, key: int) -> str:
        return f"{self._prefix}{key:016x}"

    def close(self) -> None:
        with self._idle_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.disconnect()

    # ---- values ----

    def value_trailer(self, key: int, payload: Buffer, **chunk: Any) -> bytes:
        """`value_trailer` for this tier: tagged for the Redis key it goes under when a secret is set."""
        return value_trailer(key, payload, **chunk, secret=self._secret, context=self.redis_key(key).encode())

    def decode(self, value: Buffer, key: int) -> ChunkValue:
        """`decode_value` for this tier: with a secret, only values tagged for this very Redis key."""
        return decode_value(value, key, secret=self._secret, context=self.redis_key(key).encode())

    # ---- connections: each call has one deadline ----

    def _connection(self, deadline: float) -> Any:
        while True:
            with self._idle_lock:
                if not self._idle:
                    break
                connection = self._idle.pop()
            # An idle socket with something to read was closed by Redis (restart, idle timeout) or
            # holds stray bytes: either way not one to send a command on.
            readable, _, _ = select.select([connection._sock], [], [], 0)
            if not readable:
                return connection
            connection.disconnect()
        connection = self._connection_class(**self._connection_kwargs)
        # The handshake (AUTH, SELECT, CLIENT SETINFO) is read by redis-py, whose timeout restarts
        # at each read: a timer ends the socket at the call's deadline instead.
        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (connection,))
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.connect()
        except BaseException:
            connection.disconnect()
            raise
        finally:
            watchdog.cancel()
        if time.monotonic() >= deadline:
            connection.disconnect()
            raise DeadlineExceeded("connecting did not finish within remote_timeout_s")
        return connection

    def _release(self, connection: Any) -> None:
        with self._idle_lock:
            if not self._closed and len(self._idle) < _IDLE_CONNECTIONS:
                self._idle.append(connection)
                return
        connection.disconnect()

    def _exchange(self, run: Callable[[_Exchange], T]) -> T:
        """`run` on a connection, within the deadline; a connection left mid-reply is never reused."""
        deadline = time.monotonic() + self.timeout_s
        connection = self._connection(deadline)
        try:
            result = run(_Exchange(connection._sock, deadline, self.min_transfer_bytes_per_s))
        except BaseException:
            connection.disconnect()  # replies may be pending, or the socket timed out
            raise
        self._release(connection)
        return result

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

    # ---- commands ----

    def _present(self, what: str, keys: Sequence[int]) -> list[bool] | None:
        """Whether Redis holds each key, in one round trip (EXISTS per key, pipelined); None
        when Redis failed."""

        def exists(exchange: _Exchange) -> list[bool]:
            exchange.send([b"".join(resp_command(b"EXISTS", self.redis_key(key).encode()) for key in keys)])
            answers = [exchange.reply() for _ in keys]
            if not all(isinstance(answer, int) for answer in answers):
                raise redis.InvalidResponse("EXISTS answered something other than an integer")
            return [bool(answer) for answer in answers]

        return self._call(what, lambda: self._exchange(exists))

    def held_prefix(self, keys: Sequence[int]) -> int:
        """How many leading `keys` Redis holds (0 when Redis failed): one round trip."""
        present = self._present("lookup", keys) if keys else None
        if present is None:
            return 0
        return next((index for index, held in enumerate(present) if not held), len(present))

    def fetch(
        self, keys: Sequence[int], max_value_bytes: Sequence[int]
    ) -> list[bytearray | CorruptValue | None]:
        """The values of `keys` in one round trip (MGET): None for a key not held (and for all of
        them when Redis failed). A value longer than its `max_value_bytes` is refused from its reply
        header, before its body is read: an OversizedValue stands in its place, and the values after
        it are not read (None; the connection is dropped)."""
        if not keys:
            return []

        def mget(exchange: _Exchange) -> list[bytearray | CorruptValue | None]:
            exchange.send([resp_command(b"MGET", *(self.redis_key(key).encode() for key in keys))])
            if exchange.array_length() != len(keys):
                raise redis.InvalidResponse("MGET answered another number of values than keys asked")
            values: list[bytearray | CorruptValue | None] = []
            for limit in max_value_bytes:
                try:
                    value = exchange.reply(max_bulk_bytes=limit)
                except OversizedValue as refused:
                    values.append(refused)
                    values.extend([None] * (len(keys) - len(values)))
                    raise _Refused(values) from None
                if value is not None and not isinstance(value, bytearray):
                    raise redis.InvalidResponse("MGET answered something other than a value")
                values.append(value)
            return values

        def call() -> list[bytearray | CorruptValue | None]:
            try:
                return self._exchange(mget)
            except _Refused as refused:  # the connection is dropped, the call itself did its job
                return refused.values

        values = self._call("fetch", call)
        if values is None:
            return [None] * len(keys)
        self._count(bytes_in=sum(len(value) for value in values if isinstance(value, bytearray)))
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
        return self.put_with(values, []) is not None

    def put_with(
        self, values: Sequence[tuple[int, Sequence[Buffer]]], commands: Sequence[bytes], max_items: int = 0
    ) -> list[list[Any]] | None:
        """`put`, then `commands` (whole RESP commands, e.g. the tenant index's EVAL) in the same
        round trip; their array replies (at most `max_items` short parts each), or None when Redis
        failed."""
        if not values and not commands:
            return []
        replies = self._call(
            "write",
            lambda: self._exchange(lambda exchange: self._send_sets(exchange, values, commands, max_items)),
        )
        if replies is None:
            return None
        sent = sum(memoryview(piece).nbytes for _, pieces in values for piece in pieces)
        self._count(bytes_out=sent, written_chunks=len(values))
        return replies

    def _send_sets(
        self,
        exchange: _Exchange,
        values: Sequence[tuple[int, Sequence[Buffer]]],
        commands: Sequence[bytes],
        max_items: int,
    ) -> list[list[Any]]:
        # A chunk is tens of MB: each value's pieces go straight to the socket, never joined.
        for key, pieces in values:
            name = self.redis_key(key).encode()
            length = sum(memoryview(piece).nbytes for piece in pieces)
            head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, length)
            exchange.send([head, *pieces, b"\r\n"])
        if commands:
            exchange.send(list(commands))
        for _ in values:
            exchange.reply()  # raises the server's error, if any
        replies = []
        for _ in commands:
            count = exchange.array_length()
            if count > max_items:
                raise redis.InvalidResponse(
                    f"an array of {count} parts where at most {max_items} were expected"
                )
            replies.append([exchange.reply(max_bulk_bytes=_MAX_NOTIFICATION_BYTES) for _ in range(count)])
        return replies

    def delete(self, key: int) -> None:
        def delete(exchange: _Exchange) -> None:
            exchange.send([resp_command(b"DEL", self.redis_key(key).encode())])
            exchange.reply()

        self._call("delete", lambda: self._exchange(delete))

    # ---- removals Redis announces (keyspace notifications) ----

    def chunk_key_of(self, redis_key: bytes) -> int | None:
        """The chunk key a Redis key of this tier names; None for any other key."""
        prefix = self._prefix.encode()
        if not redis_key.startswith(prefix) or len(redis_key) != len(prefix) + 16:
            return None
        try:
            return int(redis_key[len(prefix) :], 16)
        except ValueError:
            return None

    def keyevent_flags(self) -> str | None:
        """The server's `notify-keyspace-events`, or None when it cannot be read (CONFIG refused by
        an ACL or renamed, Redis down)."""
        return self.config_value("notify-keyspace-events")

    def config_value(self, name: str) -> str | None:
        """One server setting (CONFIG GET), or None when it cannot be read (CONFIG refused by an ACL
        or renamed, Redis down)."""

        def config_get(exchange: _Exchange) -> str | None:
            exchange.send([resp_command(b"CONFIG", b"GET", name.encode())])
            answer = _notification(exchange)
            if len(answer) == 2 and isinstance(answer[1], bytearray):
                return bytes(answer[1]).decode(errors="replace")
            return None

        try:
            return self._exchange(config_get)
        except (redis.RedisError, OSError):
            return None

    def watch_removals(
        self,
        on_removed: Callable[[list[int]], None],
        stopped: threading.Event,
        *,
        database: int,
        on_subscribed: Callable[[], None] = lambda: None,
        poll_s: float = 0.5,
    ) -> None:
        """Until `stopped` is set, call `on_removed` with the chunk keys of this tier that the server
        announces evicted, expired or deleted (its keyevent notifications on `database`). Returns
        when `stopped` is set; raises (redis.RedisError, OSError) when the connection fails, so the
        caller reconnects: pub/sub keeps nothing for a subscriber that was away. Every message is
        read within the tier's deadline and bounded (a notification names one key; a longer one
        drops the connection)."""
        deadline = time.monotonic() + self.timeout_s
        connection = self._connection(deadline)
        try:
            sock = connection._sock
            exchange = _Exchange(sock, deadline, self.min_transfer_bytes_per_s)
            channels = [b"__keyevent@%d__:%s" % (database, event) for event in _REMOVAL_KEYEVENTS]
            exchange.send([resp_command(b"SUBSCRIBE", *channels)])
            for _ in channels:  # ["subscribe", channel, count] each
                _notification(exchange)
            on_subscribed()
            while not stopped.is_set():
                if not exchange.buffered:
                    readable, _, _ = select.select([sock], [], [], poll_s)
                    if not readable:
                        continue
                removed: list[int] = []
                while True:  # every message already here, then one call
                    exchange.restart_deadline(time.monotonic() + self.timeout_s)
                    parts = _notification(exchange)
                    if len(parts) == 3 and parts[0] == b"message" and isinstance(parts[2], bytearray):
                        key = self.chunk_key_of(bytes(parts[2]))
                        if key is not None:
                            removed.append(key)
                    if not exchange.buffered and not select.select([sock], [], [], 0)[0]:
                        break
                if removed:
                    on_removed(removed)
        finally:
            connection.disconnect()  # a subscribed connection is never reused for commands

    def note_lookup(self, hit_chunks: int, miss_chunks: int) -> None:
        self._count(hit_chunks=hit_chunks, miss_chunks=miss_chunks)

    def note_dropped_write(self, chunks: int) -> None:
        self._count(dropped_writes=chunks)

    def note_corrupt(self, unauthenticated: bool = False) -> None:
        self._count(corrupt_chunks=1, unauthenticated_chunks=int(unauthenticated))

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
                "remote_unauthenticated_chunks": counters.unauthenticated_chunks,
                "remote_circuit_open": self.breaker.is_open,
                "remote_authenticated": self._secret is not None,
            }


class _Refused(CacheLayerError):
    """Not an error: carries the values read before a refusal out of the exchange."""

    def __init__(self, values: list[bytearray | CorruptValue | None]) -> None:
        self.values = values
