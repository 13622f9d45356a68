"""The simulated engine's block pool: prefix caching, reference counts, LRU eviction, events."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire import AllBlocksCleared, BlockRemoved, BlockStored
from router.sim.blocks import BlockPool, chained_block_hashes

BLOCK = 4


def tokens(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.uint32)


def prompt(start: int, length: int) -> np.ndarray:
    return np.arange(start, start + length, dtype=np.uint32)


def test_only_full_blocks_are_cached_and_a_repeat_hits_them():
    pool = BlockPool(num_blocks=16, block_size=BLOCK)
    first, events = pool.allocate("a", prompt(0, 10), max_new_tokens=1, now=0.0)
    assert first.cached_tokens == 0
    # 10 tokens: two full blocks announced in one BlockStored, the partial third is not cached.
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    assert events[0].block_hashes == chained_block_hashes(prompt(0, 10), BLOCK, None)
    assert events[0].parent_block_hash is None
    assert events[0].token_ids == list(range(8))
    assert pool.num_cached_blocks == 2
    pool.free("a")

    repeat, events = pool.allocate("b", prompt(0, 10), max_new_tokens=1, now=1.0)
    assert repeat.cached_tokens == 8
    assert events == []


def test_hashes_chain_so_a_shared_block_after_a_different_prefix_misses():
    pool = BlockPool(num_blocks=16, block_size=BLOCK)
    pool.allocate("a", tokens(1, 2, 3, 4, 5, 6, 7, 8, 9), 1, now=0.0)
    other, _ = pool.allocate("b", tokens(9, 9, 9, 9, 5, 6, 7, 8, 9), 1, now=0.0)
    assert other.cached_tokens == 0


def test_the_last_prompt_token_is_always_computed():
    pool = BlockPool(num_blocks=16, block_size=BLOCK)
    pool.allocate("a", prompt(0, 8), 1, now=0.0)
    pool.free("a")
    # The whole 8-token prompt is cached, but vLLM recomputes the last token: only block 0 hits.
    again, _ = pool.allocate("b", prompt(0, 8), 1, now=0.0)
    assert again.cached_tokens == 4


def test_cache_salt_isolates_prompts_and_is_announced_in_extra_keys():
    pool = BlockPool(num_blocks=16, block_size=BLOCK)
    _, events = pool.allocate("a", prompt(0, 9), 1, now=0.0, cache_salt="tenant-1")
    assert events[0].extra_keys == [["tenant-1"], None]
    pool.free("a")
    unsalted, _ = pool.allocate("b", prompt(0, 9), 1, now=0.0)
    assert unsalted.cached_tokens == 0
    pool.free("b")
    salted, _ = pool.allocate("c", prompt(0, 9), 1, now=0.0, cache_salt="tenant-1")
    assert salted.cached_tokens == 8


def test_referenced_blocks_are_never_evicted_and_a_full_pool_refuses():
    pool = BlockPool(num_blocks=4, block_size=BLOCK)
    pool.allocate("a", prompt(0, 8), max_new_tokens=4, now=0.0)  # 3 blocks
    assert pool.usage == pytest.approx(3 / 4)
    assert pool.allocate("b", prompt(100, 8), max_new_tokens=4, now=0.0) is None
    pool.free("a")
    assert pool.usage == 0.0
    assert pool.num_cached_blocks == 2  # freed but still cached


def test_unreferenced_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(num_blocks=6, block_size=BLOCK)
    pool.allocate("old", prompt(0, 8), max_new_tokens=1, now=0.0)  # blocks for 9 tokens: 3
    pool.free("old")
    pool.allocate("new", prompt(100, 8), max_new_tokens=1, now=0.0)
    pool.free("new")
    old_hashes = chained_block_hashes(prompt(0, 8), BLOCK, None)
    new_hashes = chained_block_hashes(prompt(100, 8), BLOCK, None)
    # The pool is full of freed blocks: the next prompt evicts the oldest ones, tail first.
    _, events = pool.allocate("third", prompt(200, 4), max_new_tokens=1, now=0.0)  # needs 2 blocks
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 1
    # "old" was freed tail first, so its (uncached) third block and then its second block go first.
    assert removed[0].block_hashes == [old_hashes[1]]
    assert pool.cached_hashes() >= set(new_hashes)
    assert old_hashes[0] in pool.cached_hashes()
    assert old_hashes[1] not in pool.cached_hashes()


def test_hitting_a_freed_block_takes_it_back_from_the_free_list():
    pool = BlockPool(num_blocks=3, block_size=BLOCK)
    pool.allocate("a", prompt(0, 8), max_new_tokens=1, now=0.0)
    pool.free("a")
    # 9 tokens need 3 blocks; two of them are the cached prefix, so one free block is enough.
    hit, events = pool.allocate("b", prompt(0, 9), max_new_tokens=0, now=0.0)
    assert hit.cached_tokens == 8
    assert not any(isinstance(e, BlockRemoved) for e in events)


def test_shared_prefix_blocks_are_reference_counted():
    pool = BlockPool(num_blocks=8, block_size=BLOCK)
    pool.allocate("a", prompt(0, 9), max_new_tokens=1, now=0.0)
    second, _ = pool.allocate("b", prompt(0, 9), max_new_tokens=1, now=0.0)
    assert second.cached_tokens == 8
    used = pool.num_blocks - pool.num_free_blocks
    assert used == 2 + 1 + 1  # the shared prefix once, each sequence's own tail block
    pool.free("a")
    assert pool.num_blocks - pool.num_free_blocks == 3  # "b" still holds the prefix
    pool.free("b")
    assert pool.num_free_blocks == pool.num_blocks


def test_blocks_filled_by_generated_tokens_are_cached_and_announced():
    pool = BlockPool(num_blocks=8, block_size=BLOCK)
    sequence, _ = pool.allocate("a", prompt(0, 6), max_new_tokens=6, now=0.0)
    assert pool.append_token("a", 500, now=1.0) == []
    events = pool.append_token("a", 501, now=1.0)  # token 8 fills block 1
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    prompt_hashes = chained_block_hashes(prompt(0, 4), BLOCK, None)
    assert events[0].parent_block_hash == prompt_hashes[0]
    assert events[0].token_ids == [4, 5, 500, 501]
    assert events[0].block_hashes == chained_block_hashes(tokens(0, 1, 2, 3, 4, 5, 500, 501), BLOCK, None)[1:]
    pool.free("a")
    # The conversation's next turn hits the generated block too.
    follow_up, _ = pool.allocate("b", tokens(0, 1, 2, 3, 4, 5, 500, 501, 7), 1, now=2.0)
    assert follow_up.cached_tokens == 8
    assert sequence.num_hashed_blocks == 2


def test_a_sequence_cannot_outgrow_its_reservation():
    pool = BlockPool(num_blocks=8, block_size=BLOCK)
    pool.allocate("a", prompt(0, 3), max_new_tokens=1, now=0.0)
    pool.append_token("a", 1, now=0.0)
    with pytest.raises(ValueError, match="more tokens than it reserved"):
        pool.append_token("a", 2, now=0.0)


def test_reset_clears_everything_but_is_refused_while_sequences_run():
    pool = BlockPool(num_blocks=8, block_size=BLOCK)
    pool.allocate("a", prompt(0, 9), 1, now=0.0)
    assert pool.reset() is None
    pool.free("a")
    assert pool.reset() == [AllBlocksCleared()]
    assert pool.num_cached_blocks == 0
    again, _ = pool.allocate("b", prompt(0, 9), 1, now=0.0)
    assert again.cached_tokens == 0


def test_prompt_blocks_are_ready_only_when_their_prefill_ends():
    pool = BlockPool(num_blocks=8, block_size=BLOCK)
    first, _ = pool.allocate("a", prompt(0, 9), 1, now=0.0)
    pool.mark_prompt_ready(first, 5.0)
    second, _ = pool.allocate("b", prompt(0, 9), 1, now=1.0)
    assert second.cached_tokens == 8
    assert second.cached_ready_at == 5.0


def test_content_another_sequence_cached_first_is_not_announced_twice():
    pool = BlockPool(num_blocks=16, block_size=BLOCK)
    pool.allocate("a", prompt(0, 5), max_new_tokens=4, now=0.0)
    # "b" sends a's prompt plus the tokens a is about to generate, before a generates them.
    _, events = pool.allocate("b", tokens(0, 1, 2, 3, 4, 500, 501, 502, 9), 1, now=0.0)
    assert [len(e.block_hashes) for e in events] == [1]
    assert pool.num_cached_blocks == 2
    for token in (500, 501):
        pool.append_token("a", token, now=1.0)
    assert pool.append_token("a", 502, now=1.0) == []  # fills block 1, already cached by "b"
    assert pool.num_cached_blocks == 2
    assert pool.append_token("a", 503, now=1.0) == []
