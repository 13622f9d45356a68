"""How an engine's chunks travel to and from the remote tier (cachelayer.storage.remote): written
behind the store (`RemoteWriter`), and promoted into L1 for a retrieve (`promote_from_remote`).

Beside remote.py, which speaks Redis and the value format and needs no torch (the config's checks
import it), this is the engine's side: the CPU pool, the write transaction, the KV layout.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from cachelayer.compress import codec_names, get_codec
from cachelayer.config import CacheLayerConfig, TenantQuotas
from cachelayer.keys import ChunkSpan
from cachelayer.kv_layout import KVLayout
from cachelayer.shared_secret import remote_tier_secret
from cachelayer.storage.chunk_write import ChunkWrite, TierState, stored_event
from cachelayer.storage.cpu import CpuTier
from cachelayer.storage.remote import (
    MAX_TRAILER_BYTES,
    ChunkValue,
    CorruptValue,
    RemoteTier,
    UnauthenticatedValue,
    UnverifiableValue,
)
from cachelayer.storage.remote_quota import MAX_REMOVED, RemoteQuota
from cachelayer.storage.remote_truth import RemoteTruth
from cachelayer.storage.tier import ChunkMeta, TierEntry
from cachelayer.storage.write_behind import WriteBehind

log = logging.getLogger(__name__)


def remote_tier_for(config: CacheLayerConfig, layout: KVLayout) -> RemoteTier:
    """The tier at `config.remote_url` as an engine of `layout` sees it: its keys, deadlines,
    breaker and secret from the config."""
    assert config.remote_url is not None
    return RemoteTier(
        config.remote_url,
        # What decides whether two engines can read each other's bytes, beyond the chunk key.
        layout=(layout.num_layers, layout.channels, layout.dtype_name, config.pre_caching_hash_algorithm),
        timeout_s=config.remote_call_timeout_s,
        min_transfer_bytes_per_s=config.remote_min_transfer_mb_per_s * (1 << 20),
        failure_threshold=config.remote_failure_threshold,
        retry_after_s=config.remote_retry_after_s,
        secret=remote_tier_secret(
            config.remote_url,
            config.remote_auth_secret_env,
            config.remote_authenticate_values,
            config.remote_allow_unauthenticated,
        ),
    )


class RemoteWriter:
    """Copies the chunks a store committed to the CPU pool into the remote tier, behind the store:
    one writer thread, a queue of at most `max_batches` batches (a full queue drops the batch and
    counts it: a store never waits for Redis). Each batch asks Redis which chunks it lacks (another
    engine may have written them) and SETs those in one round trip, each value sent from its L1
    bytes (encoded first with `serde: cachegen`). A chunk that left L1 meanwhile, or was stored
    before a clear(), is skipped: the remote tier is a best-effort copy."""

    def __init__(
        self,
        remote: RemoteTier,
        source: CpuTier,
        state: TierState,
        layout: KVLayout,
        *,
        serde: str,
        max_batches: int,
        truth: RemoteTruth | None = None,
        quotas: TenantQuotas | None = None,
    ) -> None:
        """`quotas`: per-tenant caps; those with a remote share below 1 are enforced on each write."""
        self.remote = remote
        self.quota = RemoteQuota(remote, quotas) if quotas is not None and quotas.limits_remote else None
        # Remembers what this writer announced, to retract what Redis loses (remote_truth.py).
        self._truth = truth
        self._source = source
        self._state = state
        self._layout = layout
        self._serde = serde
        self._behind = WriteBehind(
            self._write_batch, name="cachelayer-remote", what="the remote tier", max_batches=max_batches
        )

    def submit(self, metas: list[ChunkMeta]) -> None:
        """Queue the chunks of one store for the remote tier (called once they are committed to L1)."""
        with self._state.lock:
            generation = self._state.generation
        if not self._behind.submit(generation, metas):
            self.remote.note_dropped_write(len(metas))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every chunk submitted so far was written (or dropped); False when `timeout_s`
        passed first."""
        return self._behind.flush(timeout_s)

    def close(self) -> None:
        """Write what is pending (30 s at most), then stop the thread."""
        self._behind.close(flush_timeout_s=30)

    def _write_batch(self, generation: int, metas: list[ChunkMeta]) -> None:
        remote, source, state, layout = self.remote, self._source, self._state, self._layout
        missing = remote.missing([meta.key for meta in metas])
        if missing is None:  # remote down: not written (a later store of the prompt retries)
            remote.note_dropped_write(len(metas))
            return
        wanted = set(missing)
        values: list[tuple[int, list[Any]]] = []
        held: list[TierEntry] = []
        written: list[ChunkMeta] = []
        quota = self.quota
        try:
            for meta in metas:
                if meta.key not in wanted:
                    continue
                with state.lock:
                    if generation != state.generation:
                        return
                    entry = source.get(meta.key)
                    if entry is None:
                        continue
                    # Held until sent: the value goes to the socket straight from the L1 bytes.
                    source.acquire(entry)
                    held.append(entry)
                payload: Any = source.view(entry).numpy()
                fmt = entry.meta.fmt
                if fmt == "raw" and self._serde == "cachegen":
                    kv = layout.chunk_view(source.view(entry), entry.meta)
                    payload = get_codec("cachegen").encode(kv, layer_offset=0, total_layers=layout.num_layers)
                    fmt = "cachegen"
                trailer = remote.value_trailer(
                    meta.key,
                    payload,
                    codec=fmt,
                    dtype=layout.dtype_name,
                    num_layers=layout.num_layers,
                    num_tokens=meta.num_tokens,
                    channels=layout.channels,
                )
                values.append((meta.key, [memoryview(payload).cast("B"), trailer]))
                written.append(meta)
            if quota is not None:
                self._write_within_quota(quota, values, written)
            elif values and remote.put(values):
                self._announce(written, [])
        finally:
            with state.lock:
                for entry in held:
                    source.release(entry)

    def _write_within_quota(
        self, quota: RemoteQuota, values: list[tuple[int, list[Any]]], written: list[ChunkMeta]
    ) -> None:
        """Write the chunks their tenants' caps allow, and account for them in the same round trip;
        retract what the accounting removed to stay within a cap."""
        sizes = [sum(memoryview(piece).nbytes for piece in pieces) for _, pieces in values]
        batch = [(meta.tenant, meta.key, size) for meta, size in zip(written, sizes, strict=True)]
        commands, tenants, refused = quota.commands(batch)
        if refused:
            self.remote.note_dropped_write(len(refused))
            values = [value for value in values if value[0] not in refused]
            written = [meta for meta in written if meta.key not in refused]
        replies = self.remote.put_with(values, commands, max_items=MAX_REMOVED + 1) if values else None
        if replies is not None:
            removed = quota.removed(tenants, replies)
            gone = set(removed)
            self._announce([meta for meta in written if meta.key not in gone], removed)

    def _announce(self, written: list[ChunkMeta], removed: list[int]) -> None:
        """BlockStored for what this write put in Redis; BlockRemoved for what it took out that this
        engine had announced."""
        with self._state.lock:
            self._state.emit([stored_event(self.remote, meta) for meta in written])
            if self._truth is not None:
                self._truth.announced(meta.key for meta in written)
                if removed:
                    self._truth.lost(removed, by="quota")


