"""The simulated engine's KV block manager: a fixed pool of blocks with prefix caching like vLLM's.

Invariants (the ones vLLM's prefix cache keeps, so routing behaves as it would against vLLM):
- Only full blocks are cached. A block's hash chains the hash of the block before it with its own
  tokens; the first block also mixes in the request's extra keys (LoRA name, cache_salt), so salted
  prompts never share blocks with unsalted ones.
- A block is referenced by every running sequence that uses it. A block nobody references stays
  cached (and can be hit again) until the pool needs it: free blocks are reused least recently
  freed first, and reusing a cached one evicts it (a BlockRemoved event).
- A sequence's blocks are freed tail first, so a prompt loses its end before its beginning.
- Blocks filled by generated tokens are cached as well.

Every change to the set of cached blocks is returned as events (router/sim/events.py) in the order
it happened; the caller publishes them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvwire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# The parent hash of a sequence's first block: fixed, so a restarted simulator hashes alike.
_ROOT_HASH = 0x6B76676174652D73  # "kvgate-s"


def set_hash_seed(seed: int) -> None:
    """Seed the chain of every block hash this process computes (`kvgate sim --hash-seed`): one
    process is one engine, as PYTHONHASHSEED is for vLLM's NONE_HASH."""
    global _ROOT_HASH
    _ROOT_HASH = xxhash.xxh3_64_intdigest(b"kvgate-sim-hash-seed:%d" % seed)


def block_hash(parent: int | None, tokens: np.ndarray, extra: tuple[str, ...] | None) -> int:
    """The chained 64-bit hash of one full block of uint32 tokens (an unsigned int, like vLLM's)."""
    return _hash_bytes(parent, tokens.astype(np.uint32, copy=False).tobytes(), extra)


def _hash_bytes(parent: int | None, token_bytes: bytes, extra: tuple[str, ...] | None) -> int:
    payload = (_ROOT_HASH if parent is None else parent).to_bytes(8, "little") + token_bytes
    if extra:
        payload += "\x00".join(extra).encode()
    return xxhash.xxh3_64_intdigest(payload)


def chained_block_hashes(tokens: np.ndarray, block_size: int, extra: tuple[str, ...] | None) -> list[int]:
    """Hashes of every full block of `tokens`; `extra` (LoRA name, cache_salt) goes into the first."""
    data = tokens.astype(np.uint32, copy=False).tobytes()
    step = 4 * block_size
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(tokens) // block_size * step, step):
        parent = _hash_bytes(parent, data[start : start + step], extra if start == 0 else None)
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    # Loop time at which the block's KV is computed; a sequence hitting it earlier waits for it.
    ready_at: float = 0.0


