"""Worker-side moves of the vLLM connector, free of vLLM imports: paged KV <-> the store's chunks.

`PagedKV` turns a request's blocks into the cache engine's chunk tensor
`[num_layers, 2, num_tokens, channels]` and back, through cachelayer.gpu (one interface for
every layout):
- `cpu_blocks` (vLLM's CPU backend, [num_blocks, num_kv_heads, block_size, 2 * head_dim] with K
  transposed inside a block): whole blocks are copied. Each block's bytes are split in two
  halves that fill plane 0 and plane 1 of the chunk's rows for that block's tokens, so a chunk
  of the store (a token range on block boundaries) always holds exactly its own blocks. The
  bytes are the engine's own, so readers must share the layout: it is part of the key space.
- `flash_attn` / `flashinfer` (CUDA): token by token through slot_mapping, so the chunk holds
  plain K and V rows.

`ChunkStore` is what the worker stores to: the in-process `CacheEngine` (`LocalChunkStore`) or
the shared daemon (`RemoteChunkStore`). Both report the chunks a store added or evicted.

`BackgroundSaver` keeps saves off the step that computed the prompt: the step copies the
request's blocks out of the paged cache (one copy, `PagedKV.snapshot`), and a background thread
turns that snapshot into chunks and stores them. Once copied out, the blocks may be freed,
preempted or reused at once: nothing later reads them. `store_now` is the synchronous save of a
handoff (a prefill whose decode runs on another engine): it returns once the store holds it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from cachelayer import gpu
from cachelayer.connectors.planning import LoadSpec
from cachelayer.engine import CacheEngine
from cachelayer.server.client import StoreClient, StoreUnavailable
from cachelayer.server.daemon import store_with_events
from cachelayer.server.protocol import ChunkEvent, KeySpace

log = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("cpu_blocks", "flash_attn", "flashinfer")


def detect_layout(layer: Tensor, *, num_kv_heads: int, head_dim: int, block_size: int) -> str:
    """Name the layout of one layer's KV tensor from its shape; raise ValueError if unsupported."""
    shape = tuple(layer.shape)
    if len(shape) == 4 and shape[1:] == (num_kv_heads, block_size, 2 * head_dim):
        return "cpu_blocks"
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (block_size, num_kv_heads, head_dim):
        return "flash_attn"
    if len(shape) == 5 and shape[1] == 2 and shape[2:] == (block_size, num_kv_heads, head_dim):
        return "flashinfer"
    raise ValueError(
        f"unsupported KV cache layout {list(shape)} (block_size={block_size}, num_kv_heads="
        f"{num_kv_heads}, head_dim={head_dim}): the connector handles {', '.join(SUPPORTED_LAYOUTS)}"
    )


