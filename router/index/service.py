"""The KV index service: per backend and DP rank, one event stream (`transport.EventSubscriber`, its
sequence rules in `stream.EventStream`) feeding one shared PrefixIndex.

It is what the gateway holds as `gateway.kv_index`: started and stopped with the app, told when
backends come and go, asked by policies for the cached prefix of a prompt, and read by the debug
page and the metrics. Data-parallel ranks are indexed separately (each rank has its own cache and
its own block hashes) and merged per backend at lookup: a backend holds what its best rank holds.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.config import KVEvents, SharedTier
from router.index.ingest import IndexWriter, writer_lock
from router.index.keys import DEFAULT_NAMESPACE, Namespace
from router.index.shared_removals import SharedRemovals
from router.index.store import DEFAULT_MAX_BLOCKS, BackendIndexStats, BackendMatch, PrefixIndex
from router.index.transport import EventSubscriber, rank_endpoint

logger = logging.getLogger("kvgate.index")

_LOOKUP_BUCKETS = (10e-6, 25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 10e-3)


def new_index(*, compiled_ingest: bool = True) -> tuple[PrefixIndex, IndexWriter]:
    """An empty index and its one writer, sharing the writer lock. `compiled_ingest=False`: the
    Python rules apply every event even where the compiled writer is built."""
    index = PrefixIndex(lock=writer_lock(compiled_ingest))
    return index, IndexWriter(index, compiled=compiled_ingest)


@dataclass
class _Stream:
    backend: str
    rank: int
    index_name: str
    subscriber: EventSubscriber


class KVIndexService:
    """Subscribers + index + their metrics, for every backend that publishes KV events."""

    def __init__(self, registry: CollectorRegistry | None = None, *, replay_timeout_s: float = 1.0) -> None:
        # The index, and the one writer every subscriber hands its events to.
        self.index, self.writer = new_index()
        self.replay_timeout_s = replay_timeout_s
        self._streams: dict[str, list[_Stream]] = {}
        # Backends whose cached prefixes get no credit, and why (the contract check, router/contract.py).
        self.uncredited: dict[str, str] = {}
        # A shared tier's removals, whichever member reports them, reach every member's index.
        self.shared_removals = SharedRemovals(
            self.writer.apply, lambda name: [stream.index_name for stream in self._streams.get(name, [])]
        )
        self._configs: dict[str, KVEvents] = {}
        self._started = False
        self.lookup_seconds = Histogram(
            "kvgate_index_lookup_seconds",
            "Time to find the cached prefix of one prompt on every backend",
            buckets=_LOOKUP_BUCKETS,
            registry=registry,
        )
        if registry is not None:
            registry.register(_IndexCollector(self))

    # ---- lifecycle ----

    def start(self) -> None:
        self._started = True
        for name, streams in self._streams.items():
            self._start_streams(name, streams)

    def _start_streams(self, name: str, streams: list[_Stream]) -> None:
        """Start the backend's subscribers and say whether they could subscribe at all."""
        for stream in streams:
            if not stream.subscriber.running and stream.subscriber.stats.socket_error is None:
                stream.subscriber.start()
        failed = [stream.subscriber.stats.socket_error for stream in streams]
        failed = [error for error in failed if error is not None]
        if failed:
            logger.error(
                "kv events: %s is NOT subscribed (%s); kv_aware sees none of its cache and routes it by "
                "load alone",
                name,
                "; ".join(failed),
            )
        else:
            config = self._configs[name]
            # Which side binds, said at start: an engine that connects to a gateway that connects
            # too delivers nothing, and "subscribed" alone read as if all were well.
            direction = (
                "binding it (the engine's publisher must connect to it)"
                if config.bind
                else "connecting to it (the engine's publisher must bind it: endpoint tcp://*:PORT)"
            )
            logger.info(
                "kv events: subscribed to %s (%d rank(s)) at %s, %s",
                name,
                len(streams),
                config.endpoint,
                direction,
            )

    def stop(self) -> None:
        self._started = False
        subscribers = [stream.subscriber for streams in self._streams.values() for stream in streams]
        for subscriber in subscribers:  # all at once, then wait: shutdown takes one poll, not N
            subscriber.stop(wait=False)
        for subscriber in subscribers:
            subscriber.stop()

    # ---- backends ----

    def add_backend(self, name: str, kv_events: KVEvents | None) -> None:
        """Subscribe to a backend's streams (one per DP rank); a backend without events is ignored."""
        if kv_events is None or name in self._streams:
            return
        streams = []
        for rank in range(kv_events.dp_ranks):
            index_name = name if kv_events.dp_ranks == 1 else f"{name}@dp{rank}"
            self.index.add_backend(index_name, kv_events.max_blocks or DEFAULT_MAX_BLOCKS)
            subscriber = EventSubscriber(
                index_name,
                rank_endpoint(kv_events.endpoint, rank),
                # (a partial: no Python frame per applied batch on top of the index's entry)
                apply=self.shared_removals.wrap(name, functools.partial(self.writer.apply, index_name)),
                apply_payloads=self.shared_removals.wrap_payloads(
                    name, functools.partial(self.writer.apply_payloads, index_name)
                ),
                clear=functools.partial(self.index.clear_backend, index_name),
                replay_endpoint=(
                    rank_endpoint(kv_events.replay_endpoint, rank) if kv_events.replay_endpoint else None
                ),
                topic=kv_events.topic,
                bind=kv_events.bind,
                replay_timeout_s=self.replay_timeout_s,
                max_message_bytes=kv_events.max_message_bytes,
                max_queued_bytes=kv_events.max_queued_bytes,
                replace=(
                    (lambda events, target=index_name: self.writer.replace_backend(target, events))
                    if kv_events.snapshot
                    else None
                ),
            )
            streams.append(_Stream(name, rank, index_name, subscriber))
        self._streams[name] = streams
        self._configs[name] = kv_events
        if self._started:
            self._start_streams(name, streams)

    def remove_backend(self, name: str) -> None:
        for stream in self._streams.pop(name, []):
            stream.subscriber.stop()
            self.index.remove_backend(stream.index_name)
        self._configs.pop(name, None)

    def backends(self) -> list[str]:
        return list(self._streams)

    # ---- queries ----

    def longest_cached_prefix(
        self,
        tokens: np.ndarray | list[int],
        namespace: Namespace = DEFAULT_NAMESPACE,
        backends: Iterable[str] | None = None,
        *,
        keys: Sequence[int] | np.ndarray | None = None,
        disconnected: bool = False,
    ) -> dict[str, BackendMatch]:
        """Per backend, the leading tokens of the prompt its engine holds, per tier (events only).

        `keys`: the prompt's router keys when the caller has them (prompt_prefix_keys), not recomputed.
        A rank whose event stream is disconnected holds nothing here (what it announced may be
        gone, and its removals do not reach the index), and neither does a backend `set_uncredited`,
        unless `disconnected` is true.
        """
        started = time.perf_counter()
        wanted = list(self._streams) if backends is None else [b for b in backends if b in self._streams]
        uncredited = () if disconnected else self.uncredited
        index_names = [
            stream.index_name
            for name in wanted
            if name not in uncredited
            for stream in self._streams[name]
            if disconnected or stream.subscriber.stats.connected
        ]
        matches = self.index.longest_cached_prefix(tokens, namespace, index_names, keys=keys)
        result: dict[str, BackendMatch] = {}
        for name in wanted:
            best = None
            for stream in self._streams[name]:
                match = matches.get(stream.index_name)
                if match is not None and (best is None or match.tokens > best.tokens):
                    best = match
            result[name] = best or BackendMatch({}, [])
        self.lookup_seconds.observe(time.perf_counter() - started)
        return result

    def share_removals(self, tiers: Sequence[SharedTier]) -> None:
        """Apply a shared tier's removals from any member to every member (shared_removals.py);
        called before the backends are added."""
        self.shared_removals.configure(tiers)

    def set_uncredited(self, name: str, reason: str | None) -> None:
        """Give the backend's cached prefixes no credit (`reason`: why, shown with stale holders), or
        credit them again (None)."""
        if reason is None:
            self.uncredited.pop(name, None)
        else:
            self.uncredited[name] = reason

    def disconnected_streams(self) -> dict[str, str]:
        """Backends with a disconnected event stream (some rank's), each with the reason to show."""
        found = {}
        for name, streams in self._streams.items():
            ranks = [stream.rank for stream in streams if not stream.subscriber.stats.connected]
            if ranks:
                which = "" if len(streams) == 1 else f" (rank {', '.join(map(str, ranks))})"
                found[name] = f"event stream disconnected{which}"
        return found

    def namespace_for(self, model: str, cache_salt: str | None) -> Namespace:
        """The index namespace of a request: its model names a LoRA adapter when engines said so."""
        return self.index.namespace_for(model, cache_salt)

    def held_tokens(self, name: str) -> int:
        """Tokens the backend's engine holds in all tiers and ranks (to spread cold prefixes)."""
        return sum(self.index.held_tokens(stream.index_name) for stream in self._streams.get(name, []))

    def stats(self, name: str) -> BackendIndexStats | None:
        """The index's counts for the backend, summed over its ranks; None without KV events."""
        streams = self._streams.get(name)
        if not streams:
            return None
        total = BackendIndexStats()
        for stream in streams:
            stats = self.index.stats(stream.index_name)
            if stats is None:
                continue
            for tier, blocks in stats.blocks.items():
                total.blocks[tier] = total.blocks.get(tier, 0) + blocks
            for tier, tokens in stats.tokens.items():
                total.tokens[tier] = total.tokens.get(tier, 0) + tokens
            total.stored_events += stats.stored_events
            total.removed_events += stats.removed_events
            total.cleared_events += stats.cleared_events
            total.unplaced_blocks += stats.unplaced_blocks
            total.unknown_removals += stats.unknown_removals
        return total

    # ---- introspection ----

    def status(self) -> dict[str, dict[str, Any]]:
        """Per backend: connection, sequence, replay and index state (the debug page's table)."""
        out: dict[str, dict[str, Any]] = {}
        for name, streams in self._streams.items():
            ranks = []
            blocks: dict[str, int] = {}
            tokens: dict[str, int] = {}
            for stream in streams:
                stats = stream.subscriber.stats
                index_stats = self.index.stats(stream.index_name)
                if index_stats is not None:
                    for tier, count in index_stats.blocks.items():
                        blocks[tier] = blocks.get(tier, 0) + count
                    for tier, count in index_stats.tokens.items():
                        tokens[tier] = tokens.get(tier, 0) + count
                ranks.append(
                    {
                        "rank": stream.rank,
                        "endpoint": stream.subscriber.endpoint,
                        "connected": stats.connected,
                        "last_seq": stats.last_seq,
                        "batches": stats.batches,
                        "scanned_batches": stats.scanned_batches,
                        "events": dict(stats.events),
                        "synced": stats.synced,
                        "replays": stats.replays,
                        "replayed_batches": stats.replayed_batches,
                        "superseded_batches": stats.superseded_batches,
                        "superseded_events": stats.superseded_events,
                        "unrecovered_gaps": stats.unrecovered_gaps,
                        "restarts": stats.restarts,
                        "duplicates": stats.duplicates,
                        "oversized": stats.oversized,
                        "dropped_messages": stats.dropped_messages,
                        "dropped_bytes": stats.dropped_bytes,
                        "queued_bytes": stats.queued_bytes,
                        "queued_bytes_peak": stats.queued_bytes_peak,
                        "skipped_replays": stats.skipped_replays,
                        "malformed": stats.malformed,
                        "apply_errors": stats.apply_errors,
                        "uncertain": stats.uncertain,
                        "uncertain_reason": stats.uncertain_reason,
                        "unplaced_blocks": index_stats.unplaced_blocks if index_stats else 0,
                        "evicted_blocks": index_stats.evicted_blocks if index_stats else 0,
                        "last_message_at": stats.last_message_at,
                        "last_error": stats.last_error,
                        "socket_error": stats.socket_error,
                        "snapshots": stats.snapshots,
                        "snapshot_failures": stats.snapshot_failures,
                        "snapshot_blocks": stats.snapshot_blocks,
                        "last_snapshot_error": stats.last_snapshot_error,
                    }
                )

            def total(key: str, ranks: list[dict[str, Any]] = ranks) -> int:
                return sum(rank[key] for rank in ranks)

            out[name] = {
                "connected": all(rank["connected"] for rank in ranks),
                # Who binds the event endpoint: what a stream that never connects got wrong.
                "endpoint": self._configs[name].endpoint,
                "bind": self._configs[name].bind,
                # Every rank has caught up with what its engine still buffers (see stream.py).
                "synced": all(rank["synced"] for rank in ranks),
                "last_seq": ranks[0]["last_seq"] if len(ranks) == 1 else [rank["last_seq"] for rank in ranks],
                "blocks": blocks,
                "tokens": tokens,
                "batches": total("batches"),
                "scanned_batches": total("scanned_batches"),
                "replays": total("replays"),
                "replayed_batches": total("replayed_batches"),
                "superseded_batches": total("superseded_batches"),
                "unrecovered_gaps": total("unrecovered_gaps"),
                "restarts": total("restarts"),
                "duplicates": total("duplicates"),
                "oversized": total("oversized"),
                "dropped_messages": total("dropped_messages"),
                "queued_bytes": total("queued_bytes"),
                "skipped_replays": total("skipped_replays"),
                "snapshots": total("snapshots"),
                "snapshot_failures": total("snapshot_failures"),
                "malformed": total("malformed"),
                "unplaced_blocks": total("unplaced_blocks"),
                "evicted_blocks": total("evicted_blocks"),
                "uncertain": any(rank["uncertain"] for rank in ranks),
                # The newest event from any rank (time.time()), None before the first.
                "last_message_at": max(
                    (rank["last_message_at"] for rank in ranks if rank["last_message_at"] is not None),
                    default=None,
                ),
                "socket_errors": [rank["socket_error"] for rank in ranks if rank["socket_error"]],
                "ranks": ranks,
            }
        return out

    def all_synced(self) -> bool:
        """Every subscriber has done its first catch-up (replay from seq 0 or snapshot)."""
        return all(stream.subscriber.stats.synced for streams in self._streams.values() for stream in streams)

    def snapshots_enabled(self, name: str) -> bool:
        config = self._configs.get(name)
        return config is not None and config.snapshot

    def subscribers(self, name: str) -> list[EventSubscriber]:
        return [stream.subscriber for stream in self._streams.get(name, [])]


