"""kv_aware's model of each engine's capacity and survival time (router/policies/capacity.py), fed the
KV events a simulated engine's block pool really emits, through the wire encoding and the prefix index."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.sim_pool import PoolEngine as Engine
from router.config import KVEvents
from router.index.service import KVIndexService
from router.policies.capacity import RATE_HALF_LIFE_S, CapacityModel
from router.sim.blocks import BlockPool

BLOCK = 16
rng = np.random.default_rng(25)


def prompt(tokens: int) -> np.ndarray:
    return rng.integers(0, 150_000, size=tokens).astype(np.uint32)


def test_capacity_is_unknown_until_the_engine_evicts_then_its_high_water_mark():
    index = WritableIndex()
    engine = Engine(index, "e0", num_blocks=32)  # 512 tokens
    model = CapacityModel(index, check_interval_s=0.0)
    engine.serve(prompt(160))
    engine.serve(prompt(160))
    # 320 tokens held, nothing removed: the pool may be far larger than what it holds.
    assert index.held_tokens("e0") == 320
    assert model.capacity_tokens("e0") == 0
    engine.serve(prompt(320))  # needs 20 blocks, 12 are free: 8 cached ones are evicted
    assert index.stats("e0").removed_events == 1
    assert model.capacity_tokens("e0") == 32 * BLOCK
    # Evictions keep it near full; the mark stays the pool's size whatever it holds afterwards.
    for _ in range(5):
        engine.serve(prompt(200))
    assert model.capacity_tokens("e0") == 32 * BLOCK


def test_a_cleared_cache_forgets_the_capacity_until_the_engine_evicts_again():
    index = WritableIndex()
    engine = Engine(index, "e0", num_blocks=32)
    model = CapacityModel(index, check_interval_s=0.0)
    for _ in range(4):
        engine.serve(prompt(208))  # 13 full blocks each: the pool's 32 fill and evict
    assert model.capacity_tokens("e0") == 32 * BLOCK
    engine.reset()  # AllBlocksCleared
    assert index.held_tokens("e0") == 0
    assert model.capacity_tokens("e0") == 0
    # Restarted with a smaller pool: the old mark must not survive the clear.
    engine.pool = BlockPool(16, BLOCK)
    for _ in range(3):
        engine.serve(prompt(112))
    assert model.capacity_tokens("e0") == 16 * BLOCK


def test_a_configured_capacity_is_used_as_given():
    model = CapacityModel(WritableIndex(), configured_tokens={"e0": 4096})
    assert model.capacity_tokens("e0") == 4096
    assert model.capacity_tokens("e1") == 0


def test_earliest_survival_is_capacity_over_the_tokens_touched_per_second():
    index = WritableIndex()
    engines = [Engine(index, f"e{i}", num_blocks=32) for i in range(2)]
    model = CapacityModel(index, check_interval_s=0.0)
    for engine in engines:
        for _ in range(3):
            engine.serve(prompt(208))
    capacity = model.capacity_tokens("e0")
    assert capacity == 32 * BLOCK
    now = 1000.0
    assert model.earliest_survival_s("e0", now) == math.inf  # nothing routed: nothing pushes a block out
    # e0 touches 4000 tokens (hits count: they become most recently used), e1 1000.
    model.on_routed("e0", 2000, now)
    model.on_routed("e0", 2000, now)
    model.on_routed("e1", 1000, now)
    rate = math.log(2) / RATE_HALF_LIFE_S
    assert model.touched_per_s("e0", now) == pytest.approx(4000 * rate)
    assert model.earliest_survival_s("e0", now) == pytest.approx(capacity / (4000 * rate))
    assert model.earliest_survival_s("e1", now) == pytest.approx(4 * model.earliest_survival_s("e0", now))
    # The rate decays with its half-life: a quiet engine's blocks last longer.
    later = now + RATE_HALF_LIFE_S
    assert model.earliest_survival_s("e0", later) == pytest.approx(2 * model.earliest_survival_s("e0", now))


def test_earliest_survival_is_unbounded_while_the_capacity_is_unknown():
    index = WritableIndex()
    Engine(index, "e0", num_blocks=64).serve(prompt(100))
    model = CapacityModel(index, check_interval_s=0.0)
    model.on_routed("e0", 100_000, 0.0)
    assert model.earliest_survival_s("e0", 0.0) == math.inf


def test_the_gateways_index_service_sums_a_data_parallel_engines_ranks():
    # The gateway hands kv_aware its KVIndexService (one index stream per DP rank), not the index.
    service = KVIndexService()
    service.add_backend("e0", KVEvents(endpoint="tcp://127.0.0.1:1", dp_ranks=2))  # never started
    ranks = [Engine(service.index, f"e0@dp{rank}", num_blocks=16, writer=service.writer) for rank in range(2)]
    model = CapacityModel(service, check_interval_s=0.0)
    ranks[0].serve(prompt(128))
    ranks[1].serve(prompt(128))
    assert model.capacity_tokens("e0") == 0
    ranks[0].serve(prompt(192))  # rank 0's 16 blocks overflow: it evicts
    ranks[1].serve(prompt(64))
    assert service.stats("e0").removed_events == 1
    assert model.capacity_tokens("e0") == 16 * BLOCK + 12 * BLOCK  # both ranks' blocks, at the peak
    assert service.stats("nope") is None
    assert model.capacity_tokens("nope") == 0


def test_a_prompt_is_seen_before_when_a_prefix_of_it_was_routed_lately():
    model = CapacityModel(WritableIndex(), max_seen_keys=8)
    keys = list(range(100, 140))  # 40 router blocks
    assert not model.seen_before(keys)
    model.on_routed("e0", 40 * BLOCK, 0.0, keys[:10])
    assert model.seen_before(keys)  # its first 10 blocks were routed
    assert not model.seen_before(keys[:3])  # too short a prefix to say
    assert not model.seen_before(list(range(500, 540)))
    # Bounded: a sampled key is kept while at least max_seen_keys / 2 newer ones come, and gone
    # once max_seen_keys have.
    model.on_routed("e1", 4 * BLOCK, 0.0, list(range(1000, 1004)))  # 1 more sampled key: 3 of 8
    assert model.seen_before(keys)
    model.on_routed("e1", 4 * BLOCK, 0.0, list(range(2000, 2004)))  # 4: a generation is full
    assert model.seen_before(keys)
    model.on_routed("e1", 16 * BLOCK, 0.0, list(range(3000, 3016)))  # 4 more: the next one is
    assert not model.seen_before(keys)
    assert model.seen_before(list(range(3000, 3016)))