class PagedKV:
    """The engine's paged KV of every layer, read and written in whole blocks of a request."""

    def __init__(
        self, kv_caches: Sequence[Tensor], *, layout: str, block_size: int, num_kv_heads: int, head_dim: int
    ):
        if layout not in SUPPORTED_LAYOUTS:
            raise ValueError(f"layout {layout!r} is not one of {', '.join(SUPPORTED_LAYOUTS)}")
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self.block_size = block_size
        self.num_layers = len(self.kv_caches)
        self.channels = num_kv_heads * head_dim
        self.dtype = self.kv_caches[0].dtype
        self.device = self.kv_caches[0].device

    def _block_tensor(self, block_ids: Sequence[int]) -> Tensor:
        return torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)

    def _slot_mapping(self, block_ids: Sequence[int], skip_blocks: int = 0) -> Tensor:
        blocks = self._block_tensor(block_ids)
        offsets = torch.arange(self.block_size, device=self.device)
        slots = (blocks[:, None] * self.block_size + offsets[None, :]).reshape(-1)
        if skip_blocks:
            slots[: skip_blocks * self.block_size] = -1
        return slots

    def gather(self, block_ids: Sequence[int]) -> Tensor:
        """The chunk [num_layers, 2, len(block_ids) * block_size, channels] of these blocks, on the CPU."""
        return self.chunk_from_snapshot(self.snapshot(block_ids))

    def snapshot(self, block_ids: Sequence[int]) -> Tensor:
        """These blocks' KV copied out of the paged cache (one copy, on the CPU), in the layout
        `chunk_from_snapshot` turns into a chunk; the blocks may be reused once this returns."""
        if self.layout == "cpu_blocks":
            blocks = torch.empty(
                gpu.block_chunk_shape(self.kv_caches, self.layout, len(block_ids)), dtype=self.dtype
            )
            gpu.gather_blocks(self.kv_caches, self.layout, self._block_tensor(block_ids), blocks)
            return blocks
        host = torch.empty(
            self.num_layers,
            2,
            len(block_ids) * self.block_size,
            self.channels,
            dtype=self.dtype,
            pin_memory=self.device.type == "cuda",
        )
        gpu.store(self.kv_caches, self.layout, self._slot_mapping(block_ids), host, check_range=False).wait()
        return host

    def chunk_from_snapshot(self, snapshot: Tensor) -> Tensor:
        """The chunk [num_layers, 2, num_tokens, channels] of a `snapshot`."""
        if self.layout != "cpu_blocks":
            return snapshot
        num_blocks = snapshot.numel() // (self.num_layers * 2 * self.block_size * self.channels)
        halves = snapshot.view(self.num_layers, num_blocks, 2, self.block_size, self.channels)
        return halves.permute(0, 2, 1, 3, 4).reshape(
            self.num_layers, 2, num_blocks * self.block_size, self.channels
        )

    def scatter(self, chunk: Tensor, block_ids: Sequence[int], *, skip_blocks: int = 0) -> None:
        """Write chunk (tokens of block_ids, in order) into the cache, leaving the first skip_blocks alone."""
        self.start_load(chunk, block_ids, skip_blocks=skip_blocks).finish()

    def start_load(
        self, chunk: Tensor, block_ids: Sequence[int], *, skip_blocks: int = 0, layerwise: bool = False
    ) -> ChunkLoad:
        """Begin writing chunk into the cache; its layers land as `ChunkLoad.load_layer` asks.
        `layerwise`: copy in small leading groups (1, 1, 2, 4, ... layers) so the first layers
        land early; else in two copies, the larger first (fewer, larger copies)."""
        groups = gpu.layer_groups(self.num_layers, "doubling" if layerwise else None, growing=layerwise)
        return ChunkLoad(self, chunk, block_ids, skip_blocks, groups)


class ChunkLoad:
    """One stored chunk on its way into the paged cache, layer by layer: `load_layer(i)` makes
    layer i hold it (on CUDA: the compute stream waits for that layer's copy, queued at the start
    on a side stream, so early layers' attention runs while later layers still copy); `finish()`
    loads the layers nobody asked for and waits for all of them."""

    def __init__(
        self,
        paged: PagedKV,
        chunk: Tensor,
        block_ids: Sequence[int],
        skip_blocks: int,
        groups: list[tuple[int, int]],
    ) -> None:
        num_blocks = len(block_ids)
        if chunk.shape[2] != num_blocks * paged.block_size:
            raise ValueError(
                f"chunk has {chunk.shape[2]} tokens, {num_blocks} blocks need {num_blocks * paged.block_size}"
            )
        self._paged = paged
        self._loaded = [False] * paged.num_layers
        self._loader: gpu.LayerwiseLoader | None = None
        if paged.layout == "cpu_blocks":
            halves = chunk.reshape(paged.num_layers, 2, num_blocks, paged.block_size, paged.channels)
            blocks = halves.permute(0, 2, 1, 3, 4).contiguous()
            self._blocks = blocks.view(gpu.block_chunk_shape(paged.kv_caches, paged.layout, num_blocks))
            self._block_ids = paged._block_tensor(block_ids)
            self._block_ids[:skip_blocks] = -1
            return
        host = chunk.contiguous()
        if paged.device.type == "cuda" and not host.is_pinned():
            host = host.pin_memory()
        self._loader = gpu.LayerwiseLoader(
            host,
            paged.kv_caches,
            paged.layout,
            paged._slot_mapping(block_ids, skip_blocks),
            groups=groups,
            check_range=False,
        )
        self._loader.start()

    def load_layer(self, layer: int) -> None:
        if not self._loaded[layer]:
            self._load_layers(layer, layer + 1)

    def _load_layers(self, start: int, stop: int) -> None:
        """Load layers start..stop-1 (none loaded yet); whole blocks go in one copy for the range."""
        self._loaded[start:stop] = [True] * (stop - start)
        if self._loader is not None:
            for layer in range(start, stop):
                self._loader.wait_for_layer(layer)  # a no-op for a layer its group already landed
            return
        paged = self._paged
        gpu.scatter_blocks(
            self._blocks[start:stop], paged.kv_caches[start:stop], paged.layout, self._block_ids
        )

    def finish(self) -> int:
        """Load every layer not loaded yet (each run of them at once) and wait until the cache
        holds the chunk; returns how many layers only this call loaded (0 when `load_layer` was
        asked for each in time)."""
        late = self._loaded.count(False)
        runs = [(loaded, len(list(run))) for loaded, run in itertools.groupby(self._loaded)]
        start = 0
        for loaded, length in runs:
            if not loaded:
                self._load_layers(start, start + length)
            start += length
        if self._loader is not None:
            self._loader.finish().wait()
        return late


