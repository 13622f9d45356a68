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

With a shared secret (`auth_secret_env`) every message travels in an envelope: magic `KVC1`, an
HMAC-SHA256 over the channel, a sequence number (the sender's clock in ns, strictly increasing) and
the message. A message without a valid envelope, one whose sequence is more than MAX_CLOCK_SKEW_S
from the receiver's clock, or not past the last one from its replica (a replay), is refused. Each
message is at most `max_message_bytes` on both sides: a sender splits its notes to stay below it, a
receiver refuses a larger one before decoding it. Refusals are counted by kind and logged at most
once per REFUSAL_LOG_INTERVAL_S, with their counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

import msgspec
from prometheus_client import Counter, Gauge

from router.policies.session import session_table_key

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.config import Cluster
    from router.policies.base import Choice, Policy, RouteRequest

log = logging.getLogger("kvgate.cluster")

# Bounds on what a message may carry: a peer's bug (or a stranger on the channel) costs a refused
# message, never unbounded work on the event loop.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_NOTES_PER_MESSAGE = 4096
MAX_PREFIX_KEYS = 65_536
MAX_PEERS = 1024
# A signed message: magic, HMAC-SHA256, sequence (ns), then the msgpack message.
ENVELOPE_MAGIC = b"KVC1"
_ENVELOPE = struct.Struct("<4s32sQ")
# A signed message stamped further than this from the receiver's clock is refused (keep the
# replicas' hosts on NTP); within it, a message not past its replica's last sequence is a replay.
MAX_CLOCK_SKEW_S = 30.0
# At most one log line per this interval about refused messages (a flood logs a count, not a flood).
REFUSAL_LOG_INTERVAL_S = 10.0
# Room in a message for everything but its notes (loads, replica id, envelope).
_MESSAGE_SLACK_BYTES = 2048
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
    # backend's KV events already showed (the policy's for_peers), credited to the backend as
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
    last_sequence: int = 0


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
        self._secret = config.secret()
        self._channel = config.channel.encode()
        self._sequence = 0
        self._refusals_logged_at = -REFUSAL_LOG_INTERVAL_S
        self._refusals_unlogged: dict[str, int] = {}
        self.publishing = False
        self.listening = False
        # When this replica's own last message came back through Redis: the subscription is alive.
        self._last_echo = 0.0
        self.messages = Counter(
            "kvgate_cluster_messages",
            "Replica-sync messages: sent, received from peers, refused (invalid, unauthenticated, "
            "oversized, peer_table_full), failed to send",
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
            kind: self.messages.labels(kind)
            for kind in (
                "sent",
                "received",
                "invalid",
                "unauthenticated",
                "oversized",
                "peer_table_full",
                "failed",
            )
        }

    @property
    def connected(self) -> bool:
        return self.publishing and self.listening

    @property
    def peers(self) -> list[str]:
        return sorted(self._peers)

    # ---- the request path (no I/O: a note queued and a flag set) ----

    def routed(self, request: RouteRequest, choice: Choice, prefill_tokens: int) -> None:
        """Queue the note of a request just routed to choice.backend."""
        placement = self.policy.for_peers(choice)
        keys = placement.prefix_keys
        if len(keys) > MAX_PREFIX_KEYS:
            keys = keys[:MAX_PREFIX_KEYS]
        if len(self._pending) == self._pending.maxlen:
            self.dropped_notes.inc()
        self._pending.append(
            RoutedNote(
                backend=choice.backend.name,
                prefill_tokens=max(0, prefill_tokens),
                prefix_keys=keys,
                ttl_s=placement.ttl_s if keys else 0.0,
                hot_prefix_key=placement.hot_prefix_key,
                cold=choice.reason == "cold_spread",
                # Never a client's whole key: a long one travels as its digest (router/policies/session.py).
                session=None if request.session_key is None else session_table_key(request.session_key),
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
        log.info(
            "replica %s syncs on %s channel %s (%s)",
            self.replica_id,
            self.where,
            self.config.channel,
            "messages signed" if self._secret is not None else "messages NOT signed: loopback only",
        )

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
                        self._publisher.publish(
                            self.config.channel, self._seal(self._encoder.encode(goodbye))
                        ),
                        1.0,
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
            data = self._message_within_bound(notes)
            try:
                await self._publisher.publish(config.channel, data)
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

    def _seal(self, payload: bytes) -> bytes:
        """The message as it goes on the channel: in its signed envelope when a secret is set."""
        if self._secret is None:
            return payload
        self._sequence = max(time.time_ns(), self._sequence + 1)
        sequence = struct.pack("<Q", self._sequence)
        mac = hmac.digest(self._secret, ENVELOPE_MAGIC + self._channel + sequence + payload, "sha256")
        return _ENVELOPE.pack(ENVELOPE_MAGIC, mac, self._sequence) + payload

    def _message_within_bound(self, notes: list[RoutedNote]) -> bytes:
        """This replica's loads and as many of `notes` as fit in max_message_bytes, sealed; the
        notes that do not fit go back to the front of the queue for the next message."""
        limit = self.config.max_message_bytes
        loads = self._local_loads()
        while True:
            data = self._seal(
                self._encoder.encode(SyncMessage(replica=self.replica_id, loads=loads, routed=notes))
            )
            if len(data) <= limit:
                return data
            if len(notes) > 1:
                keep = len(notes) // 2
                self._pending.extendleft(reversed(notes[keep:]))
                notes = notes[:keep]
                self._wake.set()
            elif notes and notes[0].prefix_keys:
                # One note too large alone: its prefix keys are a prefix, so fewer of them still hold.
                keys = notes[0].prefix_keys
                notes = [msgspec.structs.replace(notes[0], prefix_keys=keys[: len(keys) // 2])]
            elif notes:
                self.dropped_notes.inc(len(notes))
                notes = []
            else:  # loads alone too large: one entry per backend, so only with absurdly many
                loads = loads[: max(0, (limit - _MESSAGE_SLACK_BYTES) // 300)]

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
            retry_at_once = False
            try:
                await pubsub.subscribe(config.channel)
                self._last_echo = time.monotonic()
                await self._listen(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any transport failure: retry after a heartbeat
                if self.listening:
                    # Lost while alive (Redis may drop a subscriber buried under a burst of large
                    # messages): subscribe again at once, so the peers do not expire meanwhile.
                    retry_at_once = True
                    log.warning("replica sync: lost the subscription on %s (%s); retrying", self.where, exc)
            finally:
                self.listening = False
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(0 if retry_at_once else config.heartbeat_s)

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

    def _refuse(self, kind: str, why: str, now: float) -> None:
        """Count a refused message; log it, or (within REFUSAL_LOG_INTERVAL_S of the last line) only
        add it to the counts the next line reports."""
        self._counters[kind].inc()
        self._refusals_unlogged[kind] = self._refusals_unlogged.get(kind, 0) + 1
        if now - self._refusals_logged_at < REFUSAL_LOG_INTERVAL_S:
            return
        counts = ", ".join(f"{name} {count}" for name, count in sorted(self._refusals_unlogged.items()))
        log.warning(
            "replica sync: refused messages on %s channel %s (%s since the last such line); latest: %s",
            self.where,
            self.config.channel,
            counts,
            why,
        )
        self._refusals_logged_at = now
        self._refusals_unlogged = {}

    def _open(self, data: bytes, now: float) -> tuple[bytes, int] | None:
        """The message inside a signed envelope and its sequence, or None (refused) when the
        envelope is missing, forged or stale."""
        if len(data) < _ENVELOPE.size or not data.startswith(ENVELOPE_MAGIC):
            self._refuse(
                "unauthenticated", "a message not signed (this replica needs auth_secret_env's secret)", now
            )
            return None
        _, mac, sequence = _ENVELOPE.unpack_from(data)
        payload = data[_ENVELOPE.size :]
        signed = ENVELOPE_MAGIC + self._channel + struct.pack("<Q", sequence) + payload
        assert self._secret is not None
        if not hmac.compare_digest(mac, hmac.digest(self._secret, signed, "sha256")):
            self._refuse(
                "unauthenticated", "a message with a wrong signature (forged, or another secret)", now
            )
            return None
        skew = abs(sequence / 1e9 - time.time())
        if skew > MAX_CLOCK_SKEW_S:
            self._refuse(
                "unauthenticated", f"a signed message stamped {skew:.0f} s from this clock (replayed?)", now
            )
            return None
        return payload, sequence

    def receive(self, data: bytes, now: float) -> None:
        """Apply one message from the channel (checked: a bad one is counted and ignored)."""
        if not isinstance(data, bytes):
            self._refuse("invalid", f"a {type(data).__name__} message", now)
            return
        if len(data) > min(MAX_MESSAGE_BYTES, self.config.max_message_bytes):
            self._refuse(
                "oversized",
                f"a message of {len(data)} bytes (max_message_bytes {self.config.max_message_bytes})",
                now,
            )
            return
        sequence = 0
        if self._secret is not None:
            opened = self._open(data, now)
            if opened is None:
                return
            data, sequence = opened
        try:
            message = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._refuse("invalid", f"a message that is not a valid sync message ({str(exc)[:200]})", now)
            return
        if message.replica == self.replica_id:
            self._last_echo = now
            return
        peer = self._peers.get(message.replica)
        if peer is not None and sequence and sequence <= peer.last_sequence:
            self._refuse("unauthenticated", f"a replayed message of peer {message.replica[:64]!r}", now)
            return
        self._counters["received"].inc()
        if message.leaving:
            if peer is not None:
                self._forget(message.replica)
            return
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self._refuse("peer_table_full", f"a message from a new peer past the {MAX_PEERS} known", now)
                return
            peer = self._peers[message.replica] = _Peer(now)
            log.info("replica sync: peer %s joined", message.replica)
        peer.last_seen = now
        peer.last_sequence = sequence
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
