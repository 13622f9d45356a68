"""L2: chunks as files in a local directory, surviving a restart of the process.

One file per chunk, `<key as 16 hex digits>-<random>.kvchunk` (the random part keeps a reader of
a removed chunk from racing a new write of the same key): the magic, a 4-byte little-endian header
length, a msgpack header (key, parent, token ids, format, geometry) and the payload bytes. Files
are written to a temporary name and renamed into place, so a crash never leaves a half chunk
under a real name; on start the index is rebuilt from the headers (oldest file first in the
eviction order) and leftover temporary files are deleted.

Chunks reach the disk behind the store (`DiskWriter`): one thread copies what a store committed to
the CPU pool into this tier, so a store returns after its CPU copy.
"""

from __future__ import annotations

import logging
import os
import struct
import uuid
from array import array
from pathlib import Path

import msgspec
import numpy as np
import torch

from cachelayer.storage.chunk_write import ChunkWrite, TierState
from cachelayer.storage.cpu import CpuTier
from cachelayer.storage.tier import ChunkMeta, Tier, TierEntry
from cachelayer.storage.write_behind import WriteBehind

log = logging.getLogger(__name__)

MAGIC = b"KVCHUNK1"
SUFFIX = ".kvchunk"


class _Header(msgspec.Struct, kw_only=True):
    key: int
    parent_key: int | None
    token_ids: list[int]
    fmt: str
    num_layers: int
    channels: int
    dtype: str
    nbytes: int
    # Which engine wrote it (model, world size, worker): engines may share a directory (tensor-
    # parallel workers often do); each indexes, counts and evicts only its own files.
    owner: str = ""


class DiskTier(Tier):
    name = "LocalDiskBackend"
    medium = "disk"

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        cache_policy: str,
        *,
        num_layers: int,
        channels: int,
        dtype: str,
        owner: str = "",
    ) -> None:
        super().__init__(cache_policy)
        self.owner = owner
        self.directory = directory
        self.capacity = capacity_bytes
        self.used_bytes = 0
        self._geometry = (num_layers, channels, dtype)
        directory.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()

    def path_of(self, entry: TierEntry) -> Path:
        path = entry.extra.get("path")
        if path is None:
            path = entry.extra["path"] = (
                self.directory / f"{entry.meta.key:016x}-{uuid.uuid4().hex[:12]}{SUFFIX}"
            )
        return path

    def _allocate(self, nbytes: int) -> int | None:
        if self.used_bytes + nbytes > self.capacity:
            return None
        self.used_bytes += nbytes
        return 0

    def _release_space(self, entry: TierEntry) -> None:
        self.used_bytes -= entry.nbytes
        if "path" in entry.extra:
            entry.extra["path"].unlink(missing_ok=True)

    # ---- data (called without the engine lock, with a reference held) ----
    def write(self, entry: TierEntry, payload: torch.Tensor) -> None:
        """Write the entry's file atomically; payload is a flat uint8 tensor on the CPU."""
        meta = entry.meta
        num_layers, channels, dtype = self._geometry
        header = msgspec.msgpack.encode(
            _Header(
                key=meta.key,
                parent_key=meta.parent_key,
                token_ids=list(meta.token_ids),
                fmt=meta.fmt,
                num_layers=num_layers,
                channels=channels,
                dtype=dtype,
                nbytes=entry.nbytes,
                owner=self.owner,
            )
        )
        final = self.path_of(entry)
        temporary = final.with_name(f"{final.name}.tmp")
        try:
            with open(temporary, "wb") as file:
                file.write(MAGIC + struct.pack("<I", len(header)) + header)
                file.write(memoryview(payload.numpy()))
            os.replace(temporary, final)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        entry.extra["payload_offset"] = len(MAGIC) + 4 + len(header)

    def read_into(self, entry: TierEntry, destination: torch.Tensor) -> None:
        """Fill a flat uint8 CPU tensor of entry.nbytes with the payload, without an extra copy."""
        with open(self.path_of(entry), "rb") as file:
            file.seek(entry.extra["payload_offset"])
            read = file.readinto(memoryview(destination.numpy()))
        if read != entry.nbytes:
            raise OSError(f"{self.path_of(entry)}: truncated chunk file ({read} of {entry.nbytes} bytes)")

    def read_bytes(self, entry: TierEntry) -> torch.Tensor:
        buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
        self.read_into(entry, buffer)
        return buffer

    # ---- restart ----
    def _rebuild_index(self) -> None:
        for leftover in self.directory.glob(f"*{SUFFIX}.tmp"):
            leftover.unlink(missing_ok=True)
        found: list[tuple[float, _Header, int, Path]] = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                with open(path, "rb") as file:
                    if file.read(len(MAGIC)) != MAGIC:
                        raise ValueError("not a chunk file")
                    (length,) = struct.unpack("<I", file.read(4))
                    header = msgspec.msgpack.decode(file.read(length), type=_Header)
                size = path.stat().st_size
                payload_offset = len(MAGIC) + 4 + length
                if size != payload_offset + header.nbytes:
                    raise ValueError(f"size {size} does not match its header")
            except (OSError, ValueError, struct.error, msgspec.DecodeError) as exc:
                log.warning("cachelayer disk tier: removing unreadable chunk file %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            if (
                header.num_layers,
                header.channels,
                header.dtype,
            ) != self._geometry or header.owner != self.owner:
                continue  # another engine's chunk sharing the directory: not ours, left alone
            found.append((path.stat().st_mtime, header, payload_offset, path))
        for _, header, payload_offset, path in sorted(found, key=lambda item: item[0]):
            meta = ChunkMeta(header.key, header.parent_key, array("q", header.token_ids), header.fmt)
            # A newer file of the same key replaces the older one (commit drops the previous entry).
            entry, _ = self.reserve(meta, header.nbytes)
            if entry is None:
                path.unlink(missing_ok=True)
                continue
            entry.extra["path"] = path
            entry.extra["payload_offset"] = payload_offset
            self.commit(entry)