HeldChunk = tuple[int, int, Tensor]  # tokens [start, end) and their KV [num_layers, 2, end - start, channels]


class ChunkStore(Protocol):
    def lookup(self, tokens: Sequence[int], cache_salt: str | None) -> int: ...

    def held_chunks(
        self, tokens: Sequence[int], cache_salt: str | None
    ) -> contextlib.AbstractContextManager[list[HeldChunk]]:
        """The longest held prefix of tokens, readable inside the block."""
        ...

    def store(
        self, tokens: Sequence[int], kv: Tensor, cache_salt: str | None
    ) -> tuple[int, list[ChunkEvent]]: ...

    def retrieve(self, tokens: Sequence[int], cache_salt: str | None) -> tuple[int, Tensor | None]: ...

    def flush_remote(self, timeout_s: float) -> bool:
        """Wait until what was stored has reached the remote tier (if any); False on timeout."""
        ...


class LocalChunkStore:
    """The worker's own CacheEngine (in-process mode)."""

    def __init__(self, engine: CacheEngine) -> None:
        self.engine = engine

    def lookup(self, tokens: Sequence[int], cache_salt: str | None) -> int:
        return self.engine.lookup(tokens, cache_salt=cache_salt)

    def store(
        self, tokens: Sequence[int], kv: Tensor, cache_salt: str | None
    ) -> tuple[int, list[ChunkEvent]]:
        return store_with_events(self.engine, tokens, kv, cache_salt)

    def retrieve(self, tokens: Sequence[int], cache_salt: str | None) -> tuple[int, Tensor | None]:
        return self.engine.retrieve(tokens, cache_salt=cache_salt)

    def flush_remote(self, timeout_s: float) -> bool:
        return self.engine.flush_remote(timeout_s)

    @contextlib.contextmanager
    def held_chunks(self, tokens: Sequence[int], cache_salt: str | None) -> Iterator[list[HeldChunk]]:
        # retrieve, not the pool's views: it also promotes chunks from disk and decodes compressed ones.
        hit, kv = self.retrieve(tokens, cache_salt)
        yield [(0, hit, kv)] if kv is not None else []


class RemoteChunkStore:
    """The shared daemon, over its ZMQ data plane (daemon mode)."""

    def __init__(self, client: StoreClient, space: KeySpace) -> None:
        self.client = client
        self.space = space

    def lookup(self, tokens: Sequence[int], cache_salt: str | None) -> int:
        return self.client.lookup(self.space, list(tokens), cache_salt=cache_salt)

    def store(
        self, tokens: Sequence[int], kv: Tensor, cache_salt: str | None
    ) -> tuple[int, list[ChunkEvent]]:
        return self.client.store(self.space, list(tokens), kv, cache_salt=cache_salt)

    def retrieve(self, tokens: Sequence[int], cache_salt: str | None) -> tuple[int, Tensor | None]:
        return self.client.retrieve(self.space, list(tokens), cache_salt=cache_salt)

    def flush_remote(self, timeout_s: float) -> bool:
        # The daemon is the store every engine attached to it reads: a store it answered is
        # visible to all of them. (Its own remote tier, if any, is written behind it.)
        return True

    @contextlib.contextmanager
    def held_chunks(self, tokens: Sequence[int], cache_salt: str | None) -> Iterator[list[HeldChunk]]:
        """On the same host, views of the daemon's pool under a lease (read in place, no copy into
        an intermediate tensor); LeaseExpired at the end if the daemon ended the lease first."""
        if self.client.transport != "shm":
            hit, kv = self.retrieve(tokens, cache_salt)
            yield [(0, hit, kv)] if kv is not None else []
            return
        with self.client.leased(self.space, list(tokens), cache_salt=cache_salt) as lease:
            yield [(chunk.start, chunk.end, chunk.kv) for chunk in lease.chunks]