class _IndexCollector:
    """Exports subscriber and index counters at scrape time (nothing is counted twice on the event path)."""

    def __init__(self, service: KVIndexService) -> None:
        self._service = service

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[Any]:
        events = CounterMetricFamily("kvgate_kv_events", "KV events received", labels=["backend", "type"])
        replays = CounterMetricFamily(
            "kvgate_kv_replays", "Replays requested after a gap", labels=["backend"]
        )
        gaps = CounterMetricFamily(
            "kvgate_kv_unrecovered_gaps", "Gaps the replay could not fill", labels=["backend"]
        )
        restarts = CounterMetricFamily(
            "kvgate_kv_restarts", "Engine restarts detected (seq back, later ts)", labels=["backend"]
        )
        duplicates = CounterMetricFamily(
            "kvgate_kv_duplicates",
            "Messages ignored as duplicates or stale (seq not past the last, published no later)",
            labels=["backend"],
        )
        dropped = CounterMetricFamily(
            "kvgate_kv_dropped_messages",
            "Live messages dropped: over kv_events.max_message_bytes (oversized) or past "
            "max_queued_bytes while a replay waited (queue_full)",
            labels=["backend", "reason"],
        )
        queued = GaugeMetricFamily(
            "kvgate_kv_queued_bytes", "Live message bytes read while a replay waits", labels=["backend"]
        )
        skipped = CounterMetricFamily(
            "kvgate_kv_skipped_replays",
            "Replays not asked because the replay endpoint answered nothing lately",
            labels=["backend"],
        )
        snapshots = CounterMetricFamily(
            "kvgate_kv_snapshots",
            "Snapshots asked of cache-layer publishers (kv_events.snapshot), by outcome (ok, failed)",
            labels=["backend", "outcome"],
        )
        malformed = CounterMetricFamily(
            "kvgate_kv_malformed", "Malformed KV-event messages skipped", labels=["backend"]
        )
        uncertain = GaugeMetricFamily(
            "kvgate_kv_uncertain", "1 when the backend's index entries may be stale", labels=["backend"]
        )
        connected = GaugeMetricFamily(
            "kvgate_kv_connected", "1 when the event stream is connected", labels=["backend"]
        )
        blocks = GaugeMetricFamily(
            "kvgate_index_blocks", "Engine blocks in the index", labels=["backend", "tier"]
        )
        tokens = GaugeMetricFamily(
            "kvgate_index_tokens",
            "Tokens covered by the engine blocks in the index",
            labels=["backend", "tier"],
        )
        evicted = CounterMetricFamily(
            "kvgate_index_evicted_blocks",
            "Engine blocks the index dropped, oldest first, to keep a backend within kv_events.max_blocks",
            labels=["backend"],
        )
        keys = GaugeMetricFamily("kvgate_index_router_keys", "Distinct cached prefixes (router blocks)")
        for name, status in self._service.status().items():
            for rank in status["ranks"]:
                for kind, count in rank["events"].items():
                    events.add_metric([name, kind], count)
            replays.add_metric([name], status["replays"])
            gaps.add_metric([name], status["unrecovered_gaps"])
            restarts.add_metric([name], status["restarts"])
            duplicates.add_metric([name], status["duplicates"])
            dropped.add_metric([name, "oversized"], status["oversized"])
            dropped.add_metric([name, "queue_full"], status["dropped_messages"])
            queued.add_metric([name], status["queued_bytes"])
            skipped.add_metric([name], status["skipped_replays"])
            if self._service.snapshots_enabled(name):
                snapshots.add_metric([name, "ok"], status["snapshots"])
                snapshots.add_metric([name, "failed"], status["snapshot_failures"])
            malformed.add_metric([name], status["malformed"])
            uncertain.add_metric([name], 1.0 if status["uncertain"] else 0.0)
            connected.add_metric([name], 1.0 if status["connected"] else 0.0)
            for tier, count in status["blocks"].items():
                blocks.add_metric([name, tier], count)
            for tier, count in status["tokens"].items():
                tokens.add_metric([name, tier], count)
            evicted.add_metric([name], status["evicted_blocks"])
        keys.add_metric([], self._service.index.size()["router_keys"])
        yield from (
            events,
            replays,
            gaps,
            restarts,
            duplicates,
            dropped,
            queued,
            skipped,
            snapshots,
            malformed,
            uncertain,
            connected,
            blocks,
            tokens,
            evicted,
            keys,
        )
