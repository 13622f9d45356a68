"""The simulated shared tier's removals (`--shared-tier-removals`): what the store loses is retracted
in the shared medium, a restarted store clears that medium, and without the option nothing is."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvgate_testing.redis_server import RedisServer, running_redis
from kvwire import AllBlocksCleared, BlockRemoved, BlockStored
from router.sim.blocks import BlockPool
from router.sim.cli import main as sim_main
from router.sim.engine import GenerationRequest, SimulatedEngine, TimingModel
from router.sim.shared_store import MEDIUM_SHARED, SharedBlockStore, block_key, tier_prefix

VOCABULARY = np.arange(1000, 1100, dtype=np.uint32)
FAST = TimingModel(prefill_us_per_token=1.0, prefill_overhead_ms=0.0, decode_ms_per_token=0.1)
NOTIFYING = ("--notify-keyspace-events", "Exeg")


class RecordedEvents:
    def __init__(self) -> None:
        self.events: list = []

    def publish(self, events: list) -> None:
        self.events.extend(events)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind) and e.medium == MEDIUM_SHARED]

    def removed(self) -> list[int]:
        return [h for event in self.of(BlockRemoved) for h in event.block_hashes]


def member(url: str, events: RecordedEvents, watch: bool = True) -> SimulatedEngine:
    return SimulatedEngine(
        BlockPool(512, 16), FAST, VOCABULARY, 8, events,  # type: ignore[arg-type]
        SharedBlockStore(url, "docs"), watch_shared_removals=watch,
    )  # fmt: skip


async def serve(engine: SimulatedEngine, prompt: np.ndarray, name: str) -> GenerationRequest:
    request = GenerationRequest(name, prompt, 1)
    async for _ in engine.generate(request):
        pass
    return request


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def announced_all(engine: SimulatedEngine, events: RecordedEvents, hashes: list[int]) -> None:
    await until(
        lambda: set(hashes) <= {h for e in events.of(BlockStored) for h in e.block_hashes},
        "the engine never announced its prompt in the shared medium",
    )


def test_a_deleted_block_is_retracted_and_a_block_the_engine_never_announced_is_not():
    with running_redis(*NOTIFYING) as server:

        async def scenario() -> tuple[list[int], list[int]]:
            events = RecordedEvents()
            engine = member(server.url, events)
            engine.start()
            await until(lambda: engine.shared_store.subscriptions == 1, "the removal watch never subscribed")
            request = await serve(engine, np.arange(200, dtype=np.uint32), "a")
            await announced_all(engine, events, request.block_hashes)
            with server.client() as client:
                client.set(block_key("docs", 12345), b"1")  # a block another member wrote
                client.delete(block_key("docs", 12345), block_key("docs", request.block_hashes[3]))
            await until(lambda: events.removed(), "no removal announced")
            await asyncio.sleep(0.1)  # anything more would have arrived by now
            await engine.close()
            return request.block_hashes, events.removed()

        hashes, removed = asyncio.run(scenario())
    assert removed == [hashes[3]]


def test_every_block_the_store_evicts_under_pressure_is_retracted():
    # A server with room for a fraction of what the engine writes (allkeys-lru): afterwards, what
    # the engine still announces is exactly what the store holds.
    with running_redis(*NOTIFYING, "--maxmemory-policy", "allkeys-lru") as server:
        with server.client() as client:
            client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 1024 * 1024)

        async def scenario() -> tuple[set[int], set[int], int]:
            events = RecordedEvents()
            engine = member(server.url, events)
            engine.start()
            await until(lambda: engine.shared_store.subscriptions == 1, "the removal watch never subscribed")
            for index in range(120):  # 30k blocks, about three times what fits
                prompt = np.arange(index * 10_000, index * 10_000 + 4096, dtype=np.uint32)
                request = await serve(engine, prompt, f"r{index}")
                await announced_all(engine, events, request.block_hashes)
            with server.client() as client:
                await until(lambda: client.info("stats")["evicted_keys"] > 0, "the server never evicted")

                def held() -> set[int]:
                    prefix = tier_prefix("docs")
                    return {int(k.decode()[len(prefix) :]) for k in client.scan_iter(match=f"{prefix}*")}

                await until(lambda: engine.announced() == held(), "announced and held never agreed")
                evicted = int(client.info("stats")["evicted_keys"])
                truth = held()
            await engine.close()
            return engine.announced(), truth, evicted

        announced, truth, evicted = asyncio.run(scenario())
    assert evicted > 10_000 and announced == truth and len(truth) > 0


def test_a_restarted_store_clears_the_shared_medium_and_the_engine_announces_anew():
    with running_redis(*NOTIFYING) as server:

        async def scenario() -> tuple[RecordedEvents, list[int], int]:
            events = RecordedEvents()
            engine = member(server.url, events)
            engine.start()
            await until(lambda: engine.shared_store.subscriptions == 1, "the removal watch never subscribed")
            first = await serve(engine, np.arange(200, dtype=np.uint32), "a")
            await announced_all(engine, events, first.block_hashes)
            await asyncio.to_thread(restart, server)
            await until(lambda: events.of(AllBlocksCleared), "no clear after the restart", timeout_s=20)
            held_after = await engine.shared_store.longest_prefix(first.block_hashes)
            second = await serve(engine, np.arange(5000, 5200, dtype=np.uint32), "b")
            await announced_all(engine, events, second.block_hashes)
            await engine.close()
            return events, second.block_hashes, held_after

        events, second_hashes, held_after = asyncio.run(scenario())
    assert held_after == 0  # the new server holds nothing of what the old one did
    kinds = [type(e).__name__ for e in events.events if e.medium == MEDIUM_SHARED]
    assert kinds == ["BlockStored", "AllBlocksCleared", "BlockStored"]
    assert events.of(BlockStored)[1].block_hashes == second_hashes


def restart(server: RedisServer) -> None:
    server.kill()
    server.start()


def test_without_the_option_nothing_the_store_loses_is_retracted():
    with running_redis(*NOTIFYING) as server:

        async def scenario() -> RecordedEvents:
            events = RecordedEvents()
            engine = member(server.url, events, watch=False)
            engine.start()
            request = await serve(engine, np.arange(200, dtype=np.uint32), "a")
            await announced_all(engine, events, request.block_hashes)
            with server.client() as client:
                client.delete(*[block_key("docs", h) for h in request.block_hashes])
            await asyncio.sleep(0.3)
            await engine.close()
            return events

        events = asyncio.run(scenario())
    assert events.removed() == [] and events.of(AllBlocksCleared) == []


def test_the_option_without_a_shared_tier_is_refused(capsys: pytest.CaptureFixture[str]):
    assert sim_main(["--model", "m", "--shared-tier-removals"]) == 2
    assert "--shared-tier-removals watches a shared tier; give --shared-tier" in capsys.readouterr().err
