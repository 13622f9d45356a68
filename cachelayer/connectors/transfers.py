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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from cachelayer import gpu
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
        num_tokens = len(block_ids) * self.block_size
        if self.layout == "cpu_blocks":
            blocks = torch.empty(
                gpu.block_chunk_shape(self.kv_caches, self.layout, len(block_ids)), dtype=self.dtype
            )
            gpu.gather_blocks(self.kv_caches, self.layout, self._block_tensor(block_ids), blocks)
            halves = blocks.view(self.num_layers, len(block_ids), 2, self.block_size, self.channels)
            return halves.permute(0, 2, 1, 3, 4).reshape(self.num_layers, 2, num_tokens, self.channels)
        host = torch.empty(
            self.num_layers,
            2,
            num_tokens,
            self.channels,
            dtype=self.dtype,
            pin_memory=self.device.type == "cuda",
        )
        gpu.store(self.kv_caches, self.layout, self._slot_mapping(block_ids), host, check_range=False).wait()
        return host

    def scatter(self, chunk: Tensor, block_ids: Sequence[int], *, skip_blocks: int = 0) -> None:
        """Write chunk (tokens of block_ids, in order) into the cache, leaving the first skip_blocks alone."""
        num_blocks = len(block_ids)
        if chunk.shape[2] != num_blocks * self.block_size:
            raise ValueError(
                f"chunk has {chunk.shape[2]} tokens, {num_blocks} blocks need {num_blocks * self.block_size}"
            )
        if self.layout == "cpu_blocks":
            halves = chunk.reshape(self.num_layers, 2, num_blocks, self.block_size, self.channels)
            blocks = halves.permute(0, 2, 1, 3, 4).contiguous()
            blocks = blocks.view(gpu.block_chunk_shape(self.kv_caches, self.layout, num_blocks))
            ids = self._block_tensor(block_ids)
            ids[:skip_blocks] = -1
            gpu.scatter_blocks(blocks, self.kv_caches, self.layout, ids)
            return
        host = chunk.contiguous()
        if self.device.type == "cuda" and not host.is_pinned():
            host = host.pin_memory()
        gpu.retrieve(
            host, self.kv_caches, self.layout, self._slot_mapping(block_ids, skip_blocks), check_range=False
        ).wait()


class ChunkStore(Protocol):
    def lookup(self, tokens: Sequence[int], cache_salt: str | None) -> int: ...

    def store(
        self, tokens: Sequence[int], kv: Tensor, cache_salt: str | None
    ) -> tuple[int, list[ChunkEvent]]: ...

    def retrieve(self, tokens: Sequence[int], cache_salt: str | None) -> tuple[int, Tensor | None]: ...


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


def load_request(
    paged: PagedKV,
    store: ChunkStore,
    *,
    token_ids: Sequence[int],
    block_ids: Sequence[int],
    first_block: int,
    cache_salt: str | None,
) -> set[int]:
    """Load a request's stored prefix into its blocks; returns the block ids that could not be loaded.

    A shorter hit than planned (evicted meanwhile) or an unreachable store fails the blocks past
    what was loaded, so vLLM recomputes them instead of reading whatever they held.
    """
    wanted_blocks = list(block_ids[: len(token_ids) // paged.block_size])
    try:
        hit, kv = store.retrieve(token_ids, cache_salt)
    except StoreUnavailable as exc:
        log.warning("cachelayer: load failed, vLLM will recompute: %s", exc)
        hit, kv = 0, None
    loaded_blocks = hit // paged.block_size if kv is not None else 0
    if loaded_blocks > first_block:
        usable = kv[:, :, : loaded_blocks * paged.block_size]
        paged.scatter(usable, wanted_blocks[:loaded_blocks], skip_blocks=first_block)
    return set(wanted_blocks[max(loaded_blocks, first_block) :])


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
