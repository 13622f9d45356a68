"""The shared cache daemon: one L1 store that several engines' connectors store to and load from.

`StoreServer` answers the ZMQ data plane (ROUTER; see cachelayer.server.protocol) from one
`CacheEngine` per key space (model identity, TP size and rank, KV shape and dtype), all created on
first use. `cachelayer server` runs it with an HTTP side (GET /healthcheck, GET /metrics with
LMCache's multiprocess metric names). The vLLM connector's in-process mode runs the same server on
an ipc:// socket inside the worker, so its scheduler side can ask the worker's store for lookups.

With `shared_memory`, the L1 pool lives in a shared segment (cachelayer.server.shared_pool) and
same-host clients copy KV in and out of it themselves, under leases (cachelayer.server.leases);
the socket then carries only keys, offsets and lease ids. Remote clients keep the TCP path.

All key spaces share one L1 pool and one lock: `--l1-size-gb` bounds the daemon's KV memory
whatever model names clients send, and a store of one key space may evict another's chunks (the
eviction policy runs over the whole pool). The number of key spaces is capped too
(`MAX_KEY_SPACES` in all, `max_key_spaces_per_client` per credential); a new key space past a cap
retires the least recently used idle one (its chunks stay in the pool), so clients inventing
identities can neither grow the daemon's bookkeeping nor lock a real model out.

Access (cachelayer.server.access): with credentials, a connection must present one's secret in
its handshake, and each request may only name key spaces its credential allows; leases belong to
the connection that opened them. Bounds on what one request can cost: `max_message_bytes` a frame
(ZMQ MAXMSGSIZE: a larger frame disconnects its sender before it is buffered), `max_tokens` a
request, `MAX_QUEUED_PER_CONNECTION` messages queued per connection each way (a client that never
reads its answers), and lookups that hash no further than the held prefix (`_held_tokens`). A malformed or
refused request is answered with an error and logged as one line (at most `REFUSAL_LOG_PER_S` a
second), never with a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import numpy as np
import zmq

from cachelayer.config import CacheLayerConfig
from cachelayer.controller.protocol import lmcache_error_body
from cachelayer.controller.worker import attach_controller_worker
from cachelayer.engine import CacheEngine
from cachelayer.errors import CacheLayerError
from cachelayer.server import protocol
from cachelayer.server.access import (
    ANONYMOUS,
    Credential,
    RateLimitedLog,
    ZapHandler,
    may_reach,
    model_name,
)
from cachelayer.server.leases import ClientProcess, LeaseLimitError, LeaseTable, Owner
from cachelayer.server.protocol import ChunkEvent, KeySpace, Reply, Request, SharedSegment, Slot
from cachelayer.server.remote_feed import EngineFeed, RemoteFeeds
from cachelayer.server.shared_pool import PoolHandout, SharedPool
from cachelayer.storage.allocator import ALIGNMENT
from cachelayer.storage.cpu import CpuTier
from kvwire import BlockRemoved, BlockStored
from kvwire import KVEvent as Event

log = logging.getLogger(__name__)

# Key spaces one daemon serves (models x TP ranks x dtypes in practice): a bound on bookkeeping,
# far above any real deployment's count.
MAX_KEY_SPACES = 256
# Key spaces the clients of one credential may have open at once (8 models at TP 8).
DEFAULT_MAX_KEY_SPACES_PER_CLIENT = 64
# Most tokens one request may carry (the controller's bound too): about 1 s of key hashing.
DEFAULT_MAX_TOKENS = 1 << 20
# Largest frame a client may send (a TCP store's KV bytes); libzmq drops the sender of a larger one.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
# A lookup hashes its tokens in slices that double, stopping at the first that is not all held:
# a long prompt that is not cached costs one slice of hashing, not its whole length.
FIRST_LOOKUP_SLICE_CHUNKS = 16
# Messages queued per connection, each way: a client that pipelines requests and never reads the
# answers makes the daemon hold this many replies (KV included) at most, after which its replies
# are dropped; an honest client has one request in flight.
MAX_QUEUED_PER_CONNECTION = 16
# Refused requests logged a second, at most (a flood of bad frames must not flood the log).
REFUSAL_LOG_PER_S = 5
# Requests that may carry a client's remote-tier feed: those that store (and so cause
# write-throughs) and the feed's own poll; loads and lookups stay as small as they were.
FEED_OPERATIONS = frozenset({"store", "reserve", "commit", "feed"})
# Engine counters a retired key space leaves in the daemon's totals (counters never go down).
RETIRED_COUNTERS = ("read_chunks", "write_chunks", "lookup_requested_tokens", "lookup_hit_tokens")

# LMCache's multiprocess-server metric names, so existing dashboards work unchanged.
METRIC_HELP = {
    "lmcache_mp_l1_read_chunks_total": ("counter", "Chunks read from the L1 store"),
    "lmcache_mp_l1_write_chunks_total": ("counter", "Chunks written to the L1 store"),
    "lmcache_mp_l1_evicted_chunks_total": ("counter", "Chunks evicted from the L1 store"),
    "lmcache_mp_l1_usage_ratio": ("gauge", "Fraction of the L1 store in use"),
    "lmcache_mp_lookup_requested_tokens_total": ("counter", "Tokens asked for by lookups"),
    "lmcache_mp_lookup_hit_tokens_total": ("counter", "Tokens found by lookups"),
    "cachelayer_daemon_l1_used_bytes": ("gauge", "Bytes of the L1 pool allocated to chunks"),
    "cachelayer_daemon_open_leases": ("gauge", "Shared-memory leases open now"),
    "cachelayer_daemon_leases_total": ("counter", "Shared-memory leases opened (same-host stores and reads)"),
    "cachelayer_daemon_expired_leases_total": ("counter", "Leases ended by their deadline"),
    "cachelayer_daemon_reclaimed_leases_total": ("counter", "Leases ended because their client died"),
}
# The remote tier's counters (present when remote_url is set), named cachelayer_<stats key>
# (counters with _total): engine.stats() key -> (kind, help).
REMOTE_METRIC_HELP = {
    "remote_hit_chunks": ("counter", "Chunks found in the remote tier"),
    "remote_miss_chunks": ("counter", "Chunks asked of the remote tier and not found"),
    "remote_errors": ("counter", "Remote calls that failed or timed out"),
    "remote_bytes_in": ("counter", "Bytes read from the remote tier"),
    "remote_bytes_out": ("counter", "Bytes written to the remote tier"),
    "remote_dropped_writes": ("counter", "Chunks not written through (queue full or remote down)"),
    "remote_corrupt_chunks": ("counter", "Remote values that failed their check, refused and deleted"),
    "remote_circuit_open": ("gauge", "Engines whose remote circuit breaker is open"),
}

# The remote-tier feeds (present when remote_url is set; cachelayer.server.remote_feed).
FEED_METRIC_HELP = {
    "cachelayer_daemon_remote_feeds": ("gauge", "Clients with a remote-tier feed"),
    "cachelayer_daemon_remote_feed_queued_events": ("gauge", "Feed events not acknowledged yet"),
    "cachelayer_daemon_remote_feed_resets_total": ("counter", "Feeds cleared because they overflowed"),
}

# Per-tenant gauges of the L1 pool (with tenant_quotas): name, usage field, help.
TENANT_METRICS = (
    ("cachelayer_tenant_l1_used_bytes", "bytes", "Bytes of the L1 pool a tenant's chunks take"),
    ("cachelayer_tenant_l1_chunks", "chunks", "Chunks of a tenant in the L1 pool"),
    ("cachelayer_tenant_l1_cap_bytes", "cap_bytes", "Most bytes of the L1 pool a tenant may take"),
    (
        "cachelayer_tenant_l1_evicted_for_cap_total",
        "evicted_for_cap",
        "Chunks evicted to keep a tenant in its cap",
    ),
    (
        "cachelayer_tenant_l1_refused_chunks_total",
        "refused",
        "Chunks not stored: the tenant's own made no room",
    ),
)


def _remote_metric_name(field: str) -> str:
    kind, _ = REMOTE_METRIC_HELP[field]
    return f"cachelayer_{field}_total" if kind == "counter" else f"cachelayer_{field}"


class KeySpaceLimitError(CacheLayerError, RuntimeError):
    """A store asked for a key space beyond MAX_KEY_SPACES, and none could be retired."""


class AccessError(CacheLayerError, PermissionError):
    """A client asked for a key space (or the shared pool) its credential does not allow."""


class RequestRefused(CacheLayerError, ValueError):
    """A request beyond the daemon's bounds (tokens per request)."""


