"""The simulated shared KV tier: engines of one tier share one store in a real redis-server."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from kvgate_testing.ports import free_port
from kvgate_testing.redis_server import RedisServer
from kvwire import BlockStored
from router.sim.blocks import BlockPool
from router.sim.engine import GenerationRequest, SimulatedEngine, TimingModel
from router.sim.shared_store import MEDIUM_SHARED, SharedBlockStore, tier_prefix

VOCABULARY = np.arange(1000, 1100, dtype=np.uint32)
# Cold: 1000 tokens at 500 us (0.5 s). Loaded from the shared tier: 992 tokens at 100 us (0.1 s).
TIMING = TimingModel(
    prefill_us_per_token=500.0,
    prefill_overhead_ms=0.0,
    decode_ms_per_token=0.1,
    shared_load_us_per_token=100.0,
)
PROMPT = np.arange(1000, dtype=np.uint32)
EXTENDED = np.arange(1200, dtype=np.uint32)  # PROMPT and 200 tokens more
FULL_BLOCKS = 1000 // 16


class RecordedEvents:
    """The engine's publisher seam: keeps every batch the engine publishes."""

    def __init__(self) -> None:
        self.batches: list[list] = []

    def publish(self, events: list) -> None:
        self.batches.append(list(events))

    def shared_stored(self) -> list[int]:
        return [
            block_hash
            for batch in self.batches
            for event in batch
            if isinstance(event, BlockStored) and event.medium == MEDIUM_SHARED
            for block_hash in event.block_hashes
        ]


def member(url: str, events: RecordedEvents, tier: str = "docs") -> SimulatedEngine:
    return SimulatedEngine(
        BlockPool(512, 16),
        TIMING,
        VOCABULARY,
        8,
        events,
        SharedBlockStore(url, tier),  # type: ignore[arg-type]
    )


async def ttft(engine: SimulatedEngine, request: GenerationRequest) -> float:
    start = asyncio.get_running_loop().time()
    async for _ in engine.generate(request):
        return asyncio.get_running_loop().time() - start
    raise AssertionError("no token")


