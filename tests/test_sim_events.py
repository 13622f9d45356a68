"""The simulated engine's KV events over real ZMQ sockets: decoded by the gateway's own decoder,
they rebuild exactly the engine's cache, live and through replay, in every encoding."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from kvgate_testing.ports import free_port
from kvwire import (
    ENCODINGS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    decode_batch,
    encode_batch,
    parse_kv_events_config,
)
from router.sim.blocks import BlockPool, block_hash
from router.sim.engine import GenerationRequest, SimulatedEngine, TimingModel

TOPIC = "kv-events"
BLOCK = 4
FAST = TimingModel(prefill_us_per_token=1.0, prefill_overhead_ms=0.1, decode_ms_per_token=0.1)


def _unsigned(value: int) -> int:
    return value & ((1 << 64) - 1)


def _apply(events: list, cache: dict[int, list[int]]) -> None:
    """Replay decoded events onto a model of the engine's cache (hash -> the block's tokens)."""
    for event in events:
        if isinstance(event, BlockStored):
            for i, value in enumerate(event.block_hashes):
                block_tokens = event.token_ids[i * BLOCK : (i + 1) * BLOCK]
                assert len(block_tokens) == BLOCK, "only full blocks may be announced"
                cache[_unsigned(value)] = block_tokens
            assert event.medium == "GPU"
        elif isinstance(event, BlockRemoved):
            for value in event.block_hashes:
                assert _unsigned(value) in cache, "removal of a block never announced"
                del cache[_unsigned(value)]
        elif isinstance(event, AllBlocksCleared):
            cache.clear()


def _stored_hashes_match_their_tokens(events: list) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            parent = None if event.parent_block_hash is None else _unsigned(event.parent_block_hash)
            for i, value in enumerate(event.block_hashes):
                chunk = np.asarray(event.token_ids[i * BLOCK : (i + 1) * BLOCK], dtype=np.uint32)
                salt = event.extra_keys[i] if event.extra_keys and event.extra_keys[i] else None
                assert block_hash(parent, chunk, tuple(salt) if salt else None) == _unsigned(value)
                parent = _unsigned(value)


async def _run_workload(engine: SimulatedEngine) -> None:
    rng = np.random.default_rng(7)
    families = [rng.integers(0, 5000, 24, dtype=np.uint32) for _ in range(5)]

    async def one(i: int) -> None:
        family = families[i % len(families)]
        prompt = np.concatenate([family, rng.integers(0, 5000, 1 + i % 7, dtype=np.uint32)])
        request = GenerationRequest(
            f"r{i}", prompt, max_tokens=5 + i % 4, cache_salt="s" if i % 6 == 0 else None
        )
        async for _ in engine.generate(request):
            pass

    # Waves of concurrent requests over a pool too small for every family: hits and evictions.
    for wave in range(4):
        await asyncio.gather(*(one(wave * 8 + i) for i in range(8)))


async def _replay(endpoint: str, start_seq: int) -> list[list[bytes]]:
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    replies = []
    try:
        await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), timeout=5)
            replies.append(frames)
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                return replies
    finally:
        dealer.close(linger=0)
        context.term()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_events_rebuild_the_engine_cache_live_and_by_replay(encoding):
    async def scenario() -> None:
        pub_endpoint = f"tcp://127.0.0.1:{free_port()}"
        replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        publisher = EventPublisher(
            pub_endpoint, replay_endpoint, topic=TOPIC, encoding=encoding, data_parallel_rank=0, bind=True
        )
        context = zmq.asyncio.Context()
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        subscriber.connect(pub_endpoint)
        await asyncio.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the publisher
        engine = SimulatedEngine(
            BlockPool(40, BLOCK), FAST, np.arange(100, 200, dtype=np.uint32), 8, publisher
        )
        try:
            await _run_workload(engine)
            assert engine.reset_prefix_cache()
            await _run_workload(engine)

            live: list[tuple[int, list]] = []
            while await subscriber.poll(timeout=500):
                topic, seq, payload = await subscriber.recv_multipart()
                assert topic == TOPIC.encode()
                live.append((int.from_bytes(seq, "big"), decode_batch(payload).events))
            assert [seq for seq, _ in live] == list(range(len(live)))
            decoded = [event for _, events in live for event in events]
            assert any(isinstance(e, BlockRemoved) for e in decoded), "no eviction happened"
            assert any(isinstance(e, AllBlocksCleared) for e in decoded)

            cache: dict[int, list[int]] = {}
            for _, events in live:
                if encoding != "sglang":  # SGLang's field set has no extra_keys to rehash salted blocks
                    _stored_hashes_match_their_tokens(events)
                _apply(events, cache)
            assert set(cache) == engine.pool.cached_hashes()

            replies = await _replay(replay_endpoint, 0)
            *batches, end = replies
            assert end == [b"", TOPIC.encode(), (-1).to_bytes(8, "big", signed=True), b""]
            assert [(int.from_bytes(f[2], "big"), decode_batch(f[3]).events) for f in batches] == live
            assert all(len(f) == 4 and f[0] == b"" and f[1] == TOPIC.encode() for f in batches)

            later = await _replay(replay_endpoint, len(live) - 2)
            assert [int.from_bytes(f[2], "big") for f in later[:-1]] == [len(live) - 2, len(live) - 1]
        finally:
            subscriber.close(linger=0)
            context.term()
            publisher.close()

    asyncio.run(scenario())


def test_encodings_differ_on_the_wire_as_documented():
    big = (1 << 64) - 5  # above 2^63: unsigned for vLLM, negative for SGLang
    event = BlockStored(
        block_hashes=[big], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4, medium="GPU"
    )
    as_map = msgspec.msgpack.decode(encode_batch([event], ts=1.0, data_parallel_rank=0, encoding="vllm"))
    assert as_map[1][0]["type"] == "BlockStored" and as_map[1][0]["block_hashes"] == [big]
    assert as_map[1][0]["medium"] == "GPU" and as_map[2] == 0
    as_array = msgspec.msgpack.decode(encode_batch([event], ts=1.0, encoding="vllm-array"))
    assert as_array[1][0] == ["BlockStored", [big], None, [1, 2, 3, 4], 4, None, "GPU"]
    as_sglang = msgspec.msgpack.decode(encode_batch([event], ts=1.0, encoding="sglang"))
    assert as_sglang[1][0][1] == [big - (1 << 64)]


def test_kv_events_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_kv_events_config("{endpoint")
    with pytest.raises(ValueError, match="must start with tcp://"):
        parse_kv_events_config(
            '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "127.0.0.1:5"}'
        )
    with pytest.raises(ValueError, match="publisher 'kafka'"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "kafka"}')
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "t", "new": 1}'
    )
    assert config.topic == "t" and config.replay_endpoint is None
