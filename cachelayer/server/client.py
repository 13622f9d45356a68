"""Client of the cache daemon's data plane: lookup, store and retrieve over a ZMQ DEALER socket.

One request at a time per client, each with a timeout: a daemon that does not answer makes the
call raise `StoreUnavailable` (the connector then treats it as a miss), and the socket is rebuilt
so a late reply can never be taken for the answer to the next request.

Transport: with `transport="auto"` (the default) the client asks the daemon for its shared pool
once and, when it can map it (same host, same user: cachelayer.server.shared_pool), copies KV
in and out of the pool itself under leases; the socket then carries keys, offsets and lease ids
only. Otherwise KV travels in the messages (TCP). The copies run outside the request lock, so
several threads may share one client.

Authentication: with `secret` (the daemon's --auth-secret-env value) the client presents it in
each connection's handshake (cachelayer.server.access); a daemon that refuses the handshake, or a
client and daemon that disagree on having a secret, is reported as `StoreRefused` saying so, not
as a silent timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from cachelayer.engine import copy_tensor
from cachelayer.errors import CacheLayerError
from cachelayer.server import protocol
from cachelayer.server.access import PLAIN_USERNAME
from cachelayer.server.leases import process_start_time
from cachelayer.server.protocol import ChunkEvent, FeedEvent, KeySpace, Reply, Request, Slot
from cachelayer.server.shared_pool import SharedPool, SharedPoolUnavailable

log = logging.getLogger(__name__)

Transport = Literal["auto", "shm", "tcp"]
# Requests that carry this client's remote-tier feed (the daemon's FEED_OPERATIONS).
FEED_OPERATIONS = frozenset({"store", "reserve", "commit", "feed"})
# Remote-tier events this client holds before the connector takes them; past it they are replaced
# by one "cleared" (the connector then forgets its REMOTE announcements: a miss, never a false hit).
MAX_BUFFERED_FEED_EVENTS = 65536


@dataclass(slots=True)
class LeasedChunk:
    """Tokens [start, end) of a request: `kv` [num_layers, 2, end - start, channels] views the pool."""

    start: int
    end: int
    kv: torch.Tensor


@dataclass(slots=True)
class Lease:
    hit_tokens: int
    chunks: list[LeasedChunk]


@dataclass(slots=True)
class Reservation:
    held_tokens: int
    events: list[ChunkEvent]
    chunks: list[LeasedChunk]


class StoreUnavailable(CacheLayerError, RuntimeError):
    """The daemon did not answer in time, or answered with an error."""


class StoreRefused(StoreUnavailable):
    """The daemon answered with an error (it is up, but would not do what was asked)."""


class LeaseExpired(StoreRefused):
    """The daemon ended a lease before the client released it: data read under it is void."""


@contextlib.contextmanager
def _copies_done_on_exit(gpu_side: torch.Tensor) -> Iterator[None]:
    """Wait for the copies queued on `gpu_side`'s device (`copy_tensor(..., non_blocking=True)`:
    between the GPU and a page-locked pool, one DMA each) before a lease or reservation ends: the
    daemon may reuse the chunks as soon as it does."""
    try:
        yield
    finally:
        if gpu_side.device.type == "cuda":
            torch.cuda.current_stream(gpu_side.device).synchronize()


class StoreClient:
    def __init__(
        self,
        endpoint: str,
        *,
        chunk_size: int,
        timeout_s: float = 5.0,
        context: zmq.Context | None = None,
        transport: Transport = "auto",
        register_with_cuda: bool = False,
        secret: bytes | None = None,
        remote_feed: bool = False,
        feed_poll_s: float = 0.25,
    ) -> None:
        """`remote_feed`: ask the daemon which chunks of this client's stores it wrote through to
        its remote tier, and which of those the tier lost since (cachelayer.server.remote_feed):
        `take_remote_feed` answers them, in order; a thread asks the daemon every `feed_poll_s`
        when no store did meanwhile (0: only stores ask). `register_with_cuda`: page-lock the
        daemon's shared pool for CUDA in this process once it is mapped (an engine whose KV lives
        on a GPU), so chunks move between the pool and the GPU in one DMA copy; see
        `SharedPool.register_with_cuda`. `secret`: the daemon's shared secret (read it with
        cachelayer.controller.auth.secret_from_env), None for a daemon without one."""
        if transport not in ("auto", "shm", "tcp"):
            raise ValueError(f"transport must be 'auto', 'shm' or 'tcp', got {transport!r}")
        self.endpoint = endpoint
        self.chunk_size = chunk_size
        self.timeout_ms = int(timeout_s * 1000)
        self._context = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._transport_lock = threading.Lock()
        self._socket: zmq.Socket | None = None
        self._requested_transport = transport
        self._shared: SharedPool | None = None
        self._transport_chosen = transport == "tcp"
        self._register_with_cuda = register_with_cuda
        self._secret = secret
        self._monitor: zmq.Socket | None = None
        self._pid = os.getpid()
        self._pid_start = process_start_time(self._pid) or 0
        # The daemon's boot id as last seen, and restarts seen since `take_restarts` last asked.
        self._boot_id = b""
        self._restarts = 0
        # The remote-tier feed: its random id, the last event number received, what is buffered.
        self._feed_id = os.urandom(16) if remote_feed else b""
        self._feed_ack = 0
        self._feed: list[FeedEvent] = []
        self._feed_asked = 0.0
        self._feed_stop = threading.Event()
        self._feed_thread: threading.Thread | None = None
        if remote_feed and feed_poll_s > 0:
            self._feed_thread = threading.Thread(
                target=self._poll_feed_loop, args=(feed_poll_s,), name="cachelayer-feed", daemon=True
            )
            self._feed_thread.start()

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            if self._secret is not None:
                socket.plain_username = PLAIN_USERNAME
                socket.plain_password = self._secret
            # Handshake failures only show on a monitor: they explain a daemon that never answers.
            self._monitor = socket.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            )
            socket.connect(self.endpoint)
            self._socket = socket
        return self._socket

    def _drop_socket(self) -> None:
        if self._socket is not None:
            self._socket.disable_monitor()
            self._socket.close(linger=0)
            self._socket = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    def _handshake_failure(self) -> str | None:
        """Why the daemon refused this client's connection, if its monitor says it did."""
        mismatch = (
            "this client and the daemon disagree on authentication (one has a secret, the "
            "other none): set server_auth_secret_env here and --auth-secret-env there alike"
        )
        ended_handshakes = False
        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return (
                    "the daemon refused this client's secret: set server_auth_secret_env to a variable "
                    "holding the daemon's --auth-secret-env value"
                )
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                return mismatch
            # A daemon that wants a secret from a client that offers none closes the connection
            # mid-handshake; which side notices the mismatch first varies from one try to the next.
            ended_handshakes = ended_handshakes or event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        return f"it ended every handshake: most likely {mismatch}" if ended_handshakes else None

    def close(self) -> None:
        self._feed_stop.set()
        if self._feed_thread is not None and self._feed_thread is not threading.current_thread():
            self._feed_thread.join(timeout=self.timeout_ms / 1000 + 1)
        with self._lock:
            self._drop_socket()
            if self._shared is not None:
                self._shared.close()
                self._shared = None
            self._transport_chosen = self._requested_transport == "tcp"

    @property
    def transport(self) -> Literal["shm", "tcp"]:
        """The path this client's KV takes (decided on first use, by asking the daemon)."""
        return "shm" if self._shared_pool() is not None else "tcp"

    @property
    def pool_registered_with_cuda(self) -> bool:
        """Whether the daemon's pool is page-locked for CUDA in this process (shm path only)."""
        shared = self._shared_pool()
        return shared is not None and shared.cuda_registered

    def _shared_pool(self) -> SharedPool | None:
        """The daemon's mapped pool, or None for the TCP path. A daemon that does not answer
        decides nothing (StoreUnavailable): the choice is made on the first answer."""
        with self._transport_lock:
            if self._transport_chosen:
                return self._shared
            try:
                reply, _ = self._call(Request(op="attach", pid=self._pid, pid_start=self._pid_start))
                if reply.segment is None:
                    raise SharedPoolUnavailable("the daemon answered attach without a segment")
                segment = reply.segment
                self._shared = SharedPool.attach(
                    segment.handout, segment.ticket, segment.pool_bytes, segment.token
                )
                if self._register_with_cuda:
                    self._shared.register_with_cuda()
            except (StoreRefused, SharedPoolUnavailable) as exc:
                if self._requested_transport == "shm":
                    raise StoreUnavailable(
                        f"no shared memory with the daemon at {self.endpoint}: {exc}"
                    ) from exc
                log.info(
                    "cachelayer: KV to %s goes over the socket (no shared memory: %s)", self.endpoint, exc
                )
            self._transport_chosen = True
            return self._shared

    def _call(self, request: Request, payload: memoryview | None = None) -> tuple[Reply, zmq.Frame | None]:
        request.chunk_size = self.chunk_size
        with self._lock:
            if self._feed_id and request.op in FEED_OPERATIONS:
                request.feed, request.feed_ack = self._feed_id, self._feed_ack
                self._feed_asked = time.monotonic()
            frames: list = [b"", protocol.encode(request)]
            if payload is not None:
                frames.append(payload)
            socket = self._connect()
            socket.send_multipart(frames, copy=False)
            if not socket.poll(self.timeout_ms, zmq.POLLIN):
                refusal = self._handshake_failure()
                self._drop_socket()
                if refusal is not None:
                    raise StoreRefused(f"cache daemon at {self.endpoint} refused {request.op}: {refusal}")
                raise StoreUnavailable(
                    f"cache daemon at {self.endpoint} did not answer {request.op} within "
                    f"{self.timeout_ms} ms: is `cachelayer server` running there?"
                )
            reply_frames = socket.recv_multipart(copy=False)
        # [b"", header(, payload)]
        reply = protocol.decode_reply(reply_frames[1].buffer)
        self._note_boot(reply.boot_id)
        if reply.feed_events:
            self._note_feed(reply)
        if not reply.ok:
            raise StoreRefused(f"cache daemon at {self.endpoint} refused {request.op}: {reply.error}")
        return reply, reply_frames[2] if len(reply_frames) > 2 else None

    def _note_boot(self, boot_id: bytes) -> None:
        with self._lock:
            if boot_id and boot_id != self._boot_id:
                if self._boot_id:
                    self._restarts += 1
                    log.warning("cache daemon at %s restarted: its store is empty", self.endpoint)
                    if self._feed_id:  # what it told of its remote tier, nobody can retract now
                        self._buffer_feed([FeedEvent("cleared")])
                        self._feed_ack = 0
                self._boot_id = boot_id

    def _note_feed(self, reply: Reply) -> None:
        """Buffer the events of a reply this client has not received yet (a lost reply's are
        resent, and two threads' replies may arrive in either order: numbers decide)."""
        with self._lock:
            if not self._feed_id or reply.boot_id != self._boot_id:
                return
            first = reply.feed_seq - len(reply.feed_events) + 1
            fresh = [event for seq, event in enumerate(reply.feed_events, first) if seq > self._feed_ack]
            if fresh:
                self._buffer_feed(fresh)
                self._feed_ack = reply.feed_seq

    def _buffer_feed(self, events: list[FeedEvent]) -> None:
        self._feed.extend(events)
        if len(self._feed) > MAX_BUFFERED_FEED_EVENTS:
            self._feed = [FeedEvent("cleared")]

    def take_remote_feed(self) -> list[FeedEvent]:
        """The remote-tier events received since the last call, in order: chunks written through
        for this client's stores ("stored"), announced chunks the tier lost ("removed"), and
        "cleared" where everything announced before is void (a restarted daemon, an overflow)."""
        with self._lock:
            events, self._feed = self._feed, []
            return events

    def poll_feed(self) -> None:
        """Ask the daemon for this client's remote-tier events (StoreUnavailable when it does not
        answer)."""
        self._call(Request(op="feed"))

    def _poll_feed_loop(self, interval_s: float) -> None:
        wait_s = interval_s
        while not self._feed_stop.wait(wait_s):
            # At most `interval_s` since the last request that asked (a store's, or this thread's).
            wait_s = self._feed_asked + interval_s - time.monotonic()
            if wait_s > 0:
                continue
            wait_s = interval_s
            try:
                self.poll_feed()
            except StoreUnavailable as exc:
                log.debug("cachelayer: remote feed: %s", exc)

    def take_restarts(self) -> int:
        """How many times the daemon was seen restarting since the last call (its store then
        starts empty: what this client announced of it is gone)."""
        with self._lock:
            restarts, self._restarts = self._restarts, 0
            return restarts

    def hello(self) -> int:
        """The daemon's chunk size (raises StoreUnavailable when it does not answer)."""
        reply, _ = self._call(Request(op="hello"))
        return reply.chunk_size

    def lookup(
        self, space: KeySpace, tokens: list[int] | np.ndarray, *, cache_salt: str | None = None
    ) -> int:
        request = Request(
            op="lookup", space=space, tokens=protocol.tokens_to_bytes(tokens), cache_salt=cache_salt
        )
        return self._call(request)[0].hit_tokens

    def store(
        self,
        space: KeySpace,
        tokens: list[int] | np.ndarray,
        kv: torch.Tensor,
        *,
        cache_salt: str | None = None,
    ) -> tuple[int, list[ChunkEvent]]:
        """Store the chunks of tokens; returns (leading tokens now held, chunks stored/evicted).
        `kv` may live on a GPU: with the pool registered for CUDA it is copied straight into it."""
        shared = self._shared_pool()
        if shared is None:
            request = Request(
                op="store", space=space, tokens=protocol.tokens_to_bytes(tokens), cache_salt=cache_salt
            )
            reply, _ = self._call(request, protocol.kv_to_bytes(kv))
            return reply.hit_tokens, reply.events
        try:
            protocol.check_kv_size(kv.numel() * kv.element_size(), space, len(tokens))
            if kv.dtype != protocol.torch_dtype(space.dtype):
                raise ValueError(f"KV is {kv.dtype}, the key space says {space.dtype}")
        except ValueError as exc:
            raise StoreRefused(f"cache daemon at {self.endpoint} refused store: {exc}") from exc
        kv = kv.detach()
        if kv.device.type != "cpu" and not shared.cuda_registered:
            kv = kv.to("cpu")  # the pool is not page-locked: stage through host memory
        kv = kv.view(space.num_layers, 2, len(tokens), -1)
        with self.reserved(space, tokens, cache_salt=cache_salt) as reservation, _copies_done_on_exit(kv):
            for chunk in reservation.chunks:
                copy_tensor(chunk.kv, kv[:, :, chunk.start : chunk.end], non_blocking=True)
        return reservation.held_tokens, reservation.events

    def retrieve(
        self,
        space: KeySpace,
        tokens: list[int] | np.ndarray,
        *,
        cache_salt: str | None = None,
        out: torch.Tensor | None = None,
    ) -> tuple[int, torch.Tensor | None]:
        """(hit_tokens, kv [num_layers, 2, hit_tokens, channels] or None) for the longest held prefix.

        With `out` ([num_layers, 2, >= len(tokens), channels] on the CPU) the KV lands in
        out[:, :, :hit_tokens] and that view is returned."""
        if self._shared_pool() is None:
            request = Request(
                op="retrieve", space=space, tokens=protocol.tokens_to_bytes(tokens), cache_salt=cache_salt
            )
            reply, payload = self._call(request)
            if reply.hit_tokens == 0 or payload is None:
                return 0, None
            kv = protocol.kv_from_bytes(payload.buffer, space, reply.hit_tokens)
            if out is None:
                return reply.hit_tokens, kv
            copy_tensor(out[:, :, : reply.hit_tokens], kv)
            return reply.hit_tokens, out[:, :, : reply.hit_tokens]
        try:
            with self.leased(space, tokens, cache_salt=cache_salt) as lease:
                if lease.hit_tokens == 0:
                    return 0, None
                if out is None:
                    channels = space.num_kv_heads * space.head_dim
                    dtype = protocol.torch_dtype(space.dtype)
                    out = torch.empty(space.num_layers, 2, lease.hit_tokens, channels, dtype=dtype)
                with _copies_done_on_exit(out):
                    for chunk in lease.chunks:
                        copy_tensor(out[:, :, chunk.start : chunk.end], chunk.kv, non_blocking=True)
        except LeaseExpired as exc:
            log.warning("cachelayer: retrieve treated as a miss: %s", exc)
            return 0, None
        return lease.hit_tokens, out[:, :, : lease.hit_tokens]

    @contextlib.contextmanager
    def reserved(
        self, space: KeySpace, tokens: list[int] | np.ndarray, *, cache_salt: str | None = None
    ) -> Iterator[Reservation]:
        """Space in the daemon's shared pool for the chunks of `tokens` it does not hold: write each
        `chunk.kv` (a view of the pool) inside the block; they are committed when it ends, or given
        back if it raises. After the block, `held_tokens` and `events` say what the store did.
        StoreRefused if the lease expired first (nothing was stored)."""
        shared = self._require_shared_pool()
        reply, _ = self._call(self._lease_request("reserve", space, tokens, cache_salt))
        reservation = Reservation(
            held_tokens=reply.hit_tokens,
            events=list(reply.events),
            chunks=[self._leased_chunk(shared, space, slot) for slot in reply.slots],
        )
        if not reply.slots:
            yield reservation
            return
        with self._released_on_error(reply.lease):
            yield reservation
        committed, _ = self._call(self._lease_request("commit", lease=reply.lease))
        reservation.held_tokens = committed.hit_tokens
        reservation.events += committed.events

    @contextlib.contextmanager
    def leased(
        self, space: KeySpace, tokens: list[int] | np.ndarray, *, cache_salt: str | None = None
    ) -> Iterator[Lease]:
        """The longest held prefix of `tokens`, as views of the daemon's shared pool that stay valid
        inside the block (the daemon neither evicts nor reuses them). LeaseExpired at the end when
        the daemon ended the lease first: what was read from the views must then be discarded."""
        shared = self._require_shared_pool()
        reply, _ = self._call(self._lease_request("lease", space, tokens, cache_salt))
        lease = Lease(
            hit_tokens=reply.hit_tokens if reply.slots else 0,
            chunks=[self._leased_chunk(shared, space, slot) for slot in reply.slots],
        )
        if not reply.slots:
            yield lease
            return
        with self._released_on_error(reply.lease):
            yield lease
        if not self._end_lease("release", reply.lease):
            raise LeaseExpired(
                f"the daemon at {self.endpoint} ended lease {reply.lease.hex()} before it was released"
            )

    # ---- shared-memory helpers ----
    def _lease_request(
        self,
        op: protocol.Operation,
        space: KeySpace | None = None,
        tokens: list[int] | np.ndarray = (),
        cache_salt: str | None = None,
        *,
        lease: bytes = b"",
    ) -> Request:
        return Request(
            op=op,
            space=space,
            tokens=protocol.tokens_to_bytes(tokens) if len(tokens) else b"",
            cache_salt=cache_salt,
            pid=self._pid,
            pid_start=self._pid_start,
            lease=lease,
        )

    @contextlib.contextmanager
    def _released_on_error(self, lease: bytes) -> Iterator[None]:
        """Run the block that uses `lease`; when it raises, the lease is released before the error
        goes on (a write lease's chunks are then given back, never committed)."""
        try:
            yield
        except BaseException:
            self._end_lease("release", lease)
            raise

    def _end_lease(self, op: protocol.Operation, lease: bytes) -> bool:
        """Release a lease; False (logged) when the daemon had ended it already."""
        try:
            self._call(self._lease_request(op, lease=lease))
        except StoreUnavailable as exc:
            log.debug("cachelayer: %s", exc)
            return False
        return True

    def _require_shared_pool(self) -> SharedPool:
        shared = self._shared_pool()
        if shared is None:
            raise StoreUnavailable(f"the daemon at {self.endpoint} shares no memory with this process")
        return shared

    @staticmethod
    def _leased_chunk(shared: SharedPool, space: KeySpace, slot: Slot) -> LeasedChunk:
        """The pool's bytes of one chunk as KV [num_layers, 2, tokens, channels] (a view)."""
        num_tokens = slot.end - slot.start
        nbytes = protocol.kv_nbytes(space, num_tokens)
        if slot.offset < 0 or slot.offset + nbytes > shared.pool_bytes or num_tokens <= 0:
            raise StoreUnavailable(
                f"the daemon named bytes {slot.offset}..{slot.offset + nbytes} of its "
                f"{shared.pool_bytes}-byte pool for tokens {slot.start}..{slot.end}: out of range"
            )
        flat = shared.pool[slot.offset : slot.offset + nbytes].view(protocol.torch_dtype(space.dtype))
        kv = flat.view(space.num_layers, 2, num_tokens, space.num_kv_heads * space.head_dim)
        return LeasedChunk(slot.start, slot.end, kv)