class RequestLoad:
    """A request's stored prefix on its way into its blocks over one forward pass.

    The store's chunks stay held (leased, in daemon mode) from the start until `finish`, so the
    daemon cannot reuse them while layers are still being copied. A shorter hit than planned
    (evicted meanwhile), an unreachable store, or a lease the daemon ended before `finish` fails
    the blocks past what was loaded, so vLLM recomputes them instead of reading whatever they hold.
    """

    def __init__(
        self,
        paged: PagedKV,
        store: ChunkStore,
        *,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        first_block: int,
        cache_salt: str | None,
        layerwise: bool = False,
    ) -> None:
        block_size = paged.block_size
        self._paged_block_size = block_size
        self._wanted_blocks = list(block_ids[: len(token_ids) // block_size])
        self._first_block = first_block
        self._loaded_blocks = 0
        self._loads: list[ChunkLoad] = []
        self._held = contextlib.ExitStack()
        try:
            chunks = self._held.enter_context(store.held_chunks(token_ids, cache_salt))
            for start, end, kv in chunks:
                if start != self._loaded_blocks * block_size:
                    break  # not contiguous with what is loaded: stop here
                blocks = self._wanted_blocks[self._loaded_blocks : end // block_size]
                skip = min(len(blocks), max(0, first_block - self._loaded_blocks))
                if skip < len(blocks):
                    chunk = kv[:, :, : len(blocks) * block_size]
                    self._loads.append(paged.start_load(chunk, blocks, skip_blocks=skip, layerwise=layerwise))
                self._loaded_blocks += len(blocks)
                if end % block_size:
                    break
        except StoreUnavailable as exc:
            self._failed(exc)

    @classmethod
    def of(cls, paged: PagedKV, store: ChunkStore, load: LoadSpec, *, layerwise: bool = False) -> RequestLoad:
        """Start the load the scheduler planned (`load`) from `store` into `paged`."""
        return cls(
            paged,
            store,
            token_ids=load.token_ids,
            block_ids=load.block_ids,
            first_block=load.first_block,
            cache_salt=load.cache_salt,
            layerwise=layerwise,
        )

    def load_layer(self, layer: int) -> None:
        """Make layer `layer` of every loaded block hold its KV (before that layer's attention)."""
        for load in self._loads:
            load.load_layer(layer)

    def finish(self, *, layers_awaited: bool = False) -> set[int]:
        """Load what is left, let the store's chunks go; returns the block ids that could not be
        loaded. `layers_awaited`: the engine was to call `load_layer` before each layer's attention;
        a layer it did not ask for was read before it held the KV, so the blocks fail."""
        late_layers = 0
        try:
            for load in self._loads:
                late_layers = max(late_layers, load.finish())
            self._held.close()
        except StoreUnavailable as exc:  # LeaseExpired included: what was loaded may be wrong
            self._failed(exc)
        if layers_awaited and late_layers and self._loaded_blocks:
            log.warning(
                "cachelayer: %d layers were not waited for before attention read them: "
                "their blocks are recomputed",
                late_layers,
            )
            self._loaded_blocks = 0
        self.late_layers = late_layers
        return set(self._wanted_blocks[max(self._loaded_blocks, self._first_block) :])

    def loaded_tokens(self, failed: set[int]) -> int:
        """Tokens that landed past the engine's own hit: the planned blocks up to the first failed."""
        landed = 0
        for block in self._wanted_blocks[self._first_block :]:
            if block in failed:
                break
            landed += 1
        return landed * self._paged_block_size

    def _failed(self, exc: StoreUnavailable) -> None:
        log.warning("cachelayer: load failed, vLLM will recompute: %s", exc)
        self._loaded_blocks = 0
        with contextlib.suppress(StoreUnavailable):
            self._held.close()


def load_request(
    paged: PagedKV,
    store: ChunkStore,
    *,
    token_ids: Sequence[int],
    block_ids: Sequence[int],
    first_block: int,
    cache_salt: str | None,
) -> set[int]:
    """Load a request's stored prefix into its blocks at once; returns the block ids that could
    not be loaded (see RequestLoad)."""
    return RequestLoad(
        paged, store, token_ids=token_ids, block_ids=block_ids, first_block=first_block, cache_salt=cache_salt
    ).finish()


def save_request(
    paged: PagedKV,
    store: ChunkStore,
    *,
    token_ids: Sequence[int],
    block_ids: Sequence[int],
    cache_salt: str | None,
) -> list[ChunkEvent]:
    """Store a prompt's whole chunks from its blocks; returns the chunks stored and evicted."""
    num_blocks = len(token_ids) // paged.block_size
    if num_blocks == 0:
        return []
    kv = paged.gather(block_ids[:num_blocks])
    try:
        _, events = store.store(token_ids[: num_blocks * paged.block_size], kv, cache_salt)
    except StoreUnavailable as exc:
        log.warning("cachelayer: save skipped: %s", exc)
        return []
    return events


@dataclass(slots=True)
class CompletedSave:
    """A save the background thread finished: what it stored or evicted, and how long it took."""

    request_id: str
    cache_salt: str | None
    tokens: int
    events: list[ChunkEvent]
    seconds: float


def store_now(
    paged: PagedKV,
    store: ChunkStore,
    *,
    request_id: str,
    token_ids: Sequence[int],
    block_ids: Sequence[int],
    cache_salt: str | None,
    flush_timeout_s: float,
) -> CompletedSave:
    """Store a prompt's whole blocks now and wait until the store (and its remote tier, when it
    writes one) holds them; `tokens` of the result is the leading tokens the store then holds
    (0 when the store was unreachable: the decode engine will recompute)."""
    started = time.perf_counter()
    num_blocks = len(token_ids) // paged.block_size
    held, events = 0, []
    if num_blocks:
        kv = paged.gather(block_ids[:num_blocks])
        try:
            held, events = store.store(token_ids[: num_blocks * paged.block_size], kv, cache_salt)
            if not store.flush_remote(flush_timeout_s):
                log.warning(
                    "cachelayer: the remote tier did not take request %s's prompt within %g s",
                    request_id,
                    flush_timeout_s,
                )
        except StoreUnavailable as exc:
            log.warning("cachelayer: handoff save of request %s failed: %s", request_id, exc)
            held = 0
    return CompletedSave(request_id, cache_salt, held, events, time.perf_counter() - started)


@dataclass(slots=True)
class _StagedSave:
    request_id: str
    token_ids: list[int]
    snapshot: Tensor
    cache_salt: str | None
    nbytes: int


class BackgroundSaver:
    """Stores saved prompts from one background thread; the caller pays only for `snapshot`.

    Staged snapshots wait in memory until stored: past `max_pending_bytes` a new save is dropped
    (counted in `dropped_saves`) rather than growing the worker or blocking its step; a cache is
    best effort.
    """

    def __init__(self, paged: PagedKV, store: ChunkStore, *, max_pending_bytes: int = 1 << 30) -> None:
        self.paged = paged
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self.dropped_saves = 0
        self._queue: queue.SimpleQueue[_StagedSave | None] = queue.SimpleQueue()
        self._state = threading.Condition()
        self._pending_bytes = 0
        self._outstanding = 0
        self._completed: list[CompletedSave] = []
        self._thread = threading.Thread(target=self._run, name="cachelayer-saver", daemon=True)
        self._thread.start()

    def submit(
        self, *, request_id: str, token_ids: Sequence[int], block_ids: Sequence[int], cache_salt: str | None
    ) -> bool:
        """Copy a prompt's whole blocks out now and store them later; False when nothing is saved."""
        num_blocks = len(token_ids) // self.paged.block_size
        if num_blocks == 0:
            return False
        nbytes = num_blocks * self.paged.block_size * self.paged.num_layers * 2 * self.paged.channels
        nbytes *= self.paged.dtype.itemsize
        with self._state:
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.dropped_saves += 1
                log.warning(
                    "cachelayer: save of request %s dropped: %d bytes already wait for the store "
                    "(is the cache daemon slow or down?)",
                    request_id,
                    self._pending_bytes,
                )
                return False
            self._pending_bytes += nbytes
            self._outstanding += 1
        try:
            snapshot = self.paged.snapshot(block_ids[:num_blocks])
        except BaseException:
            self._settle(nbytes, None)
            raise
        tokens = list(token_ids[: num_blocks * self.paged.block_size])
        self._queue.put(_StagedSave(request_id, tokens, snapshot, cache_salt, nbytes))
        return True

    def take_completed(self) -> list[CompletedSave]:
        """The saves finished since the last call."""
        with self._state:
            completed, self._completed = self._completed, []
        return completed

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every submitted save is finished; False on timeout."""
        with self._state:
            return self._state.wait_for(lambda: self._outstanding == 0, timeout=timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the saves already submitted (up to timeout_s), then stop the thread."""
        if not self.wait_idle(timeout_s):
            log.warning("cachelayer: %d saves still pending at shutdown are dropped", self._outstanding)
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _settle(self, nbytes: int, completed: CompletedSave | None) -> None:
        with self._state:
            self._pending_bytes -= nbytes
            self._outstanding -= 1
            if completed is not None:
                self._completed.append(completed)
            self._state.notify_all()

    def _run(self) -> None:
        while (staged := self._queue.get()) is not None:
            started = time.perf_counter()
            events: list[ChunkEvent] = []
            try:
                kv = self.paged.chunk_from_snapshot(staged.snapshot)
                _, events = self.store.store(staged.token_ids, kv, staged.cache_salt)
            except StoreUnavailable as exc:
                log.warning("cachelayer: save skipped: %s", exc)
            except Exception:  # the saver must outlive one bad save
                log.exception("cachelayer: save of request %s failed", staged.request_id)
            completed = CompletedSave(
                staged.request_id,
                staged.cache_salt,
                len(staged.token_ids),
                events,
                time.perf_counter() - started,
            )
            self._settle(staged.nbytes, completed)


@dataclass(slots=True)
class CompletedLoad:
    """A load the background thread finished: the blocks that could not be loaded (vLLM
    recomputes them), the tokens that landed past the engine's own hit, and how long it took."""

    request_id: str
    failed_blocks: set[int]
    loaded_tokens: int
    seconds: float


class BackgroundLoader:
    """Loads requests' stored prefixes into their blocks on one background thread (vLLM's
    asynchronous load: the request waits off the batch, in WAITING_FOR_REMOTE_KVS, until the
    connector reports it finished, so no forward pass reads its blocks while they are written,
    and the engine keeps decoding the other requests meanwhile).

    Every submitted load completes, loaded or failed, exactly once (`take_completed`): an error
    of any kind fails every block the load was to write, so vLLM recomputes them; a load never
    hangs the request and never leaves its blocks half written and reported as loaded.
    """

    def __init__(self, paged: PagedKV, store: ChunkStore) -> None:
        self.paged = paged
        self.store = store
        self._queue: queue.SimpleQueue[LoadSpec | None] = queue.SimpleQueue()
        self._state = threading.Condition()
        self._outstanding = 0
        self._completed: list[CompletedLoad] = []
        self._thread = threading.Thread(target=self._run, name="cachelayer-loader", daemon=True)
        self._thread.start()

    def submit(
        self,
        *,
        request_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        first_block: int,
        cache_salt: str | None,
    ) -> None:
        with self._state:
            self._outstanding += 1
        self._queue.put(LoadSpec(request_id, list(token_ids), list(block_ids), first_block, cache_salt))

    @property
    def outstanding(self) -> int:
        """Loads submitted and not yet taken by `take_completed`."""
        with self._state:
            return self._outstanding

    def take_completed(self, wait_s: float = 0.0) -> list[CompletedLoad]:
        """The loads finished since the last call; waits up to `wait_s` for one when none has
        finished yet and some are outstanding."""
        with self._state:
            if wait_s > 0 and not self._completed and self._outstanding:
                self._state.wait_for(lambda: bool(self._completed), timeout=wait_s)
            completed, self._completed = self._completed, []
            self._outstanding -= len(completed)
        return completed

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every submitted load has finished (taken or not); False on timeout."""
        with self._state:
            return self._state.wait_for(lambda: len(self._completed) == self._outstanding, timeout=timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        if not self.wait_idle(timeout_s):
            log.warning("cachelayer: loads still running at shutdown are abandoned")
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _load(self, queued: LoadSpec) -> CompletedLoad:
        started = time.perf_counter()
        wanted = queued.block_ids[: len(queued.token_ids) // self.paged.block_size]
        try:
            request_load = RequestLoad.of(self.paged, self.store, queued)
            failed = request_load.finish()
            loaded_tokens = request_load.loaded_tokens(failed)
        except Exception:  # the loader must outlive one bad load, and the request must not hang
            log.exception("cachelayer: load of request %s failed, vLLM will recompute", queued.request_id)
            failed, loaded_tokens = set(wanted[queued.first_block :]), 0
        return CompletedLoad(queued.request_id, failed, loaded_tokens, time.perf_counter() - started)

    def _run(self) -> None:
        side: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if self.paged.device.type == "cuda":  # copies on a stream of their own, off the forward's
            torch.cuda.set_device(self.paged.device)
            side = torch.cuda.stream(torch.cuda.Stream(self.paged.device))
        while (queued := self._queue.get()) is not None:
            with side:
                completed = self._load(queued)
            with self._state:
                self._completed.append(completed)
                self._state.notify_all()
