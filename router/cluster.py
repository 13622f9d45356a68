"""Replica sync: gateways in front of the same engines share what the engines' KV events cannot
tell them, over Redis pub/sub (the `cluster:` section of proxy.yaml).

Every replica indexes the engines' KV events itself (a ZMQ PUB reaches every subscriber). What only
the gateways know travels here, as soft state:
- loads: each replica's own in-flight requests and prompt tokens still to prefill, per backend, as
  absolute numbers in every message (so a lost message is corrected by the next one, and nothing
  drifts); a peer's numbers are added to BackendState.in_flight / in_flight_prefill_tokens, where
  the policies read them;
- routing notes: for each request routed, the backend, its prefill tokens, kv_aware's prefix keys
  with the time they count as predicted, its hot-prefix key, whether it was a cold placement and its
  session key; the peers' policies apply them as if they had routed it (`on_peer_routed`).
A replica publishes its notes in batches (at most one message per flush_interval_s) and its loads
at least every heartbeat_s. A peer silent for peer_timeout_s is forgotten: its loads stop counting,
so a killed replica's in-flight requests vanish from the others. A replica that cannot reach Redis
routes on its own view (its peers expire) and rejoins by itself when Redis answers again; requests
never wait for the sync: publishing and listening run in their own tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

import msgspec
from prometheus_client import Counter, Gauge

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.config import Cluster
    from router.policies.base import Policy, RouteRequest

log = logging.getLogger("kvgate.cluster")

# Bounds on what a message may carry: a peer's bug (or a stranger on the channel) costs a refused
# message, never unbounded work on the event loop.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_NOTES_PER_MESSAGE = 4096
MAX_PREFIX_KEYS = 65_536
MAX_PEERS = 1024
# Messages handled before the listener yields to the requests.
_MESSAGES_PER_TURN = 32

_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
_Name = Annotated[str, msgspec.Meta(max_length=256)]


class BackendLoad(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One replica's own requests in flight at one backend, and their prompt tokens still to prefill."""

    backend: _Name
    in_flight: _Count
    prefill_tokens: _Count