class DiskWriter:
    """Copies the chunks a store committed to the CPU pool into the disk tier, in one writer thread
    (an unbounded queue: a store never waits for the disk). A chunk that left the pool meanwhile, is
    on disk already, or was stored before a clear() is skipped: the disk tier is a best-effort copy,
    not a journal. A disk full of pinned or in-use chunks, or a failed file write, keeps the chunk
    in the pool only (logged)."""

    def __init__(self, disk: DiskTier, source: CpuTier, state: TierState) -> None:
        self.disk = disk
        self._source = source
        self._state = state
        self._behind = WriteBehind(self._write_batch, name="cachelayer-disk", what="the disk tier")

    def submit(self, metas: list[ChunkMeta]) -> None:
        """Queue the chunks of one store for the disk (called once they are committed to the pool)."""
        with self._state.lock:
            generation = self._state.generation
        self._behind.submit(generation, metas)

    def flush(self) -> None:
        """Wait until every chunk submitted so far was written to disk (or skipped)."""
        self._behind.flush()

    def close(self) -> None:
        """Write what is pending, then stop the thread."""
        self._behind.close()

    def _write_batch(self, generation: int, metas: list[ChunkMeta]) -> None:
        disk, source, state = self.disk, self._source, self._state
        for meta in metas:
            with state.lock:
                if generation != state.generation:
                    return
                chunk = source.get(meta.key)
                if chunk is None or disk.has_key(meta.key):
                    continue
                source.acquire(chunk)  # held while it is copied: never evicted under the copy
                write = ChunkWrite(state, disk)
                target = write.reserve(
                    ChunkMeta(
                        meta.key,
                        meta.parent_key,
                        meta.token_ids,
                        chunk.meta.fmt,
                        meta.cache_salt,
                        meta.tenant,
                    ),
                    chunk.nbytes,
                )
                write.announce_evictions()
            try:
                if target is None:
                    log.warning(
                        "cachelayer: disk tier full of pinned or in-use chunks; chunk %#x kept in CPU only",
                        meta.key,
                    )
                    continue
                try:
                    with write.copying():
                        disk.write(target, source.view(chunk))
                except OSError as exc:
                    log.error("cachelayer: writing chunk %#x to %s failed: %s", meta.key, disk.directory, exc)
                    continue
                with state.lock:
                    state.emit(write.commit())
                    if write.cleared:  # so is the rest of the batch
                        return
            finally:
                with state.lock:
                    source.release(chunk)


def as_bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))
