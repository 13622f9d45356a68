"""What knowing the future is worth (kvgate_testing/foresight.py): Belady's MIN on traces checked by hand
and against an exhaustive search, Belady eviction in the engine block pool, and the upper bound's place
above every placement the reference's engine model can run."""

from __future__ import annotations

import functools
import random

import pytest

from kvgate_testing import workloads
from kvgate_testing.foresight import BeladyBlockCache, belady_hits, foresight_placement, upper_bound
from kvgate_testing.reference_placement import EngineBlockCache, reference_placement


@pytest.fixture(scope="module")
def tokenizer():
    return workloads.qwen3_tokenizer()


def test_belady_on_a_trace_checked_by_hand():
    # Capacity 2, A B C A B: A, B, C miss; C evicts B (next read at 4) rather than A (next read at 3);
    # A hits; B misses. One hit, where LRU (evicting A) gets none.
    assert belady_hits(list("ABCAB"), 2) == 1
    # The textbook reference string (Silberschatz, Operating System Concepts): 9 faults in 20 with 3 frames.
    string = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    assert belady_hits(string, 3) == 20 - 9
    assert belady_hits(list("ABAB"), 0) == 0
    assert belady_hits(list("ABAB"), 5) == 2  # room for everything: every repeat hits


def _best_demand_paging_hits(accesses: tuple, capacity: int) -> int:
    """The most hits over every eviction choice of a demand-paged cache, by exhaustive search."""

    @functools.cache
    def best(position: int, cache: frozenset) -> int:
        if position == len(accesses):
            return 0
        item = accesses[position]
        if item in cache:
            return 1 + best(position + 1, cache)
        if len(cache) < capacity:
            return best(position + 1, cache | {item})
        return max(best(position + 1, (cache - {victim}) | {item}) for victim in cache)

    return best(0, frozenset())


def test_belady_is_the_best_any_eviction_gets_on_random_traces():
    generator = random.Random(35)
    for _ in range(60):
        accesses = tuple(generator.choice("ABCDE") for _ in range(generator.randint(1, 12)))
        capacity = generator.randint(1, 3)
        assert belady_hits(list(accesses), capacity) == _best_demand_paging_hits(accesses, capacity), accesses


def _keys(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


def test_belady_block_pool_keeps_the_block_a_later_request_reads_where_lru_evicts_it():
    # Three slots of 4 tokens; 5-token prompts take two slots (one full block, one partial). A is read
    # again by the last request; B and C never are.
    requests = [(_keys("A"), 5), (_keys("B"), 5), (_keys("C"), 5), (_keys("A", "X"), 9)]
    uses: dict[object, list[int]] = {}
    for position, (keys, tokens) in enumerate(requests):
        for key in keys[: (tokens - 1) // 4]:
            uses.setdefault(key, []).append(position)
    lru, belady = EngineBlockCache(3, 4), BeladyBlockCache(3, 4, uses)
    served = {"lru": [], "belady": []}
    for position, (keys, tokens) in enumerate(requests):
        if position == 3:  # before the last request: what each pool kept of A, B and C
            # LRU: C's request reused the least recently freed slots, A's first. Belady took the empty
            # slot, then B's (never read again), and kept A.
            assert [lru.longest_cached_prefix(_keys(name)) for name in "ABC"] == [0, 1, 1]
            assert [belady.longest_cached_prefix(_keys(name)) for name in "ABC"] == [1, 0, 1]
        served["lru"].append(lru.serve(keys, tokens, 0, position))
        served["belady"].append(belady.serve(keys, tokens, 0, position))
    assert served == {"lru": [0, 0, 0, 0], "belady": [0, 0, 0, 4]}  # A's block: the last prompt's first 4


def test_the_upper_bound_sits_above_the_reference_and_foresight_and_below_an_unbounded_cache(tokenizer):
    # cache_pressure at the real tier's scale: its prefixes are far more than 2 engines hold.
    workload = workloads.build("cache_pressure", tokenizer, 0.25, prefix_tokens=48, question_tokens=(4, 8))
    engines, blocks = 2, 16
    reference = reference_placement(workload, engines, blocks)
    foresight = foresight_placement(workload, engines, blocks)
    bound = upper_bound(workload, engines, blocks)
    assert reference.hit_ratio <= bound.hit_ratio and foresight.hit_ratio <= bound.hit_ratio
    assert foresight.hit_ratio > reference.hit_ratio  # Belady keeps the hot prefixes LRU lets go
    assert foresight.max_over_mean_load <= 1.3
    assert sum(foresight.requests_per_engine) == len(workload.requests)
    # Under pressure the pooled blocks bind, well below what an unbounded cache would reuse.
    assert bound.binding == "pooled Belady" and bound.hit_ratio < bound.unbounded_hit_ratio
    unbounded = workload.summary()["unbounded_cache_hit_ratio"]
    assert bound.unbounded_hit_ratio == pytest.approx(unbounded, abs=1e-4)
    # With room for every block the unbounded cache binds, and nothing to reuse gives a bound of 0.
    roomy = upper_bound(workload, engines, 10_000)
    assert roomy.binding == "unbounded cache" and roomy.hit_ratio == roomy.unbounded_hit_ratio
    no_reuse = workloads.build("no_reuse", tokenizer, 0.05, prompt_tokens=(20, 40))
    assert upper_bound(no_reuse, engines, blocks).hit_ratio == 0.0