class RoutedNote(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One request a replica routed, as its peers' policies need it."""

    backend: _Name
    prefill_tokens: _Count = 0
    # kv_aware's router keys of the prompt (router/index/keys.py prompt_prefix_keys) past those the
    # backend's KV events already showed (RouteDecision.predicted_keys), credited to the backend as
    # predicted for ttl_s seconds.
    prefix_keys: Annotated[list[int], msgspec.Meta(max_length=MAX_PREFIX_KEYS)] = []
    ttl_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.0
    hot_prefix_key: int | None = None
    cold: bool = False
    session: Annotated[str, msgspec.Meta(max_length=4096)] | None = None


class SyncMessage(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    replica: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    # The sender's whole load: a backend it does not list has none of its requests.
    loads: Annotated[list[BackendLoad], msgspec.Meta(max_length=65_536)]
    routed: Annotated[list[RoutedNote], msgspec.Meta(max_length=MAX_NOTES_PER_MESSAGE)] = []
    # Sent once by a replica shutting down cleanly: forget it now, not after peer_timeout_s.
    leaving: bool = False


@dataclass(slots=True)
class _Peer:
    last_seen: float
    loads: dict[str, tuple[int, int]] = field(default_factory=dict)


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class ClusterSync:
    """This replica's side of the sync: publishes its notes and loads, applies its peers'."""

    def __init__(
        self,
        config: Cluster,
        backends: Mapping[str, BackendState],
        policy: Policy,
        registry: Any = None,
    ) -> None:
        self.config = config
        self.replica_id = config.replica_id or default_replica_id()
        # The URL as logs show it: a password in it (redis://user:secret@host) stays out of them.
        parts = urlsplit(config.url)
        self.where = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        self.backends = backends
        self.policy = policy
        self._peers: dict[str, _Peer] = {}
        self._pending: deque[RoutedNote] = deque(maxlen=config.max_pending_notes)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._publisher: Any = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(SyncMessage)
        self.publishing = False
        self.listening = False
        # When this replica's own last message came back through Redis: the subscription is alive.
        self._last_echo = 0.0
        self.messages = Counter(
            "kvgate_cluster_messages",
            "Replica-sync messages: sent, received from peers, refused (invalid), failed to send",
            ["kind"],
            registry=registry,
        )
        self.dropped_notes = Counter(
            "kvgate_cluster_dropped_notes",
            "Routing notes not published (the sync was away or behind); their peers route without them",
            registry=registry,
        )
        self._peers_gauge = Gauge(
            "kvgate_cluster_peers", "Peer replicas heard from within peer_timeout_s", registry=registry
        )
        self._peers_gauge.set_function(lambda: len(self._peers))
        self._connected_gauge = Gauge(
            "kvgate_cluster_connected",
            "1 while this replica both publishes to and hears from the sync transport",
            registry=registry,
        )
        self._connected_gauge.set_function(lambda: 1.0 if self.connected else 0.0)
        Gauge(
            "kvgate_cluster_replica", "This replica's id and process", ["replica", "pid"], registry=registry
        ).labels(self.replica_id, str(os.getpid())).set(1)
        self._counters = {
            kind: self.messages.labels(kind) for kind in ("sent", "received", "invalid", "failed")
        }

    @property
    def connected(self) -> bool:
        return self.publishing and self.listening

    @property
    def peers(self) -> list[str]:
        return sorted(self._peers)

    # ---- the request path (no I/O: a note queued and a flag set) ----

    def routed(self, request: RouteRequest, backend: BackendState, prefill_tokens: int) -> None:
        """Queue the note of a request just routed (before the policy's on_routed consumes its decision)."""
        decision = request.decision
        keys = decision.predicted_keys(backend.name)
        if len(keys) > MAX_PREFIX_KEYS:
            keys = keys[:MAX_PREFIX_KEYS]
        ttl_s = getattr(getattr(self.policy, "predictions", None), "ttl_s", 0.0) if keys else 0.0
        if len(self._pending) == self._pending.maxlen:
            self.dropped_notes.inc()
        self._pending.append(
            RoutedNote(
                backend=backend.name,
                prefill_tokens=max(0, prefill_tokens),
                prefix_keys=keys,
                ttl_s=ttl_s,
                hot_prefix_key=decision.hot_prefix_key,
                cold=decision.reason == "cold_spread",
                session=request.session_key,
            )
        )
        self._wake.set()

    def loads_changed(self) -> None:
        """A request finished or its prefill ended: publish the new loads with the next batch."""
        self._wake.set()

    # ---- lifecycle ----

    async def start(self) -> None:
        import redis.asyncio as redis

        # Publishing may wait at most socket_timeout; the subscription waits for messages as long as
        # needed (its liveness is its own heartbeat coming back, see _listen).
        timeout_s = max(0.5, min(self.config.heartbeat_s, 2.0))
        self._publisher = redis.Redis.from_url(
            self.config.url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="kvgate-cluster-publish"),
            asyncio.create_task(self._listen_loop(redis), name="kvgate-cluster-listen"),
        ]
        log.info("replica %s syncs on %s channel %s", self.replica_id, self.where, self.config.channel)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._publisher is not None:
            if self.publishing:
                # Peers forget this replica at once instead of counting its requests for peer_timeout_s.
                goodbye = SyncMessage(replica=self.replica_id, loads=[], leaving=True)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(
                        self._publisher.publish(self.config.channel, self._encoder.encode(goodbye)), 1.0
                    )
            with contextlib.suppress(Exception):
                await self._publisher.aclose()
            self._publisher = None
        for peer in list(self._peers):
            self._forget(peer)

    # ---- publishing ----

    async def _publish_loop(self) -> None:
        config = self.config
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), config.heartbeat_s)
            self._wake.clear()
            self.expire_peers(time.monotonic())
            notes = [self._pending.popleft() for _ in range(min(len(self._pending), MAX_NOTES_PER_MESSAGE))]
            if self._pending:
                self._wake.set()
            message = SyncMessage(replica=self.replica_id, loads=self._local_loads(), routed=notes)
            try:
                await self._publisher.publish(config.channel, self._encoder.encode(message))
            except Exception as exc:  # any transport failure: route on the local view
                self._counters["failed"].inc()
                self.dropped_notes.inc(len(notes) + len(self._pending))
                # Notes are worth their TTL: those queued while Redis is away are stale when it returns.
                self._pending.clear()
                if self.publishing:
                    log.warning(
                        "replica sync: cannot publish to %s (%s); routing on the local view", self.where, exc
                    )
                self.publishing = False
                await asyncio.sleep(config.heartbeat_s)
                continue
            self._counters["sent"].inc()
            if not self.publishing:
                log.info("replica sync: publishing to %s", self.where)
            self.publishing = True
            if config.flush_interval_s:
                await asyncio.sleep(config.flush_interval_s)

    def _local_loads(self) -> list[BackendLoad]:
        loads = []
        for backend in self.backends.values():
            in_flight = backend.in_flight - backend.peer_in_flight
            prefill_tokens = backend.in_flight_prefill_tokens - backend.peer_in_flight_prefill_tokens
            if in_flight > 0 or prefill_tokens > 0:
                loads.append(BackendLoad(backend.name, max(0, in_flight), max(0, prefill_tokens)))
        return loads

    # ---- listening ----

    async def _listen_loop(self, redis: Any) -> None:
        config = self.config
        while True:
            client = redis.Redis.from_url(
                config.url, socket_connect_timeout=max(0.5, min(config.heartbeat_s, 2.0))
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(config.channel)
                self._last_echo = time.monotonic()
                await self._listen(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any transport failure: retry after a heartbeat
                if self.listening:
                    log.warning("replica sync: lost the subscription on %s (%s); retrying", self.where, exc)
            finally:
                self.listening = False
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(config.heartbeat_s)

    async def _listen(self, pubsub: Any) -> None:
        handled = 0
        while True:
            message = await pubsub.get_message(timeout=self.config.heartbeat_s)
            now = time.monotonic()
            if message is not None and message.get("type") == "message":
                self.receive(message["data"], now)
                handled += 1
                if handled % _MESSAGES_PER_TURN == 0:
                    await asyncio.sleep(0)
            if self.publishing and now - self._last_echo > self.config.peer_timeout_s:
                # Our own heartbeats stopped coming back: the subscription is dead though no error said so.
                raise ConnectionError(f"no message on the channel for {self.config.peer_timeout_s:g} s")
            if not self.listening and now - self._last_echo < self.config.peer_timeout_s:
                self.listening = True
                log.info("replica sync: listening on %s", self.where)

    def receive(self, data: bytes, now: float) -> None:
        """Apply one message from the channel (checked: a bad one is counted and ignored)."""
        if not isinstance(data, bytes) or len(data) > MAX_MESSAGE_BYTES:
            self._counters["invalid"].inc()
            return
        try:
            message = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._counters["invalid"].inc()
            return
        if message.replica == self.replica_id:
            self._last_echo = now
            return
        self._counters["received"].inc()
        peer = self._peers.get(message.replica)
        if message.leaving:
            if peer is not None:
                self._forget(message.replica)
            return
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self._counters["invalid"].inc()
                return
            peer = self._peers[message.replica] = _Peer(now)
            log.info("replica sync: peer %s joined", message.replica)
        peer.last_seen = now
        self._apply_loads(
            peer, {load.backend: (load.in_flight, load.prefill_tokens) for load in message.loads}
        )
        on_peer_routed = self.policy.on_peer_routed
        for note in message.routed:
            if note.backend in self.backends:
                on_peer_routed(note)

    def _apply_loads(self, peer: _Peer, loads: dict[str, tuple[int, int]]) -> None:
        known = {name: value for name, value in loads.items() if name in self.backends}
        for name in peer.loads.keys() | known.keys():
            old_requests, old_tokens = peer.loads.get(name, (0, 0))
            requests, tokens = known.get(name, (0, 0))
            backend = self.backends.get(name)
            if backend is None or (requests == old_requests and tokens == old_tokens):
                continue
            backend.in_flight += requests - old_requests
            backend.peer_in_flight += requests - old_requests
            backend.in_flight_prefill_tokens += tokens - old_tokens
            backend.peer_in_flight_prefill_tokens += tokens - old_tokens
        peer.loads = known

    def expire_peers(self, now: float) -> None:
        for name, peer in list(self._peers.items()):
            if now - peer.last_seen > self.config.peer_timeout_s:
                log.warning(
                    "replica sync: peer %s silent for %.1f s; its load no longer counts",
                    name,
                    now - peer.last_seen,
                )
                self._forget(name)

    def _forget(self, name: str) -> None:
        peer = self._peers.pop(name)
        self._apply_loads(peer, {})

    # ---- BackendListener (router/backends.py) ----

    def backend_added(self, backend: BackendState) -> None:
        pass  # a peer's load on it counts from the peer's next message

    def backend_removed(self, backend: BackendState) -> None:
        """A backend left the registry: the peers' loads on it no longer apply to anything."""
        for peer in self._peers.values():
            peer.loads.pop(backend.name, None)