def promote_from_remote(
    remote: RemoteTier,
    spans: Sequence[ChunkSpan],
    token_ids: Sequence[int],
    *,
    into: CpuTier,
    state: TierState,
    layout: KVLayout,
    truth: RemoteTruth | None = None,
    cache_salt: str | None = None,
) -> None:
    """Fetch the chunks of `spans` (those after the local prefix) from the remote tier in one round
    trip and put the leading ones that check out into L1 (`into`), for the retrieve that follows. A
    value that fails its check is a miss and is deleted from the remote tier; one this engine cannot
    verify (no secret) is a miss and is kept."""
    if not spans:
        return
    # No value larger than its chunk can be is read (an encoded chunk's worst case is twice raw).
    limits = [2 * layout.raw_nbytes(span.num_tokens) + MAX_TRAILER_BYTES for span in spans]
    values = remote.fetch([span.key for span in spans], limits)
    accepted: list[tuple[ChunkSpan, memoryview, str]] = []
    for span, value in zip(spans, values, strict=True):
        if value is None:
            break
        try:
            if isinstance(value, CorruptValue):
                raise value
            chunk = remote.decode(value, span.key)
            _check_chunk(chunk, span, layout)
        except UnverifiableValue as exc:  # usable by the engines that hold the secret: kept
            log.error("cachelayer: remote chunk %#x not loaded (%s); treated as a miss", span.key, exc)
            remote.note_corrupt(unauthenticated=True)
            break
        except CorruptValue as exc:
            log.error("cachelayer: remote chunk %#x rejected (%s); deleted, treated as a miss", span.key, exc)
            remote.note_corrupt(unauthenticated=isinstance(exc, UnauthenticatedValue))
            remote.delete(span.key)
            if truth is not None:
                truth.lost([span.key])
            break
        accepted.append((span, chunk.payload, chunk.codec))
    remote.note_lookup(len(accepted), len(spans) - len(accepted))
    if not accepted:
        return
    reserved: list[tuple[TierEntry, memoryview]] = []
    with state.lock:
        write = ChunkWrite(state, into)
        for span, payload, codec in accepted:
            if into.has_key(span.key):
                continue
            tokens = array("q", token_ids[span.start : span.end])
            meta = ChunkMeta.of_span(span, tokens, codec, cache_salt)
            entry = write.reserve(meta, payload.nbytes)
            if entry is None:
                break
            reserved.append((entry, payload))
        write.announce_evictions()
    with write.copying():
        for entry, payload in reserved:
            np.copyto(into.view(entry).numpy(), np.frombuffer(payload, dtype=np.uint8))
    with state.lock:
        state.emit(write.commit())


def _check_chunk(chunk: ChunkValue, span: ChunkSpan, layout: KVLayout) -> None:
    """Refuse a remote chunk of another geometry, dtype or an unknown codec (CorruptValue)."""
    geometry = (chunk.num_layers, chunk.num_tokens, chunk.channels)
    expected = (layout.num_layers, span.num_tokens, layout.channels)
    if geometry != expected or chunk.dtype != layout.dtype_name:
        raise CorruptValue(
            f"holds [layers, tokens, channels] {list(geometry)} in {chunk.dtype}, expected "
            f"{list(expected)} in {layout.dtype_name}"
        )
    if chunk.codec == "raw":
        if chunk.payload.nbytes != layout.raw_nbytes(span.num_tokens):
            raise CorruptValue(f"raw payload of {chunk.payload.nbytes} bytes for {span.num_tokens} tokens")
    elif chunk.codec not in codec_names():
        raise CorruptValue(f"unknown codec {chunk.codec!r}")