async def until_written(store: SharedBlockStore, hashes: list[int], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await store.longest_prefix(hashes) < len(hashes):
        assert time.monotonic() < deadline, "the engine never wrote its prompt to the shared store"
        await asyncio.sleep(0.01)


def test_a_prefix_one_member_computed_loads_on_another_between_hit_and_cold(redis_server: RedisServer):
    async def scenario():
        events_a, events_b = RecordedEvents(), RecordedEvents()
        a, b = member(redis_server.url, events_a), member(redis_server.url, events_b)
        request_a = GenerationRequest("a", PROMPT, 2)
        cold = await ttft(a, request_a)
        await until_written(b.shared_store, request_a.block_hashes)
        # B's prompt is A's plus 200 tokens of its own: it loads A's blocks and computes the rest.
        request_b = GenerationRequest("b", EXTENDED, 2)
        loaded = await ttft(b, request_b)
        await until_written(a.shared_store, request_b.block_hashes)
        await asyncio.sleep(0.05)  # B's announcement follows its write
        gpu_hit = await ttft(a, GenerationRequest("a2", PROMPT, 2))
        await a.close()
        await b.close()
        return cold, loaded, gpu_hit, request_a, request_b, events_a, events_b

    cold, loaded, gpu_hit, request_a, request_b, events_a, events_b = asyncio.run(scenario())
    assert request_a.cached_tokens == 0
    assert request_b.cached_tokens == request_b.shared_loaded_tokens == FULL_BLOCKS * 16
    # B's TTFT: 992 tokens loaded at 100 us + 208 computed at 500 us, about 0.2 s; cold would be 0.6 s.
    assert gpu_hit < loaded < cold
    assert loaded >= 0.19  # simulated time, slept: a busy machine only lengthens it
    assert loaded < 0.75 * cold  # a ratio of the cold TTFT measured here (about a third in fact)
    # Each member announces, with medium "shared", the blocks it wrote: A the prefix it computed, B
    # its own blocks only, chained to A's prefix (as the cache layer's daemon and Redis tier report).
    assert len(request_a.block_hashes) == FULL_BLOCKS
    assert events_a.shared_stored() == request_a.block_hashes
    assert request_b.block_hashes[:FULL_BLOCKS] == request_a.block_hashes
    assert events_b.shared_stored() == request_b.block_hashes[FULL_BLOCKS:]
    first_of_b = next(e for batch in events_b.batches for e in batch if e.medium == MEDIUM_SHARED)
    assert first_of_b.parent_block_hash == request_a.block_hashes[-1]
    assert first_of_b.token_ids == EXTENDED[FULL_BLOCKS * 16 : len(EXTENDED) // 16 * 16].tolist()


def test_members_of_another_tier_do_not_see_the_prefix(redis_server: RedisServer):
    async def scenario():
        a = member(redis_server.url, RecordedEvents(), tier="docs")
        other = member(redis_server.url, RecordedEvents(), tier="elsewhere")
        request = GenerationRequest("a", PROMPT, 2)
        await ttft(a, request)
        await until_written(a.shared_store, request.block_hashes)
        request_other = GenerationRequest("o", PROMPT, 2)
        await ttft(other, request_other)
        await a.close()
        await other.close()
        return request_other

    assert asyncio.run(scenario()).cached_tokens == 0
    assert len(list(redis_server.client().scan_iter(match=f"{tier_prefix('docs')}*"))) == FULL_BLOCKS


def test_an_unreachable_shared_store_is_a_miss_not_an_error():
    async def scenario():
        events = RecordedEvents()
        engine = member(f"redis://127.0.0.1:{free_port()}/0", events)
        request = GenerationRequest("a", PROMPT, 2)
        tokens = [token async for token in engine.generate(request)]
        await asyncio.sleep(0.05)
        errors = engine.shared_store.errors
        await engine.close()
        return request, tokens, events, errors

    request, tokens, events, errors = asyncio.run(scenario())
    assert len(tokens) == 2 and request.cached_tokens == 0
    assert events.shared_stored() == []  # nothing announced that was never written
    assert errors >= 2  # the lookup and the write, each counted


def test_a_prefill_leg_is_in_the_store_before_its_first_token_leaves_whatever_the_role(
    redis_server: RedisServer,
):
    # Writes that take 50 us per token (50 ms here): a background write is surely not done at the
    # first token, a hand-over surely is.
    timing = TimingModel(
        prefill_us_per_token=500.0,
        prefill_overhead_ms=0.0,
        decode_ms_per_token=0.1,
        shared_store_us_per_token=50.0,
    )

    async def scenario() -> tuple[int, int, int]:
        engines = {
            role: SimulatedEngine(
                BlockPool(512, 16),
                timing,
                VOCABULARY,
                8,
                RecordedEvents(),  # type: ignore[arg-type]
                SharedBlockStore(redis_server.url, role),
                role,
            )
            for role in ("prefill", "both")
        }
        held = {}
        for role, engine in engines.items():
            request = GenerationRequest(role, PROMPT, 1, hand_over=role == "both")
            async for _ in engine.generate(request):
                # The first token: the store must hold every full block of the prompt by now.
                held[role] = await engine.shared_store.longest_prefix(request.block_hashes)
        background = SimulatedEngine(
            BlockPool(512, 16), timing, VOCABULARY, 8, RecordedEvents(),  # type: ignore[arg-type]
            SharedBlockStore(redis_server.url, "background"),
        )  # fmt: skip
        plain = GenerationRequest("plain", PROMPT, 1)
        async for _ in background.generate(plain):
            held["both, no hand-over"] = await background.shared_store.longest_prefix(plain.block_hashes)
        return held["prefill"], held["both"], held["both, no hand-over"]

    prefill, both, background = asyncio.run(scenario())
    assert prefill == both == FULL_BLOCKS
    assert background == 0  # written only after the first token, in the background
