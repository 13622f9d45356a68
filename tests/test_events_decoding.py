"""Every KV-event dialect decodes: array/map batches and events, int/bytes hashes, vLLM and SGLang
field sets, unknown fields and event types, cache-layer chunks, and the examples of LMCache's
documentation (docs/index.md, "Events")."""

from __future__ import annotations

import msgspec
import pytest

from kvgate_testing.event_publisher import (
    LMCACHE_VLLM_EVENT,
    LMCACHE_VLLM_HASH,
    LMCACHE_VLLM_TOKENS,
    SGLANG_FIRST,
    SGLANG_FIRST_EVENT,
    SGLANG_SECOND,
    SGLANG_SECOND_EVENT,
    all_blocks_cleared,
    block_removed,
    block_stored,
    encode_batch,
)
from kvgate_testing.index_oracle import WritableIndex
from kvwire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedBatch,
    cache_salt_of,
    decode_batch,
    decode_seq,
    encode_seq,
    event_kind,
    tier_of,
)

TOKENS = list(range(100, 132))


@pytest.mark.parametrize("batch_encoding", ["array", "map", "sglang-map"])
@pytest.mark.parametrize("event_encoding", ["array", "map"])
def test_every_batch_and_event_encoding_decodes(batch_encoding: str, event_encoding: str) -> None:
    events = [
        block_stored([1, 2], TOKENS, 16, encoding=event_encoding),
        block_removed([2], encoding=event_encoding),
        all_blocks_cleared(encoding=event_encoding),
    ]
    batch = decode_batch(encode_batch(events, rank=3, encoding=batch_encoding, ts=12.5))
    assert batch.ts == 12.5
    assert batch.data_parallel_rank == 3
    assert [event_kind(e) for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [1, 2]
    assert stored.token_ids == TOKENS
    assert stored.block_size == 16
    assert isinstance(batch.events[1], BlockRemoved)
    assert isinstance(batch.events[2], AllBlocksCleared)
    assert batch.skipped_events == 0


@pytest.mark.parametrize(
    "block_hash",
    [2**64 - 1, 2**63 + 5, -7651984371600085018, 0, bytes(range(32))],
    ids=["uint64-max", "uint64-above-2^63", "int64-negative", "zero", "bytes32"],
)
def test_hashes_of_every_kind_decode_unchanged(block_hash: int | bytes) -> None:
    payload = encode_batch([block_stored([block_hash], TOKENS[:16], 16, parent_block_hash=block_hash)])
    stored = decode_batch(payload).events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [block_hash]
    assert stored.parent_block_hash == block_hash


def test_vllm_032_map_event_with_every_field_and_unknown_extras() -> None:
    event = block_stored(
        [11, 12],
        TOKENS,
        16,
        parent_block_hash=10,
        extra_keys=[["salt-a"], None],
        extra_fields={"kv_cache_spec_sliding_window": None, "some_future_field": {"x": [1, 2]}},
    )
    stored = decode_batch(encode_batch([event])).events[0]
    assert isinstance(stored, BlockStored)
    assert stored.kv_cache_spec_kind == "full_attention"
    assert stored.group_idx == 0
    assert cache_salt_of(stored) == "salt-a"


def test_old_array_event_with_trailing_fields_omitted_and_extra_trailing_fields() -> None:
    short = ["BlockStored", [1], None, TOKENS[:16], 16]
    long = [
        "BlockStored",
        [1],
        None,
        TOKENS[:16],
        16,
        None,
        "CPU",
        None,
        None,
        0,
        "full_attention",
        None,
        "new",
    ]
    batch = decode_batch(encode_batch([short, long]))
    assert [e.medium for e in batch.events] == [None, "CPU"]  # type: ignore[union-attr]
    assert batch.skipped_events == 0


def test_unknown_event_type_and_bad_event_are_skipped_not_fatal() -> None:
    events = [
        {"type": "SomethingNew", "x": 1},
        ["BlockStored", "not-a-list"],
        block_stored([5], TOKENS[:16], 16),
    ]
    batch = decode_batch(encode_batch(events))
    assert batch.skipped_events == 2
    assert [event_kind(e) for e in batch.events] == ["BlockStored"]


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgspec.msgpack.encode("a string"), msgspec.msgpack.encode([1.0]), b"\x93\x01"],
    ids=["empty", "invalid-msgpack", "not-a-batch", "missing-events", "truncated"],
)
def test_payloads_that_are_not_batches_raise_malformed(payload: bytes) -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(payload)


def test_seq_frames() -> None:
    assert decode_seq(encode_seq(0)) == 0
    assert decode_seq((2**40).to_bytes(8, "big")) == 2**40
    assert decode_seq(b"\xff" * 8) == -1  # the replay end marker
    with pytest.raises(ValueError, match="8"):
        decode_seq(b"\x00\x01")


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, "gpu"),
        ("GPU", "gpu"),
        ("CPU", "cpu"),
        ("cpu", "cpu"),
        ("LocalDiskBackend", "disk"),
        ("nvme", "nvme"),
    ],
)
def test_medium_names_map_to_tiers(medium: str | None, tier: str) -> None:
    assert tier_of(medium) == tier


def test_cache_salt_is_found_beside_a_lora_name_and_multimodal_keys() -> None:
    stored = BlockStored(
        block_hashes=[1],
        token_ids=TOKENS[:16],
        lora_name="adapter",
        extra_keys=[["adapter", ["mm", 0], "s1"]],
    )
    assert cache_salt_of(stored) == "s1"
    assert cache_salt_of(BlockStored(block_hashes=[1], lora_name="adapter", extra_keys=[["adapter"]])) is None
    assert cache_salt_of(BlockStored(block_hashes=[1], extra_keys=[None])) is None


def test_real_example_vllm_with_lmcache_chunk() -> None:
    """LMCache's documented vLLM + LMCache event: one 36-token chunk, a 32-byte hash, medium 'cpu'."""
    batch = decode_batch(encode_batch([LMCACHE_VLLM_EVENT]))
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [LMCACHE_VLLM_HASH]
    assert len(stored.token_ids) == 36
    index = WritableIndex()
    index.apply("engine", batch.events)
    match = index.longest_cached_prefix([*LMCACHE_VLLM_TOKENS, 5, 6, 7])["engine"]
    assert match.by_tier == {"cpu": 36}
    index.apply("engine", [BlockRemoved(block_hashes=[LMCACHE_VLLM_HASH], medium="cpu")])
    assert index.longest_cached_prefix(LMCACHE_VLLM_TOKENS)["engine"].tokens == 0


def test_real_example_sglang_with_lmcache_overlapping_chunks() -> None:
    """The SGLang + LMCache pair of LMCache's documentation: signed hashes, chunks of 8 carrying 9 tokens."""
    batch = decode_batch(
        encode_batch([SGLANG_FIRST_EVENT, SGLANG_SECOND_EVENT], encoding="sglang-map", rank=0)
    )
    assert batch.data_parallel_rank == 0
    index = WritableIndex()
    index.apply("sglang", batch.events)
    prompt = SGLANG_FIRST[:8] + SGLANG_SECOND[:8] + [42, 43]
    # 16 tokens cached: the shared token 5535 is counted once.
    assert index.longest_cached_prefix(prompt)["sglang"].tokens == 16
    assert index.longest_cached_prefix([*SGLANG_FIRST[:8], 1, 2, 3])["sglang"].tokens == 8