# What a bad or refused request raises: answered with an error and one log line, no traceback.
REFUSALS = (
    msgspec.MsgspecError,
    ValueError,
    PermissionError,
    LeaseLimitError,
    KeySpaceLimitError,
)


def _operation_of(frames: list[zmq.Frame]) -> str:
    """The op a request names, for the log line of a refusal ("a request" when unreadable)."""
    for frame in frames[1:3]:
        with contextlib.suppress(Exception):
            return repr(msgspec.msgpack.decode(frame.buffer, type=_OpOnly).op)
    return "a request"


class _OpOnly(msgspec.Struct):
    op: str


class StoreServer:
    """Serves lookup/store/retrieve for every key space over one ROUTER socket, in one thread."""

    def __init__(
        self,
        config: CacheLayerConfig,
        endpoint: str,
        *,
        context: zmq.Context | None = None,
        start_controller_worker: bool = False,
        shared_memory: bool = False,
        lease_ttl_s: float = 30.0,
        credentials: list[Credential] | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_key_spaces_per_client: int = DEFAULT_MAX_KEY_SPACES_PER_CLIENT,
        max_leases_per_client: int = 64,
    ) -> None:
        """`shared_memory`: put the L1 pool in a shared segment that same-host clients map;
        `lease_ttl_s`: how long such a client may hold chunks between two messages;
        `credentials`: the secrets clients must present (None: anyone who reaches the socket);
        `max_tokens`, `max_message_bytes`, `max_key_spaces_per_client`, `max_leases_per_client`:
        what one request, one frame, one credential and one connection may cost."""
        self.config = config
        # New at every start: clients tell a restarted daemon (an empty store) by it.
        self.boot_id = os.urandom(16)
        self.max_tokens = max_tokens
        self.max_key_spaces_per_client = max_key_spaces_per_client
        self.credentials = {credential.name: credential for credential in credentials or []}
        # The shared daemon serves many engines and registers with no controller itself; a store
        # inside one vLLM worker honours the whole config (controller registration included).
        self._start_controller_worker = start_controller_worker
        self._engines: dict[KeySpace, CacheEngine] = {}
        # The remote tier's writes and losses, told to the clients whose stores caused them.
        self.feeds = RemoteFeeds()
        self._engine_feeds: dict[KeySpace, EngineFeed] = {}
        # Per key space: the credential that created it, and when a request last used it.
        self._space_creator: dict[KeySpace, str] = {}
        self._space_used: dict[KeySpace, float] = {}
        self._retired_counts = dict.fromkeys(RETIRED_COUNTERS, 0.0)
        self.retired_key_spaces = 0
        self._engines_lock = threading.Lock()
        # One L1 pool and one lock for every key space's engine: one memory budget in total.
        self.shared_pool: SharedPool | None = None
        self.pool_handout: PoolHandout | None = None
        if shared_memory:
            capacity = config.max_local_cpu_bytes
            self.shared_pool = SharedPool.create(capacity - capacity % ALIGNMENT)
            self.pool_handout = PoolHandout(self.shared_pool.fd)
        pool = self.shared_pool.pool if self.shared_pool is not None else None
        # Tenant quotas are shares of this one pool, whatever key space (model) a chunk is in.
        self.cpu = CpuTier(
            config.max_local_cpu_bytes, config.cache_policy, pool=pool, quotas=config.tenant_quotas
        )
        self.store_lock = threading.RLock()
        self.leases = LeaseTable(ttl_s=lease_ttl_s, max_per_client=max_leases_per_client)
        self._refusals = RateLimitedLog(log, "cachelayer server: refused %s: %s%s", REFUSAL_LOG_PER_S)
        self.refused_requests = 0
        self._own_context: zmq.Context | None = None
        self._zap: ZapHandler | None = None
        if self.credentials:
            # A context of its own: its ZAP handler answers for this daemon's socket only.
            self._own_context = zmq.Context()
            self._context = self._own_context
            self._zap = ZapHandler(self._context, list(self.credentials.values()))
        else:
            self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._socket.setsockopt(zmq.SNDHWM, MAX_QUEUED_PER_CONNECTION)
        self._socket.setsockopt(zmq.RCVHWM, MAX_QUEUED_PER_CONNECTION)
        if self.credentials:
            self._socket.plain_server = True
        self._socket.bind(endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests_served = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- engines per key space ----
    def _new_engine(self, space: KeySpace) -> CacheEngine:
        engine = CacheEngine(
            self.config,
            num_layers=space.num_layers,
            num_kv_heads=space.num_kv_heads,
            head_dim=space.head_dim,
            dtype=space.dtype,
            model_name=space.model,
            world_size=space.world_size,
            worker_id=space.worker_id,
            cpu_tier=self.cpu,
            lock=self.store_lock,
        )
        if self._start_controller_worker:
            attach_controller_worker(engine, self.config)
        if engine.remote is not None:
            feed = EngineFeed(self.feeds, engine.cpu.medium, engine.remote.medium)
            engine.add_event_listener(feed)
            self._engine_feeds[space] = feed
        return engine

    def engine_for(
        self, space: KeySpace, *, create: bool = True, credential: str = ANONYMOUS
    ) -> CacheEngine | None:
        """The engine of `space`; with `create`, made for `credential` when there is none, after
        retiring an idle key space if `credential` (or the daemon) is at its cap."""
        with self._engines_lock:
            engine = self._engines.get(space)
            if engine is None and create:
                own = [known for known, creator in self._space_creator.items() if creator == credential]
                if len(own) >= self.max_key_spaces_per_client:
                    self._retire_idle(own, f"credential {credential!r}", self.max_key_spaces_per_client)
                if len(self._engines) >= MAX_KEY_SPACES:
                    self._retire_idle(list(self._engines), "this daemon", MAX_KEY_SPACES)
                engine = self._new_engine(space)
                self._engines[space] = engine
                self._space_creator[space] = credential
            if engine is not None:
                self._space_used[space] = time.monotonic()
            return engine

    def _retire_idle(self, candidates: list[KeySpace], whose: str, cap: int) -> None:
        """Retire the least recently used of `candidates` that no lease holds: its engine goes,
        its chunks stay in the pool (a later client of the same key space finds them again).
        KeySpaceLimitError when every one is held. Under the engines lock."""
        idle = [space for space in candidates if not self.leases.holds(self._engines[space])]
        if not idle:
            raise KeySpaceLimitError(
                f"{whose} already has {cap} key spaces (model, dtype, TP rank, KV shape) open, each "
                "under a lease: refusing a new one; release leases, or run another `cachelayer server`"
            )
        oldest = min(idle, key=lambda space: self._space_used.get(space, 0.0))
        engine = self._engines.pop(oldest)
        del self._space_creator[oldest]
        self._space_used.pop(oldest, None)
        stats = engine.stats()
        for field in RETIRED_COUNTERS:
            self._retired_counts[field] += float(stats.get(field, 0))
        self.retired_key_spaces += 1
        feed = self._engine_feeds.pop(oldest, None)

        def retire() -> None:
            engine.close()
            if feed is not None:  # nobody will retract what it announced: retract it now
                with self.store_lock:
                    feed.retract_all()

        # Off the serving thread: an engine with a remote tier flushes its writes before it stops.
        threading.Thread(target=retire, name="cachelayer-retire", daemon=True).start()

    def engines(self) -> list[CacheEngine]:
        with self._engines_lock:
            return list(self._engines.values())

    # ---- serving ----
    def start(self) -> StoreServer:
        self._thread = threading.Thread(
            target=self.serve_forever, name="cachelayer-store-server", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            self.leases.reap()
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart(copy=False)
            client = frames[0].bytes
            # The credential libzmq's handshake accepted this connection with (ZAP User-Id).
            credential = frames[-1].get("User-Id") if self.credentials else ANONYMOUS
            owner = Owner(credential or ANONYMOUS, client)
            try:
                reply, payload = self._handle(frames[1:], owner)
            except REFUSALS as exc:  # bad input or a refusal: one line, no traceback
                self.refused_requests += 1
                self._refusals.line(_operation_of(frames), f"{type(exc).__name__}: {exc}")
                reply, payload = Reply(ok=False, error=f"{type(exc).__name__}: {exc}"), None
            except Exception as exc:  # a bug: the traceback is wanted; the daemon keeps serving
                log.exception("cachelayer server: request failed")
                reply, payload = Reply(ok=False, error=f"{type(exc).__name__}: {exc}"), None
            reply.boot_id = self.boot_id
            out = [client, b"", protocol.encode(reply)]
            if payload is not None:
                out.append(payload)
            self._socket.send_multipart(out, copy=False)
            self.requests_served += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._socket.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        if self._own_context is not None:
            self._own_context.term()
        self.leases.close()
        for engine in self.engines():
            engine.close()
        if self.pool_handout is not None:
            self.pool_handout.close()
        if self.shared_pool is not None:
            self.shared_pool.close()

    def _credential(self, owner: Owner) -> Credential | None:
        return self.credentials.get(owner.credential) if self.credentials else None

    def _check_access(self, owner: Owner, space: KeySpace) -> None:
        credential = self._credential(owner)
        if self.credentials and credential is None:  # cannot happen past the handshake; never trusted
            raise AccessError("this connection presented no credential")
        if not may_reach(credential, space):
            assert credential is not None and credential.models is not None
            raise AccessError(
                f"credential {credential.name!r} may not use model {model_name(space)!r} "
                f"(it allows {sorted(credential.models)})"
            )

    def _handle(self, frames: list[zmq.Frame], owner: Owner | None = None) -> tuple[Reply, memoryview | None]:
        """One request's reply (and KV bytes); `owner`: the connection it came on."""
        owner = owner or Owner(ANONYMOUS, b"")
        # frames: [b"", header] or [b"", header, payload]; tolerate a client that omits the delimiter.
        if frames and len(frames[0].bytes) == 0:
            frames = frames[1:]
        if not frames:
            return Reply(ok=False, error="empty request: send [b'', header(, kv bytes)]"), None
        request = protocol.decode_request(frames[0].buffer)
        outbox = None
        if request.feed and request.op in FEED_OPERATIONS:
            # Only a store makes a feed: a poll of an unknown one (another credential's) finds nothing.
            outbox = self.feeds.outbox(owner.credential, request.feed, create=request.op != "feed")
        with self.feeds.attributing(outbox):
            reply, payload = self._answer(request, frames, owner)
        if outbox is not None and reply.ok:
            reply.feed_events, reply.feed_seq = self.feeds.deliver(outbox, request.feed_ack)
        return reply, payload

    def _answer(
        self, request: Request, frames: list[zmq.Frame], owner: Owner
    ) -> tuple[Reply, memoryview | None]:
        chunk_size = self.config.chunk_size
        if request.op == "feed":
            return Reply(chunk_size=chunk_size), None
        if request.op == "hello":
            return Reply(chunk_size=chunk_size), None
        if request.op == "attach":
            return self._attach(request, owner), None
        if request.op in ("commit", "release"):
            return self._end_lease(request, owner), None
        if request.space is None:
            return Reply(ok=False, error=f"{request.op} needs a key space ('space')"), None
        self._check_access(owner, request.space)
        if len(request.tokens) > 8 * self.max_tokens:
            raise RequestRefused(
                f"{request.op} of {len(request.tokens) // 8} tokens: this daemon takes at most "
                f"{self.max_tokens} a request (--max-tokens)"
            )
        if request.chunk_size and request.chunk_size != chunk_size:
            return Reply(
                ok=False,
                error=f"chunk size {request.chunk_size} differs from the daemon's {chunk_size}: "
                "set the connector's chunk_size to the daemon's --chunk-size",
            ), None
        tokens = protocol.tokens_from_bytes(request.tokens)
        if request.op in ("reserve", "lease"):
            return self._open_lease(request, tokens, owner), None
        if request.op == "lookup":
            engine = self.engine_for(request.space, create=False)
            hit = self._held_tokens(engine, tokens, request.cache_salt) if engine is not None else 0
            return Reply(hit_tokens=hit, chunk_size=chunk_size), None
        if request.op == "retrieve":
            engine = self.engine_for(request.space, create=False)
            held = self._held_tokens(engine, tokens, request.cache_salt, counted=False) if engine else 0
            if engine is None or held == 0:
                return Reply(hit_tokens=0, chunk_size=chunk_size), None
            hit, kv = engine.retrieve(tokens[:held], cache_salt=request.cache_salt)
            if kv is None:
                return Reply(hit_tokens=0, chunk_size=chunk_size), None
            return Reply(hit_tokens=hit, chunk_size=chunk_size), protocol.kv_to_bytes(kv)
        if request.op == "store":
            if len(frames) < 2:
                return Reply(ok=False, error="store needs the KV bytes as the frame after the header"), None
            kv = protocol.kv_from_bytes(frames[1].buffer, request.space, len(tokens))
            engine = self.engine_for(request.space, credential=owner.credential)
            assert engine is not None
            held, events = store_with_events(engine, tokens, kv, request.cache_salt)
            return Reply(hit_tokens=held, chunk_size=chunk_size, events=events), None
        return Reply(ok=False, error=f"unknown operation {request.op!r}"), None

    def _held_tokens(
        self, engine: CacheEngine, tokens: np.ndarray, cache_salt: str | None, *, counted: bool = True
    ) -> int:
        """engine.lookup(tokens), hashing in doubling slices that stop at the first one not wholly
        held: the work is bounded by the held prefix (which L1 bounds), not by the request.
        The engine's lookup counters end up as for one lookup of `tokens` (`counted`) or none."""
        chunk_size = self.config.chunk_size
        end = FIRST_LOOKUP_SLICE_CHUNKS * chunk_size
        asked = found = 0
        while True:
            piece = tokens[: min(end, len(tokens))]
            hit = engine.lookup(piece, cache_salt=cache_salt)
            asked, found = asked + len(piece), found + hit
            if hit < len(piece) - len(piece) % chunk_size or len(piece) == len(tokens):
                break
            end *= 2
        with self.store_lock:  # the engines' lock: the daemon's own, handed to every engine
            engine.counters["lookup_requested_tokens"] += (len(tokens) if counted else 0) - asked
            engine.counters["lookup_hit_tokens"] += (hit if counted else 0) - found
        return hit

    # ---- shared memory ----
    def _client_process(self, request: Request) -> ClientProcess:
        """The process the client names, checked visible: the shared path needs the same host. It
        only decides that, and ends the naming connection's leases early when it dies."""
        process = ClientProcess(request.pid, request.pid_start)
        if self.shared_pool is None:
            raise PermissionError("this daemon serves no shared memory: use store / retrieve (TCP)")
        if request.pid <= 0 or not process.alive():
            raise PermissionError(
                f"client process {request.pid} (start {request.pid_start}) is not visible to the daemon "
                "(another host or PID namespace): use store / retrieve (TCP)"
            )
        return process

    def _check_pool_access(self, owner: Owner) -> None:
        credential = self._credential(owner)
        if credential is not None and not credential.allows_every_key_space:
            # The pool holds every key space's chunks: mapping it would reach all of them.
            raise AccessError(
                f"credential {credential.name!r} is limited to some models, and the shared pool "
                "holds every model's chunks: use store / retrieve (TCP)"
            )

    def _attach(self, request: Request, owner: Owner) -> Reply:
        self._check_pool_access(owner)
        self._client_process(request)
        assert self.shared_pool is not None and self.pool_handout is not None
        segment = SharedSegment(
            handout=self.pool_handout.address,
            ticket=self.pool_handout.issue(),
            pool_bytes=self.shared_pool.pool_bytes,
            token=self.shared_pool.token,
            lease_ttl_s=self.leases.ttl_s,
        )
        return Reply(chunk_size=self.config.chunk_size, segment=segment)

    def _open_lease(self, request: Request, tokens, owner: Owner) -> Reply:
        """`lease`: reference the held prefix for the client to copy out; `reserve`: reserve space
        for the chunks not held, for the client to write. The reply names each chunk's offset."""
        self._check_pool_access(owner)
        process = self._client_process(request)
        self.leases.check_room(owner)
        assert request.space is not None
        chunk_size = self.config.chunk_size
        if request.op == "lease":
            engine = self.engine_for(request.space, create=False)
            held = self._held_tokens(engine, tokens, request.cache_salt, counted=False) if engine else 0
            chunks = engine.acquire_chunks(tokens[:held], cache_salt=request.cache_salt) if held else []
            if engine is None or not chunks:
                return Reply(hit_tokens=0, chunk_size=chunk_size)
            lease = self.leases.open_read(owner, process, engine, [entry for _, entry in chunks])
            hit = chunks[-1][0].end
        else:
            engine = self.engine_for(request.space, credential=owner.credential)
            assert engine is not None
            with collected_events(engine) as collected:
                reservation = engine.reserve_chunks(tokens, cache_salt=request.cache_salt)
            evicted = to_chunk_events(engine, collected)
            chunks, hit = reservation.chunks, reservation.held_end
            if not chunks:  # everything held already: nothing to write, nothing to commit
                return Reply(hit_tokens=hit, chunk_size=chunk_size, events=evicted)
            # Reused pool memory holds whatever chunk was there before (another model's, maybe):
            # zeroed, so a commit without writing can never publish (or a reader see) those bytes.
            for _, entry in chunks:
                self.cpu.view(entry).zero_()
            lease = self.leases.open_write(owner, process, engine, reservation, evicted)
        slots = [Slot(span.start, span.end, entry.location) for span, entry in chunks]
        return Reply(hit_tokens=hit, chunk_size=chunk_size, lease=lease.lease_id, slots=slots)

    def _end_lease(self, request: Request, owner: Owner) -> Reply:
        lease = self.leases.take(request.lease, owner)
        if lease is None or lease.expired:
            if lease is not None:
                self.leases.finish(lease)
            return Reply(
                ok=False,
                error=f"lease {request.lease.hex()} expired or unknown (leases last "
                f"{self.leases.ttl_s:g} s): what was copied under it is not valid",
            )
        if request.op == "release" or lease.kind == "read":
            self.leases.finish(lease)
            return Reply(chunk_size=self.config.chunk_size)
        reservation = lease.reservation
        assert reservation is not None
        with collected_events(lease.engine) as collected:
            lease.engine.commit_chunks(reservation)
        events = lease.events + to_chunk_events(lease.engine, collected)
        return Reply(hit_tokens=reservation.held_end, chunk_size=self.config.chunk_size, events=events)

    # ---- metrics ----
    def metric_values(self) -> dict[str, float]:
        totals = dict.fromkeys(METRIC_HELP, 0.0)
        with self._engines_lock:
            retired = dict(self._retired_counts)
        # Retired key spaces' counts stay in the totals: counters never go down.
        for engine in [None, *self.engines()]:
            stats = retired if engine is None else engine.stats()
            totals["lmcache_mp_l1_read_chunks_total"] += stats["read_chunks"]
            totals["lmcache_mp_l1_write_chunks_total"] += stats["write_chunks"]
            totals["lmcache_mp_lookup_requested_tokens_total"] += stats["lookup_requested_tokens"]
            totals["lmcache_mp_lookup_hit_tokens_total"] += stats["lookup_hit_tokens"]
            for field in REMOTE_METRIC_HELP:
                if field in stats:
                    name = _remote_metric_name(field)
                    totals[name] = totals.get(name, 0.0) + float(stats[field])
        with self.store_lock:
            totals["lmcache_mp_l1_evicted_chunks_total"] = self.cpu.evicted_chunks
            totals["lmcache_mp_l1_usage_ratio"] = self.cpu.usage_ratio
            totals["cachelayer_daemon_l1_used_bytes"] = self.cpu.allocator.allocated_bytes
        totals["cachelayer_daemon_open_leases"] = len(self.leases)
        totals["cachelayer_daemon_leases_total"] = self.leases.opened_total
        totals["cachelayer_daemon_expired_leases_total"] = self.leases.expired_total
        totals["cachelayer_daemon_reclaimed_leases_total"] = self.leases.reclaimed_total
        if self.config.remote_url is not None:
            totals["cachelayer_daemon_remote_feeds"] = len(self.feeds)
            totals["cachelayer_daemon_remote_feed_queued_events"] = self.feeds.queued_events
            totals["cachelayer_daemon_remote_feed_resets_total"] = self.feeds.resets
        return totals

    def tenant_usage(self) -> dict[str, dict[str, int]] | None:
        """The pool's bytes, chunks and cap per tenant label (configured tenants, `_shared`,
        `_other`); None without tenant quotas."""
        with self.store_lock:
            return self.cpu.tenant_usage()

    def metrics_text(self) -> str:
        lines = []
        help_by_name = (
            METRIC_HELP
            | FEED_METRIC_HELP
            | {_remote_metric_name(f): help for f, help in REMOTE_METRIC_HELP.items()}
        )
        for name, value in self.metric_values().items():
            kind, help_text = help_by_name[name]
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"]
        tenants = self.tenant_usage()
        if tenants is not None:
            # One series per configured tenant (plus _shared and _other): a bounded label set.
            for name, field, help_text in TENANT_METRICS:
                kind = "counter" if name.endswith("_total") else "gauge"
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                lines += [f'{name}{{tenant="{tenant}"}} {row[field]}' for tenant, row in tenants.items()]
        return "\n".join(lines) + "\n"


_collector = threading.local()
# By the engine itself, weakly: an id() would be reused by a later engine at the same address,
# which then never got the listener and stored without announcing anything.
_engines_with_dispatcher: weakref.WeakSet[CacheEngine] = weakref.WeakSet()
_dispatcher_lock = threading.Lock()


def _collect_into_current_thread(events: list[Event]) -> None:
    sink = getattr(_collector, "events", None)
    if sink is not None:
        sink.extend(events)


@contextlib.contextmanager
def collected_events(engine: CacheEngine) -> Iterator[list[Event]]:
    """The events `engine` announces in this thread inside the block.

    The engine announces changes synchronously, in the thread that makes them; one listener per
    engine hands them to whichever thread is collecting, so concurrent stores never mix events.
    """
    with _dispatcher_lock:
        if engine not in _engines_with_dispatcher:
            engine.add_event_listener(_collect_into_current_thread)
            _engines_with_dispatcher.add(engine)
    collected: list[Event] = []
    _collector.events = collected
    try:
        yield collected
    finally:
        _collector.events = None


def to_chunk_events(engine: CacheEngine, events: list[Event]) -> list[ChunkEvent]:
    """The L1 chunks stored and removed, as the daemon reports them to the client that caused them."""
    chunk_events: list[ChunkEvent] = []
    for event in events:
        if isinstance(event, BlockStored) and event.medium == engine.cpu.medium:
            chunk_events.append(
                ChunkEvent("stored", event.block_hashes[0], event.parent_block_hash, event.token_ids)
            )
        elif isinstance(event, BlockRemoved) and event.medium == engine.cpu.medium:
            chunk_events.extend(ChunkEvent("removed", key) for key in event.block_hashes)
    return chunk_events


def store_with_events(
    engine: CacheEngine, tokens, kv, cache_salt: str | None
) -> tuple[int, list[ChunkEvent]]:
    """engine.store, returning the chunks it added to or evicted from the CPU tier on the way."""
    with collected_events(engine) as collected:
        held = engine.store(tokens, kv, cache_salt=cache_salt)
    return held, to_chunk_events(engine, collected)


# Seconds an HTTP connection may sit without sending (a request line, a header, the next request):
# an idle or trickling client is disconnected instead of holding its thread.
HTTP_IDLE_TIMEOUT_S = 10.0


class _HTTPHandler(BaseHTTPRequestHandler):
    server_version = "cachelayer"
    store_server: StoreServer
    # socketserver applies it to the connection: each read waits at most this long.
    timeout = HTTP_IDLE_TIMEOUT_S

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthcheck":
            self._send(200, "application/json", b'{"status": "healthy"}')
        elif path == "/metrics":
            self._send(200, "text/plain; version=0.0.4", self.store_server.metrics_text().encode())
        else:
            self._send(404, "application/json", lmcache_error_body("not found: try /healthcheck or /metrics"))

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("http: " + format, *args)


def start_http(
    store_server: StoreServer, host: str, port: int, *, idle_timeout_s: float = HTTP_IDLE_TIMEOUT_S
) -> ThreadingHTTPServer:
    """GET /healthcheck and /metrics on host:port, in threads; connections idle for
    `idle_timeout_s` are closed."""
    handler = type("Handler", (_HTTPHandler,), {"store_server": store_server, "timeout": idle_timeout_s})
    http = ThreadingHTTPServer((host, port), handler)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, name="cachelayer-http", daemon=True).start()
    return http