@dataclass(slots=True)
class Sequence:
    """One request's place in the pool: its tokens so far and the blocks holding them."""

    request_id: str
    tokens: list[int]
    lora_name: str | None
    # What the first block's hash mixes in (LoRA name, cache_salt), as vLLM's extra keys.
    extra_keys: tuple[str, ...] | None
    block_ids: list[int] = field(default_factory=list)
    # Leading blocks of this sequence that are full and hashed (cached or deduplicated).
    num_hashed_blocks: int = 0
    last_hash: int | None = None
    # Prompt tokens served from the cache, and the time those cached blocks are ready.
    cached_tokens: int = 0
    cached_ready_at: float = 0.0


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens, with vLLM-style prefix caching and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Unreferenced blocks, least recently freed first: the next to be reused (and evicted).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._sequences: dict[str, Sequence] = {}

    # ---- queries ----

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references (cached or empty): what vLLM counts as free."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running sequences (vllm:kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def longest_cached_prefix(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` are cached."""
        for i, value in enumerate(hashes):
            if value not in self._cached:
                return i
        return len(hashes)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- sequence life cycle ----

    def allocate(
        self,
        request_id: str,
        prompt: np.ndarray,
        max_new_tokens: int,
        now: float,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> tuple[Sequence, list[KVEvent]] | None:
        """Admit a sequence: reuse its cached prefix, reserve blocks for the rest of the prompt and
        `max_new_tokens`, and cache the prompt's full blocks. None when the pool cannot hold it now.

        As in vLLM, the last prompt token is always computed, so a fully cached prompt still misses
        its last block. The newly cached prompt blocks are not ready until mark_prompt_ready().
        """
        if request_id in self._sequences:
            raise ValueError(f"sequence {request_id!r} is already allocated")
        extra_keys = tuple(key for key in (lora_name, cache_salt) if key) or None
        hashes = chained_block_hashes(prompt, self.block_size, extra_keys)
        max_hit_blocks = (len(prompt) - 1) // self.block_size
        hit_blocks = self.longest_cached_prefix(hashes[:max_hit_blocks])
        total_blocks = self.blocks_needed(len(prompt) + max_new_tokens)
        new_blocks = total_blocks - hit_blocks
        hit_ids = [self._cached[h] for h in hashes[:hit_blocks]]
        hits_in_free = sum(1 for block_id in hit_ids if block_id in self._free)
        if len(self._free) - hits_in_free < new_blocks:
            return None

        events: list[KVEvent] = []
        sequence = Sequence(request_id, prompt.tolist(), lora_name, extra_keys)
        ready_at = now
        for block_id in hit_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            ready_at = max(ready_at, block.ready_at)
            sequence.block_ids.append(block_id)
        sequence.cached_tokens = hit_blocks * self.block_size
        sequence.cached_ready_at = ready_at
        sequence.num_hashed_blocks = hit_blocks
        sequence.last_hash = hashes[hit_blocks - 1] if hit_blocks else None

        evicted: list[int] = []
        for _ in range(new_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            sequence.block_ids.append(block_id)
        if evicted:
            events.append(BlockRemoved(block_hashes=evicted, medium=MEDIUM_GPU, group_idx=0))
        self._sequences[request_id] = sequence
        events.extend(self._hash_full_blocks(sequence, math.inf))
        return sequence, events

    def mark_prompt_ready(self, sequence: Sequence, ready_at: float) -> None:
        """Set when the prompt blocks this sequence computes are ready for others to hit."""
        for block_id in sequence.block_ids[sequence.cached_tokens // self.block_size :]:
            block = self._blocks[block_id]
            if block.ready_at == math.inf:
                block.ready_at = ready_at

    def append_token(self, request_id: str, token: int, now: float) -> list[KVEvent]:
        """Record one generated token; a block it fills is cached (and announced)."""
        sequence = self._sequences[request_id]
        if len(sequence.tokens) >= len(sequence.block_ids) * self.block_size:
            raise ValueError(f"sequence {request_id!r} generated more tokens than it reserved")
        sequence.tokens.append(token)
        if len(sequence.tokens) % self.block_size:
            return []
        return self._hash_full_blocks(sequence, now)

    def free(self, request_id: str) -> None:
        """Release a finished (or cancelled) sequence's blocks, tail first."""
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            return
        for block_id in reversed(sequence.block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def reset(self) -> list[KVEvent] | None:
        """Forget every cached block (POST /reset_prefix_cache). Like vLLM, refused (None) while
        sequences hold blocks."""
        if self._sequences:
            return None
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        return [AllBlocksCleared()]

    # ---- internals ----

    def _hash_full_blocks(self, sequence: Sequence, ready_at: float) -> list[KVEvent]:
        full_blocks = len(sequence.tokens) // self.block_size
        if full_blocks <= sequence.num_hashed_blocks:
            return []
        size = self.block_size
        tokens = np.asarray(
            sequence.tokens[sequence.num_hashed_blocks * size : full_blocks * size], np.uint32
        )
        stored_hashes: list[int] = []
        stored_tokens: list[int] = []
        events: list[KVEvent] = []
        parent_of_run = sequence.last_hash
        for offset in range(full_blocks - sequence.num_hashed_blocks):
            index = sequence.num_hashed_blocks + offset
            chunk = tokens[offset * size : (offset + 1) * size]
            value = block_hash(sequence.last_hash, chunk, sequence.extra_keys if index == 0 else None)
            block = self._blocks[sequence.block_ids[index]]
            if value in self._cached:
                # Another sequence cached the same content meanwhile; vLLM keeps one copy for
                # lookups and leaves this block uncached. It breaks the announced run.
                if stored_hashes:
                    events.append(self._stored(stored_hashes, parent_of_run, stored_tokens, sequence))
                    stored_hashes, stored_tokens = [], []
                parent_of_run = value
            else:
                block.block_hash = value
                block.ready_at = ready_at
                self._cached[value] = block.block_id
                stored_hashes.append(value)
                stored_tokens.extend(chunk.tolist())
            sequence.last_hash = value
        if stored_hashes:
            events.append(self._stored(stored_hashes, parent_of_run, stored_tokens, sequence))
        sequence.num_hashed_blocks = full_blocks
        return events

    def _stored(
        self, hashes: list[int], parent: int | None, tokens: list[int], sequence: Sequence
    ) -> BlockStored:
        first_is_root = parent is None
        extra = list(sequence.extra_keys) if sequence.extra_keys else None
        extra_keys = [extra if (first_is_root and i == 0) else None for i in range(len(hashes))]
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=self.block_size,
            medium=MEDIUM_GPU,
            lora_name=sequence.lora_name,
            extra_keys=extra_keys if any(e is not None for e in extra_keys) else None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
