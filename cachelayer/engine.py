"""CacheEngine: store, find and load KV chunks across the CPU pool (L1), the disk tier (L2) and
the shared remote tier (Redis, when `remote_url` is set).

KV comes in and goes out as one tensor `[num_layers, 2, num_tokens, num_kv_heads * head_dim]`
(K then V). Tokens are cut into chunks of `chunk_size` (the shorter tail chunk too when
`save_unfull_chunk`); each chunk is stored, found and evicted as a unit under a chained key
(cachelayer.keys), so everything here speaks in whole chunks:
- `store` stores the chunks in order and stops at the first that cannot be placed: what is
  stored is always a prefix. Chunks already held are not rewritten.
- `retrieve` and `lookup` walk the chunks in order and stop at the first one held nowhere, so a
  hit always ends on a chunk boundary (or at the end of the tokens).
- The remote tier is written behind the store (a bounded queue, one writer thread) and asked
  only for the chunks after the local prefix, in one round trip; a retrieve promotes what it
  fetches to L1. A failing remote is a miss, never an error (cachelayer.storage.remote).

The engine orchestrates the tiers; they implement themselves (cachelayer.storage): the disk and
remote writes behind the store are the tiers' writers (disk.DiskWriter, remote_sync.RemoteWriter),
a promotion from Redis is remote_sync.promote_from_remote, and what an input must look like is
cachelayer.kv_layout. The engine knows nothing of who serves it: its owner attaches a controller
worker (cachelayer.controller.worker.attach_controller_worker).

Thread safety: one lock guards the index of every tier; tensor copies run outside it, protected
by the reference each reader or writer holds on its chunks (a referenced chunk is never evicted,
and its space is given back only when the last reference goes). Every write into a tier is one
`ChunkWrite` (reserve, copy, commit or abort). Every state change is announced to the event
listeners (KV events) while the lock is held, so listeners see changes in order.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachelayer.compress import get_codec
from cachelayer.config import CacheLayerConfig, as_config
from cachelayer.keys import CacheIdentity, ChunkSpan, chunk_spans
from cachelayer.kv_layout import CacheEngineError, KVLayout, Tokens, as_dtype, checked_tokens, copy_tensor
from cachelayer.storage.chunk_write import (
    ChunkWrite,
    TierState,
    removal_events,
    snapshot_events,
)
from cachelayer.storage.cpu import CpuTier
from cachelayer.storage.disk import DiskTier, DiskWriter
from cachelayer.storage.remote_sync import RemoteWriter, promote_from_remote, remote_tier_for
from cachelayer.storage.remote_truth import RemoteTruth
from cachelayer.storage.tier import ChunkMeta, Tier, TierEntry
from kvwire import AllBlocksCleared, EventPublisher
from kvwire import KVEvent as Event

log = logging.getLogger(__name__)

EventListener = Callable[[list[Event]], None]

_LOCATION_ALIASES = {"LocalCPUBackend": "cpu", "cpu": "cpu", "LocalDiskBackend": "disk", "disk": "disk"}


@dataclass(slots=True)
class StoreReservation:
    """L1 space reserved for a store: the chunks to write, and the leading tokens held once they are."""

    held_end: int
    chunks: list[tuple[ChunkSpan, TierEntry]]
    write: ChunkWrite = field(repr=False)


class CacheEngine:
    def __init__(
        self,
        config: CacheLayerConfig,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
        model_name: str = "",
        world_size: int = 1,
        worker_id: int = 0,
        cpu_tier: CpuTier | None = None,
        lock: threading.RLock | None = None,
    ) -> None:
        """`cpu_tier` and `lock`: an L1 pool shared with other engines (the daemon's one budget
        over all key spaces) and the lock that guards it; by default the engine owns both."""
        if min(num_layers, num_kv_heads, head_dim) < 1:
            raise CacheEngineError(
                "num_layers, num_kv_heads and head_dim must be >= 1, "
                f"got {num_layers}, {num_kv_heads}, {head_dim}"
            )
        self.config = config
        self.num_layers = num_layers
        self.channels = num_kv_heads * head_dim
        self.dtype = as_dtype(dtype)
        self.layout = KVLayout(num_layers, self.channels, self.dtype)
        self.chunk_size = config.chunk_size
        self.worker_id = worker_id
        self.world_size = world_size
        self.identity = CacheIdentity(
            model=model_name,
            dtype=str(self.dtype).removeprefix("torch."),
            world_size=world_size,
            worker_id=worker_id,
        )
        # The lock over every tier's index, the clear() generation and the event listeners.
        self._state = TierState(lock)
        self._lock = self._state.lock
        self.cpu = (
            cpu_tier
            if cpu_tier is not None
            else CpuTier(config.max_local_cpu_bytes, config.cache_policy, quotas=config.tenant_quotas)
        )
        self.disk: DiskTier | None = None
        if config.local_disk_path is not None:
            self.disk = DiskTier(
                config.local_disk_path,
                config.max_local_disk_bytes,
                config.cache_policy,
                num_layers=num_layers,
                channels=self.channels,
                dtype=self.identity.dtype,
                owner=f"{model_name}|world_size={world_size}|worker={worker_id}",
            )
        self._tiers: dict[str, Tier] = {"cpu": self.cpu}
        if self.disk is not None:
            self._tiers["disk"] = self.disk
        self.remote = remote_tier_for(config, self.layout) if config.remote_url is not None else None
        # Retracts, in KV events, the remote chunks this engine announced and Redis lost.
        self.remote_truth = (
            RemoteTruth(
                self.remote,
                self._state,
                reconcile_interval_s=config.remote_reconcile_interval_s,
                notifications=config.remote_eviction_notifications,
                max_chunks=config.remote_max_announced_chunks,
            )
            if self.remote is not None
            else None
        )
        self.counters = {
            "read_chunks": 0,
            "write_chunks": 0,
            "lookup_requested_tokens": 0,
            "lookup_hit_tokens": 0,
        }
        self.publisher: EventPublisher | None = None
        if config.enable_kv_events and config.kv_events_endpoint is not None:
            self.publisher = EventPublisher(
                config.kv_events_endpoint,
                config.kv_events_replay_endpoint,
                topic=config.kv_events_topic,
                encoding="vllm-array",
                snapshot_source=self.snapshot_events,
                state_lock=self._lock,
            )
            self.add_event_listener(self.publisher.publish)
        # Disk writes happen behind the store, in the disk tier's writer thread (stores return after
        # the CPU copy).
        self._disk_writer = DiskWriter(self.disk, self.cpu, self._state) if self.disk is not None else None
        # Remote writes happen behind the store too, in the remote tier's writer thread; a full
        # queue drops the batch (a store never waits for Redis).
        self._remote_writer = (
            RemoteWriter(
                self.remote,
                self.cpu,
                self._state,
                self.layout,
                serde=config.remote_serde,
                max_batches=config.remote_write_queue_batches,
                truth=self.remote_truth,
                quotas=config.tenant_quotas,
            )
            if self.remote is not None
            else None
        )
        # Closed with the engine: what its owner attached to it (e.g. the controller's worker,
        # cachelayer.controller.worker.attach_controller_worker). The engine knows nothing more of them.
        self._close_hooks: list[Callable[[], None]] = []

    @classmethod
    def from_config(
        cls,
        cfg: CacheLayerConfig | dict[str, Any] | str | None,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
        **identity: Any,
    ) -> CacheEngine:
        """Build from a config object, a dict of LMCache keys, a YAML path, or None (environment).

        Extra keywords: model_name, world_size, worker_id (parts of every chunk key).
        """
        return cls(
            as_config(cfg),
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            **identity,
        )

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call `hook` when the engine closes, after its pending writes and before its publisher
        stops: how an owner ties what it attached (a controller worker) to the engine's life."""
        self._close_hooks.append(hook)

    def close(self) -> None:
        """Finish the pending disk writes, then stop the threads (what was attached, the publisher)."""
        if self._disk_writer is not None:
            self._disk_writer.close()
            self._disk_writer = None
        if self._remote_writer is not None:
            self._remote_writer.close()
            self._remote_writer = None
        if self.remote_truth is not None:
            self.remote_truth.close()
        if self.remote is not None:
            self.remote.close()
        while self._close_hooks:
            self._close_hooks.pop()()  # the last attached first
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- events ----
    def add_event_listener(self, listener: EventListener) -> None:
        """Call `listener(events)` for every batch of state changes, in order, under the engine lock."""
        with self._lock:
            self._state.listeners.append(listener)

    def _emit(self, events: list[Event]) -> None:
        self._state.emit(events)

    def snapshot_events(self) -> list[Event]:
        """A BlockStored for every chunk held, per tier, parents before children."""
        with self._lock:
            return snapshot_events(self._tiers.values())

    # ---- keys and validation ----
    def _spans(self, tokens: list[int], cache_salt: str | None, lora: str | None) -> list[ChunkSpan]:
        identity = self.identity
        if cache_salt is not None or lora is not None:
            identity = CacheIdentity(
                identity.model, identity.dtype, identity.world_size, identity.worker_id, cache_salt, lora
            )
        return chunk_spans(
            tokens,
            chunk_size=self.chunk_size,
            identity=identity,
            algorithm=self.config.pre_caching_hash_algorithm,
            save_unfull_chunk=self.config.save_unfull_chunk,
        )

    def _tier(self, location: str) -> Tier:
        alias = _LOCATION_ALIASES.get(location)
        if alias is None:
            raise CacheEngineError(
                f"unknown location {location!r}; use LocalCPUBackend or LocalDiskBackend (or cpu / disk)"
            )
        tier = self._tiers.get(alias)
        if tier is None:
            raise CacheEngineError(
                f"location {location!r} is not configured (set local_disk and max_local_disk_size)"
            )
        return tier

    def _read_payload(self, tier: Tier, entry: TierEntry) -> torch.Tensor:
        if isinstance(tier, CpuTier):
            return tier.view(entry)
        assert isinstance(tier, DiskTier)
        return tier.read_bytes(entry)

    def _write_payload(self, tier: Tier, entry: TierEntry, payload: torch.Tensor) -> None:
        if isinstance(tier, CpuTier):
            copy_tensor(tier.view(entry), payload)
        else:
            assert isinstance(tier, DiskTier)
            tier.write(entry, payload)

    # ---- store ----
    def store(
        self, tokens: Tokens, kv: torch.Tensor, *, cache_salt: str | None = None, lora: str | None = None
    ) -> int:
        """Store the chunks of `tokens`; returns how many leading tokens are now held."""
        token_list = checked_tokens(tokens)
        self.layout.check_kv(kv, len(token_list), "kv")
        reservation = self.reserve_chunks(token_list, cache_salt=cache_salt, lora=lora)
        with reservation.write.copying():
            for span, entry in reservation.chunks:
                copy_tensor(self.chunk_buffer(entry), kv[:, :, span.start : span.end])
        self.commit_chunks(reservation)
        return reservation.held_end

    def reserve_chunks(
        self, tokens: Tokens, *, cache_salt: str | None = None, lora: str | None = None
    ) -> StoreReservation:
        """The first half of a store: L1 space for each chunk of `tokens` not held yet, in order,
        stopping at the first that does not fit. The caller writes each chunk into
        `chunk_buffer(entry)`, then calls `commit_chunks` (or `abort_chunks`); until then the
        chunks are invisible to lookups and never evicted."""
        token_list = checked_tokens(tokens)
        spans = self._spans(token_list, cache_salt, lora)
        with self._lock:
            # A clear() does not drop a store under way: it commits what it wrote after the clear.
            write = ChunkWrite(self._state, self.cpu, dropped_by_clear=False)
            reservation = StoreReservation(held_end=0, chunks=[], write=write)
            for span in spans:
                # A chunk held, or being written by another thread, is not written twice.
                if any(tier.has_key(span.key) for tier in self._tiers.values()):
                    for tier in self._tiers.values():
                        tier.touch(span.key)
                    reservation.held_end = span.end
                    continue
                meta = ChunkMeta.of_span(
                    span, array("q", token_list[span.start : span.end]), cache_salt=cache_salt
                )
                entry = write.reserve(meta, self.layout.raw_nbytes(span.num_tokens))
                if entry is None:
                    break
                reservation.chunks.append((span, entry))
                reservation.held_end = span.end
            write.announce_evictions()
        return reservation

    def chunk_buffer(self, entry: TierEntry) -> torch.Tensor:
        """An L1 chunk's KV [num_layers, 2, num_tokens, channels], a view of the pool (no copy)."""
        return self.layout.chunk_view(self.cpu.view(entry), entry.meta)

    def commit_chunks(self, reservation: StoreReservation) -> None:
        """Make written chunks visible (and queue them for the disk tier)."""
        if not reservation.chunks:
            return
        with self._lock:
            stored = reservation.write.commit()
            self.counters["write_chunks"] += len(reservation.chunks)
            self._emit(stored)
        if self._disk_writer is not None:
            self._disk_writer.submit([entry.meta for _, entry in reservation.chunks])
        if self._remote_writer is not None:
            self._remote_writer.submit([entry.meta for _, entry in reservation.chunks])

    def abort_chunks(self, reservation: StoreReservation) -> None:
        """Give back the space of chunks that will not be written; nothing becomes visible."""
        with self._lock:
            reservation.write.abort()

    def withdraw_chunks(self, reservation: StoreReservation) -> None:
        """Take reserved chunks out of the store but keep their space allocated: a writer that may
        still be copying into it must not have the space handed to another chunk. Free it later
        with `release_chunks`."""
        with self._lock:
            for _, entry in reservation.chunks:
                self.cpu.withdraw(entry)

    def acquire_chunks(
        self, tokens: Tokens, *, cache_salt: str | None = None, lora: str | None = None
    ) -> list[tuple[ChunkSpan, TierEntry]]:
        """The longest prefix of `tokens` held raw in L1, each chunk referenced (never evicted nor
        reused) until `release_chunks`: a reader outside this process copies from the pool itself."""
        spans = self._spans(checked_tokens(tokens), cache_salt, lora)
        acquired: list[tuple[ChunkSpan, TierEntry]] = []
        with self._lock:
            for span in spans:
                entry = self.cpu.get(span.key)
                if entry is None or entry.meta.fmt != "raw":
                    break
                self.cpu.acquire(entry)
                self.cpu.touch(span.key)
                acquired.append((span, entry))
            self.counters["read_chunks"] += len(acquired)
        return acquired

    def release_chunks(self, entries: Sequence[TierEntry]) -> None:
        """Drop the references `acquire_chunks` or a withdrawn reservation held."""
        with self._lock:
            for entry in entries:
                self.cpu.release(entry)

    def flush_remote(self, timeout_s: float | None = None) -> bool:
        """Wait until every chunk stored so far was written to the remote tier (or dropped);
        False when `timeout_s` passed first."""
        return self._remote_writer.flush(timeout_s) if self._remote_writer is not None else True

    def flush(self) -> None:
        """Wait until every chunk stored so far has been written to the disk tier (or skipped)."""
        if self._disk_writer is not None:
            self._disk_writer.flush()

    # ---- lookup ----
    def _held_prefix(self, spans: list[ChunkSpan]) -> list[tuple[ChunkSpan, list[Tier]]]:
        held = []
        for span in spans:
            tiers = [tier for tier in self._tiers.values() if span.key in tier]
            if not tiers:
                break
            held.append((span, tiers))
        return held

    def lookup(self, tokens: Tokens, *, cache_salt: str | None = None, lora: str | None = None) -> int:
        """The longest prefix of `tokens` held across tiers, in tokens (ends on a chunk boundary)."""
        token_list = checked_tokens(tokens)
        spans = self._spans(token_list, cache_salt, lora)
        with self._lock:
            held = self._held_prefix(spans)
        hit = held[-1][0].end if held else 0
        if self.remote is not None and len(held) < len(spans):
            rest = spans[len(held) :]
            found = self.remote.held_prefix([span.key for span in rest])
            self.remote.note_lookup(found, len(rest) - found)
            if found:
                hit = rest[found - 1].end
        with self._lock:
            self.counters["lookup_requested_tokens"] += len(token_list)
            self.counters["lookup_hit_tokens"] += hit
        return hit

    def lookup_location(
        self, tokens: Tokens, *, cache_salt: str | None = None, lora: str | None = None
    ) -> tuple[str | None, int]:
        """(location, matched tokens) as LMCache's controller reports it.

        The location is the slowest tier the contiguous prefix needs: LocalCPUBackend when every
        chunk is in the CPU pool, LocalDiskBackend when some are only on disk.
        """
        spans = self._spans(checked_tokens(tokens), cache_salt, lora)
        with self._lock:
            held = self._held_prefix(spans)
        if not held:
            return None, 0
        needs_disk = any(self.cpu not in tiers for _, tiers in held)
        location = self.disk.name if needs_disk and self.disk is not None else self.cpu.name
        return location, held[-1][0].end

    # ---- retrieve ----
    def retrieve(
        self,
        tokens: Tokens,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
        out: torch.Tensor | None = None,
    ) -> tuple[int, torch.Tensor | None]:
        """Load the longest held prefix: (hit_tokens, kv [num_layers, 2, hit_tokens, channels] or None).

        With `out` (shaped [num_layers, 2, >= len(tokens), channels], any device) the KV is written
        into out[:, :, :hit_tokens] and that view is returned: no intermediate tensor. Chunks found
        only on disk are promoted into the CPU pool on the way.
        """
        token_list = checked_tokens(tokens)
        if out is not None:
            self.layout.check_kv(out, len(token_list), "out", at_least=True)
        spans = self._spans(token_list, cache_salt, lora)
        if self.remote is not None:
            with self._lock:
                local = len(self._held_prefix(spans))
            promote_from_remote(
                self.remote,
                spans[local:],
                token_list,
                into=self.cpu,
                state=self._state,
                layout=self.layout,
                truth=self.remote_truth,
                cache_salt=cache_salt,
            )
        plan: list[tuple[ChunkSpan, Tier, TierEntry, TierEntry | None]] = []
        with self._lock:
            promotions = ChunkWrite(self._state, self.cpu)
            for span in spans:
                entry = self.cpu.get(span.key)
                if entry is not None:
                    self.cpu.acquire(entry)
                    self.cpu.touch(span.key)
                    plan.append((span, self.cpu, entry, None))
                    continue
                disk_entry = self.disk.get(span.key) if self.disk is not None else None
                if disk_entry is None:
                    break
                assert self.disk is not None
                self.disk.acquire(disk_entry)
                self.disk.touch(span.key)
                promoted = promotions.reserve(
                    ChunkMeta.of_span(span, disk_entry.meta.token_ids, disk_entry.meta.fmt, cache_salt),
                    disk_entry.nbytes,
                )
                plan.append((span, self.disk, disk_entry, promoted))
            promotions.announce_evictions()
        if not plan:
            return 0, None
        hit = plan[-1][0].end
        done: list[TierEntry] = []
        failed: list[tuple[Tier, TierEntry]] = []
        try:
            result = (
                out[:, :, :hit]
                if out is not None
                else torch.empty(self.num_layers, 2, hit, self.channels, dtype=self.dtype)
            )
            for span, tier, entry, promoted in plan:
                try:
                    if promoted is not None:
                        assert isinstance(tier, DiskTier)
                        tier.read_into(entry, self.cpu.view(promoted))
                        payload = self.cpu.view(promoted)
                    else:
                        payload = self._read_payload(tier, entry)
                    chunk = self.layout.chunk_view(payload, entry.meta)
                except (OSError, ValueError) as exc:  # unreadable file, corrupt or foreign blob
                    log.error(
                        "cachelayer: chunk %#x unusable in %s (%s); treated as a miss and removed",
                        span.key,
                        tier.name,
                        exc,
                    )
                    failed.append((tier, entry))
                    hit = span.start
                    break
                if promoted is not None:
                    done.append(promoted)
                copy_tensor(result[:, :, span.start : span.end], chunk)
            result = result[:, :, :hit]
        finally:
            with self._lock:
                for _, tier, entry, _ in plan:
                    tier.release(entry)
                # Promotions whose read failed, or begun before a clear(), are aborted.
                stored_events = promotions.commit(written=done)
                for tier, entry in failed:
                    if tier.get(entry.meta.key) is entry:  # not a replacement written since
                        tier.remove(entry.meta.key)
                        stored_events.extend(removal_events(tier, [entry.meta]))
                self.counters["read_chunks"] += sum(1 for span, *_ in plan if span.end <= hit)
                self._emit(stored_events)
        if hit == 0:
            return 0, None
        return hit, result

    # ---- pins ----
    def pin(
        self,
        tokens: Tokens,
        location: str | None = None,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> int:
        """Pin the held prefix's chunks (at `location`, or wherever they are); returns the tokens pinned."""
        return self._pin_or_unpin(tokens, location, cache_salt, lora, pin=True)

    def unpin(
        self,
        tokens: Tokens,
        location: str | None = None,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> int:
        return self._pin_or_unpin(tokens, location, cache_salt, lora, pin=False)

    def _pin_or_unpin(
        self, tokens: Tokens, location: str | None, cache_salt: str | None, lora: str | None, *, pin: bool
    ) -> int:
        tiers = [self._tier(location)] if location is not None else list(self._tiers.values())
        spans = self._spans(checked_tokens(tokens), cache_salt, lora)
        done_end = 0
        with self._lock:
            for span in spans:
                changed = [tier.pin(span.key) if pin else tier.unpin(span.key) for tier in tiers]
                if not any(changed):
                    break
                done_end = span.end
        return done_end

    # ---- clear / move ----
    def clear(self, location: str | None = None) -> int:
        """Drop every chunk (of one tier, or all); returns the tokens dropped. Readers finish first."""
        with self._lock:
            tiers = [self._tier(location)] if location is not None else list(self._tiers.values())
            # Writes and promotions begun before now are dropped, never committed after it (a cleared
            # cache must not refill from work queued before the clear).
            self._state.generation += 1
            counted: dict[int, int] = {}
            events: list[Event] = []
            for tier in tiers:
                removed = [entry.meta for entry in tier.committed_entries()]
                for meta in removed:
                    tier.remove(meta.key)
                    counted[meta.key] = meta.num_tokens
                if location is not None:
                    events.extend(removal_events(tier, removed))
            if location is None:
                events.append(AllBlocksCleared())
            self._emit(events)
            return sum(counted.values())

    def move(
        self,
        tokens: Tokens,
        source: str,
        destination: str,
        *,
        copy: bool = False,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> int:
        """Move (or copy) the chunks of `tokens` held at `source` to `destination`, in order.

        Stops at the first chunk missing at the source or that does not fit; returns the tokens moved.
        """
        source_tier, destination_tier = self._tier(source), self._tier(destination)
        spans = self._spans(checked_tokens(tokens), cache_salt, lora)
        moved_end = 0
        for span in spans:
            with self._lock:
                entry = source_tier.get(span.key)
                if entry is None:
                    break
                if source_tier is destination_tier:
                    moved_end = span.end
                    continue
                write: ChunkWrite | None = None
                if span.key not in destination_tier:
                    source_tier.acquire(entry)
                    # Like a store, a move under way is not dropped by a clear().
                    write = ChunkWrite(self._state, destination_tier, dropped_by_clear=False)
                    target = write.reserve(
                        ChunkMeta.of_span(span, entry.meta.token_ids, entry.meta.fmt, cache_salt),
                        entry.nbytes,
                    )
                    write.announce_evictions()
                    if target is None:
                        source_tier.release(entry)
                        break
            if write is not None:
                with write.copying(on_failure=lambda entry=entry: source_tier.release(entry)):
                    self._write_payload(destination_tier, target, self._read_payload(source_tier, entry))
            with self._lock:
                events: list[Event] = []
                if write is not None:
                    events.extend(write.commit())
                    source_tier.release(entry)
                if not copy:
                    removed = source_tier.remove(span.key)
                    if removed is not None:
                        events.extend(removal_events(source_tier, [removed.meta]))
                self._emit(events)
            moved_end = span.end
        return moved_end

    # ---- chunks as bytes (the controller relays them between instances) ----
    def transfer_identity(self) -> dict[str, Any]:
        """Everything a chunk's key and bytes depend on: two engines with equal identities can
        exchange chunks (the importer files them under the same keys the exporter used)."""
        return {
            "model": self.identity.model,
            "dtype": self.identity.dtype,
            "world_size": self.identity.world_size,
            "worker_id": self.identity.worker_id,
            "chunk_size": self.chunk_size,
            "hash_algorithm": self.config.pre_caching_hash_algorithm,
            "save_unfull_chunk": self.config.save_unfull_chunk,
            "num_layers": self.num_layers,
            "channels": self.channels,
        }

    def check_location(self, location: str) -> None:
        """Raise CacheEngineError unless `location` names a tier this engine has."""
        self._tier(location)

    def export_chunk(
        self,
        tokens: Tokens,
        index: int,
        location: str,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> tuple[ChunkSpan, str, bytes] | None:
        """Chunk `index` of `tokens` as held at `location`: (span, format, stored bytes), or None
        when that chunk is not held there. Compressed chunks leave in their encoded form."""
        tier = self._tier(location)
        spans = self._spans(checked_tokens(tokens), cache_salt, lora)
        if not 0 <= index < len(spans):
            return None
        span = spans[index]
        with self._lock:
            entry = tier.get(span.key)
            if entry is None:
                return None
            tier.acquire(entry)  # held while its bytes are copied out: never evicted under the copy
        try:
            data = self._read_payload(tier, entry).numpy().tobytes()
        finally:
            with self._lock:
                tier.release(entry)
        return span, entry.meta.fmt, data

    def import_chunk(
        self,
        tokens: Tokens,
        index: int,
        location: str,
        fmt: str,
        data: bytes,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> int:
        """Store chunk `index` of `tokens` at `location` from bytes `export_chunk` gave (same
        `transfer_identity`); returns the chunk's end, or 0 when it does not fit. A chunk already
        held there is kept as it is."""
        tier = self._tier(location)
        token_list = checked_tokens(tokens)
        spans = self._spans(token_list, cache_salt, lora)
        if not 0 <= index < len(spans):
            raise CacheEngineError(f"chunk {index} is out of range: the tokens make {len(spans)} chunk(s)")
        span = spans[index]
        if fmt == "raw":
            expected = self.layout.raw_nbytes(span.num_tokens)
            if len(data) != expected:
                raise CacheEngineError(
                    f"chunk {index} has {len(data)} bytes; {span.num_tokens} tokens of raw KV need {expected}"
                )
        else:
            # An unknown format, a wrong shape, dtype or token count, or a corrupted blob is refused
            # before anything is reserved: an import must never store what a retrieve cannot use.
            self.layout.check_blob(fmt, data, span.num_tokens, f"chunk {index}")
        if not data:
            raise CacheEngineError(f"chunk {index} arrived without bytes")
        with self._lock:
            if tier.has_key(span.key):
                tier.touch(span.key)
                return span.end
            write = ChunkWrite(self._state, tier)
            meta = ChunkMeta.of_span(span, array("q", token_list[span.start : span.end]), fmt, cache_salt)
            target = write.reserve(meta, len(data))
            write.announce_evictions()
            if target is None:
                return 0
        with write.copying():
            self._write_payload(tier, target, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        with self._lock:
            stored = write.commit()
            if write.cleared:  # the clear wins
                return 0
            self.counters["write_chunks"] += 1
            self._emit(stored)
        return span.end

    def drop(
        self,
        tokens: Tokens,
        location: str,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> int:
        """Remove the leading chunks of `tokens` held at `location`, up to the first one not held
        there; returns the tokens removed (the source side of a move between instances)."""
        tier = self._tier(location)
        spans = self._spans(checked_tokens(tokens), cache_salt, lora)
        dropped_end = 0
        with self._lock:
            removed: list[ChunkMeta] = []
            for span in spans:
                entry = tier.remove(span.key)
                if entry is None:
                    break
                removed.append(entry.meta)
                dropped_end = span.end
            self._emit(removal_events(tier, removed))
        return dropped_end

    # ---- compression ----
    def compress(
        self,
        tokens: Tokens,
        method: str,
        location: str = "LocalCPUBackend",
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> int:
        """Replace the chunks of `tokens` at `location` by their `method`-encoded form.

        Returns the tokens affected (chunks already in that form count)."""
        codec = get_codec(method)

        def encode(kv: torch.Tensor) -> torch.Tensor:
            blob = codec.encode(kv, layer_offset=0, total_layers=self.num_layers)
            return torch.frombuffer(bytearray(blob), dtype=torch.uint8)

        return self._recode(
            tokens, location, cache_salt, lora, from_fmt="raw", to_fmt=method, transform=encode
        )

    def decompress(
        self,
        tokens: Tokens,
        method: str,
        location: str = "LocalCPUBackend",
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> int:
        """Restore the `method`-encoded chunks of `tokens` at `location` to raw KV.

        Returns the tokens affected (chunks already raw count)."""
        get_codec(method)  # an unknown method is refused before anything changes

        def to_raw(kv: torch.Tensor) -> torch.Tensor:
            return kv.to(self.dtype).contiguous().view(torch.uint8).reshape(-1)

        return self._recode(
            tokens, location, cache_salt, lora, from_fmt=method, to_fmt="raw", transform=to_raw
        )

    def _recode(
        self,
        tokens: Tokens,
        location: str,
        cache_salt: str | None,
        lora: str | None,
        *,
        from_fmt: str,
        to_fmt: str,
        transform: Callable[[torch.Tensor], torch.Tensor],
    ) -> int:
        tier = self._tier(location)
        spans = self._spans(checked_tokens(tokens), cache_salt, lora)
        affected = 0
        for span in spans:
            with self._lock:
                entry = tier.get(span.key)
                if entry is None:
                    break
                if entry.meta.fmt == to_fmt:
                    affected += span.num_tokens
                    continue
                if entry.meta.fmt != from_fmt:
                    break
                tier.acquire(entry)
            try:
                payload = transform(self.layout.chunk_view(self._read_payload(tier, entry), entry.meta))
                with self._lock:
                    # The old entry stays referenced until the new one is written: no window without
                    # data. The chunk keeps its key, so its replacement is not announced again.
                    write = ChunkWrite(self._state, tier, dropped_by_clear=False)
                    replacement = write.reserve(
                        ChunkMeta.of_span(span, entry.meta.token_ids, to_fmt, cache_salt), payload.numel()
                    )
                    write.announce_evictions()
                if replacement is None:
                    break
                with write.copying():
                    self._write_payload(tier, replacement, payload)
                with self._lock:
                    write.commit()
            finally:
                with self._lock:
                    tier.release(entry)
            affected += span.num_tokens
        return affected

    # ---- introspection ----
    def stats(self) -> dict[str, Any]:
        with self._lock:
            stats: dict[str, Any] = dict(self.counters)
            stats["cpu_chunks"] = self.cpu.num_chunks
            stats["cpu_evicted_chunks"] = self.cpu.evicted_chunks
            stats["cpu_usage_ratio"] = self.cpu.usage_ratio
            if self.cpu.ledger is not None:
                stats["cpu_tenant_usage"] = self.cpu.ledger.report()
                stats["cpu_tenant_refused_chunks"] = self.cpu.ledger.refused_chunks
            if self.disk is not None:
                stats["disk_chunks"] = self.disk.num_chunks
                stats["disk_evicted_chunks"] = self.disk.evicted_chunks
                stats["disk_used_bytes"] = self.disk.used_bytes
        if self.remote is not None:
            stats.update(self.remote.stats())
        if self.remote_truth is not None:
            stats.update(self.remote_truth.stats())
        if self._remote_writer is not None and self._remote_writer.quota is not None:
            stats["remote_tenant_usage"] = self._remote_writer.quota.report()
        return stats
