"""Payloads applied without decoding them (`PrefixIndex.wire_ingest`): the compiled scan accepts
only what the msgpack decoder decodes to the same events, one for one, and the index it builds
from the payloads is the one the decoded events build, in every encoding engines publish."""

from __future__ import annotations

import importlib
import random
from typing import Any

import msgspec
import pytest

from kvgate_testing.event_publisher import (
    LMCACHE_VLLM_EVENT,
    SGLANG_FIRST_EVENT,
    SGLANG_SECOND_EVENT,
    encode_batch,
)
from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.index_streams import StreamMaker, assert_same_lookups, decode_streams, internal_state
from kvgate_testing.wire_payloads import HASH_STYLES, check_scan, mutate, payload_corpus, payload_of
from kvwire import BlockRemoved, BlockStored, DecodedBatch, MalformedBatch, decode_batch, event_kind
from router.index.store import PrefixIndex

ingest = importlib.import_module("router.index._ingest")
# The wire protocol's compiled frame reader (kvwire/_frames.pyx), which the compiled writer reads.
frames = importlib.import_module("kvwire._frames")


def apply_payloads(index: WritableIndex, payloads: list[bytes]) -> int:
    """The subscriber's way: the payloads raw to the writer (`IndexWriter.apply_payloads`), which
    applies those its scan takes undecoded and decodes the others. How many were scanned."""
    return sum(1 for batch in index.apply_payloads("a", payloads) if type(batch) is frames.WireBatch)


def test_apply_payloads_reads_each_payload_once_and_applies_them_in_order() -> None:
    """What `apply_payloads` answers for each payload (the scanned batch, the decoded batch of one
    the scan refuses, the decoder's refusal), in the payloads' order, and the index it builds:
    the one the decoded events build, applied one payload at a time. The reference writer
    (`compiled_ingest=False`) decodes every payload."""
    maker = StreamMaker(31)
    payloads = payload_corpus(random.Random(31), maker, 40)
    first = decode_batch(payloads[0]).events[0]
    unknown = encode_batch([{"type": "Unknown"}, msgspec.to_builtins(first)])
    garbage = b"\xc1 not msgpack"
    mixed = [*payloads[:5], unknown, garbage, *payloads[5:]]
    wired, plain = WritableIndex(), WritableIndex(compiled_ingest=False)
    read = wired.apply_payloads("a", mixed)
    assert [type(batch) for batch in read[5:7]] == [DecodedBatch, MalformedBatch]
    assert read[5].skipped_events == 1 and len(read[5].events) == 1
    assert sum(1 for batch in read if type(batch) is frames.WireBatch) > len(payloads) // 2
    reference_read = plain.apply_payloads("a", mixed)
    assert {type(batch) for batch in reference_read} == {DecodedBatch, MalformedBatch}
    one_by_one = WritableIndex(compiled_ingest=False)
    for payload in mixed[:6] + mixed[7:]:
        one_by_one.apply("a", decode_batch(payload).events)
    assert internal_state(wired, "a") == internal_state(one_by_one, "a")
    assert internal_state(plain, "a") == internal_state(one_by_one, "a")
    assert_same_lookups(one_by_one, [wired, plain], maker.docs)


class CountingWireWriter(ingest.BackendWriter):
    """The compiled writer, counting what `store_wire` applied of the batches the index's Python
    entry hands it (those the compiled entry did not apply whole): events, and whether whole."""

    applied: list[int]
    whole: list[bool]

    def store_wire(self, batch: Any, start: int = 0) -> int:
        stopped = super().store_wire(batch, start)
        CountingWireWriter.applied.append(stopped - start)
        CountingWireWriter.whole.append(stopped == len(batch))
        return stopped


@pytest.fixture
def counting_writer(monkeypatch) -> type[CountingWireWriter]:
    CountingWireWriter.applied, CountingWireWriter.whole = [], []
    monkeypatch.setattr(ingest, "BackendWriter", CountingWireWriter)
    return CountingWireWriter


@pytest.mark.parametrize("hashes", HASH_STYLES)
@pytest.mark.parametrize("seed", range(4))
def test_payloads_applied_undecoded_build_the_index_their_decoded_events_build(
    seed: int, hashes: str, counting_writer
) -> None:
    wired, decoded = WritableIndex(), WritableIndex(compiled_ingest=False)
    maker = StreamMaker(500 + seed)
    rand = random.Random(seed)
    scanned = total = 0
    pending: list[bytes] = []
    for call, events in enumerate(decode_streams(maker, 160)):
        payload = payload_of(events, rand, hashes)
        decoded.apply("a", decode_batch(payload).events)
        pending.append(payload)
        total += 1
        if rand.random() < 0.6:  # a drain of one to a few messages
            scanned += apply_payloads(wired, pending)
            pending = []
        if call % 40 == 39:
            scanned += apply_payloads(wired, pending)
            pending = []
            assert internal_state(wired, "a") == internal_state(decoded, "a")
    scanned += apply_payloads(wired, pending)
    assert internal_state(wired, "a") == internal_state(decoded, "a")
    assert_same_lookups(decoded, [wired], maker.docs)
    # Most payloads are scanned (not those with salted roots or events the decoder skips); the
    # compiled entry applies scanned batches whole, and hands on those it refuses (the streams'
    # hazards reach it), which the Python entry's writer then applies in part.
    assert scanned > total // 2, (scanned, total)
    assert wired.writer.compiled_applied > 0 and sum(counting_writer.applied) > 0
    assert False in counting_writer.whole


def writer_of(index: PrefixIndex, backend: str) -> Any:
    """The backend's compiled writer (the caller holds the index's lock; the backend exists)."""
    state = index._backends[backend]
    if state.compiled_writer is None:
        state.compiled_writer = ingest.BackendWriter(index, state)
    return state.compiled_writer


@pytest.mark.parametrize("seed", range(3))
def test_the_writer_refuses_a_scanned_event_exactly_where_it_refuses_the_decoded_one(seed: int) -> None:
    """Twin indexes, one fed scanned payloads and one decoded events, each batch through the
    writer's entry for it (`store_wire`; `apply_one` alone in a batch, `store` in a run): the
    first event each refuses is the same, and the rest goes the same general way."""
    wired, decoded = WritableIndex(), WritableIndex()
    maker = StreamMaker(700 + seed)
    rand = random.Random(seed)
    refusals = 0
    wired.add_backend("a")
    decoded.add_backend("a")
    for events in decode_streams(maker, 160):
        payload = payload_of(events, rand, rand.choice(HASH_STYLES))
        batch, events = frames.scan_batch(payload), decode_batch(payload).events
        if batch is None:
            wired.apply("a", events)
            decoded.apply("a", events)
            continue
        with wired._lock, decoded._lock:
            wired_writer, decoded_writer = writer_of(wired, "a"), writer_of(decoded, "a")
            stopped = wired_writer.store_wire(batch)
            if len(events) == 1:
                assert stopped == int(decoded_writer.apply_one(events[0]))
            else:
                assert stopped == decoded_writer.store(events, 0)
            if stopped < len(events):
                refusals += 1
                for index, writer in ((wired, wired_writer), (decoded, decoded_writer)):
                    index.writer._apply_mixed_locked(index._backends["a"], writer, events, stopped, True)
    assert internal_state(wired, "a") == internal_state(decoded, "a")
    assert refusals > 10


def test_decode_steps_prefills_and_evictions_from_the_wire_take_the_compiled_path(counting_writer) -> None:
    index, reference = WritableIndex(), WritableIndex(compiled_ingest=False)
    rand = random.Random(5)
    tokens = [rand.randrange(150_000) for _ in range(64 * 16)]
    prefill = BlockStored(block_hashes=list(range(1, 65)), token_ids=tokens, block_size=16, medium="GPU")
    steps = [
        BlockStored(
            block_hashes=[100 + n],
            parent_block_hash=64 if n == 0 else 99 + n,
            token_ids=[rand.randrange(150_000) for _ in range(16)],
            block_size=16,
            medium="GPU",
        )
        for n in range(8)
    ]
    payloads = [
        payload_of([prefill], rand, "u64"),
        *[payload_of([step], rand, "u64") for step in steps[:4]],
        payload_of(steps[4:], rand, "u64"),
        payload_of([BlockRemoved(block_hashes=[107], medium="GPU")], rand, "u64"),
        payload_of(
            [BlockRemoved(block_hashes=[106], medium="GPU"), BlockRemoved(block_hashes=[105])],
            rand,
            "u64",
        ),
    ]
    assert apply_payloads(index, payloads) == len(payloads)
    for payload in payloads:
        reference.apply("a", decode_batch(payload).events)
    # Every event applied by the compiled writer: through the compiled entry, or the Python entry
    # (the first batch, before the backend had a writer), none decoded.
    assert all(counting_writer.whole)
    assert index.writer.compiled_applied + sum(counting_writer.applied) == 12
    assert internal_state(index, "a") == internal_state(reference, "a")
    assert index.longest_cached_prefix(tokens + steps[0].token_ids)["a"].tokens == 64 * 16 + 16
    stats = index.stats("a")
    assert (stats.stored_events, stats.removed_events) == (9, 3)


DEEP: list = [1]
for _ in range(40):
    DEEP = [DEEP]


def mutations(payload: bytes, rand: random.Random, count: int) -> list[bytes]:
    """Payloads a byte or two away from `payload`, cut short, or grown."""
    out = []
    for _ in range(count):
        data = bytearray(payload)
        roll = rand.random()
        if roll < 0.6:
            for _ in range(rand.randint(1, 2)):
                data[rand.randrange(len(data))] = rand.randrange(256)
        elif roll < 0.8:
            del data[rand.randrange(len(data)) :]
        else:
            data.insert(rand.randrange(len(data) + 1), rand.randrange(256))
        out.append(bytes(data))
    return out


def test_the_scan_accepts_only_payloads_the_decoder_decodes_to_the_same_events() -> None:
    """Fuzzed payloads: whatever the scan accepts, the decoder decodes whole (no event skipped),
    to as many events of the same kinds; and valid payloads of every encoding are accepted."""
    rand = random.Random(11)
    maker = StreamMaker(900)
    accepted = rejected = 0
    for events in decode_streams(maker, 60):
        plain = [  # (no salted roots, no float token ids: the decoder skips those)
            event
            for event in events
            if not isinstance(event, BlockStored)
            or (not event.extra_keys and all(isinstance(token, int) for token in event.token_ids))
        ]
        payload = payload_of(plain, rand, rand.choice(HASH_STYLES))
        batch = frames.scan_batch(payload)
        assert batch is not None and len(batch) == len(plain)
        for candidate in [payload, *mutations(payload, rand, 60)]:
            batch = frames.scan_batch(candidate)
            if batch is None:
                rejected += 1
                continue
            accepted += 1
            decoded = decode_batch(candidate)
            assert decoded.skipped_events == 0
            kinds = [event_kind(event) for event in decoded.events]
            assert len(batch) == len(kinds)
            assert (batch.stored, batch.removed, batch.cleared) == (
                kinds.count("BlockStored"), kinds.count("BlockRemoved"), kinds.count("AllBlocksCleared"),
            )  # fmt: skip
            assert batch.ts == decoded.ts and batch.data_parallel_rank == decoded.data_parallel_rank
    assert accepted > 100 and rejected > 100, (accepted, rejected)


def one_event(event: Any) -> bytes:
    return msgspec.msgpack.encode([1.0, [event]])


# A batch holding one map-encoded BlockRemoved of block 1, then `tail` (msgpack bytes): a third key.
REMOVED_AND = b"\x92\x01\x91\x83\xa4type\xacBlockRemoved\xacblock_hashes\x91\x01"
REFUSED = {
    "not msgpack": b"\xc1\xc1",
    "empty": b"",
    "an int": msgspec.msgpack.encode(5),
    "a batch without events": msgspec.msgpack.encode([1.0]),
    "a string for ts": msgspec.msgpack.encode(["now", []]),
    "trailing bytes": msgspec.msgpack.encode([1.0, []]) + b"\x00",
    "an unknown event type": one_event({"type": "BlockMoved", "block_hashes": [1]}),
    "an event without a type": one_event({"block_hashes": [1]}),
    "a float token": one_event({"type": "BlockStored", "block_hashes": [1], "token_ids": [1.5]}),
    "a bool group": one_event(["BlockRemoved", [1], "GPU", True]),
    "a str hash": one_event(["BlockRemoved", ["h1"]]),
    "a salted root": one_event({"type": "BlockStored", "block_hashes": [1], "extra_keys": [["s"]]}),
    "a medium that is not UTF-8": REMOVED_AND + b"\xa6medium\xa2\xff\xfe",
    "a duplicate key": REMOVED_AND + b"\xacblock_hashes\x91\x02",
    "a deep nest": one_event({"type": "AllBlocksCleared", "x": DEEP}),
    # An array32 header claiming 4 billion events, then one: refused, nothing allocated for them.
    "an event count past the payload": b"\x92\x01\xdd\xff\xff\xff\xff\x90",
}


@pytest.mark.parametrize("what", REFUSED)
def test_the_scan_refuses_what_it_does_not_read_exactly(what: str) -> None:
    assert frames.scan_batch(REFUSED[what]) is None


@pytest.mark.parametrize("seed", range(2))
def test_corrupted_payloads_are_scanned_only_as_the_decoder_reads_them(seed: int) -> None:
    """Payloads of every encoding, corrupted at random (bytes set, flipped, cut, inserted, spliced:
    what a broken or hostile publisher sends): the scan refuses each the decoder refuses, and one
    it accepts holds the decoder's events and builds the index they build (kvgate_testing's
    `check_scan`; `make fuzz` runs the same for minutes against an AddressSanitizer build)."""
    rand = random.Random(seed)
    corpus = payload_corpus(rand, StreamMaker(900 + seed), 200)
    outcomes = {"refused": 0, "decoded only": 0, "scanned": 0}
    for _ in range(3000):
        outcomes[check_scan(mutate(rand, rand.choice(corpus), corpus))] += 1
    assert outcomes["refused"] > 1000 and outcomes["scanned"] > 100, outcomes


def test_an_index_without_the_compiled_path_has_no_wire_ingest() -> None:
    assert WritableIndex(compiled_ingest=False).wire_ingest("a") is None
    assert WritableIndex().wire_ingest("a") is not None


def test_the_examples_of_lmcache_docs_are_scanned_and_build_the_decoded_index() -> None:
    """vLLM + LMCache (a 36-token chunk, a 32-byte hash, medium "cpu") and SGLang + LMCache (signed
    hashes, chunks of 8 carrying 9 tokens, SGLang's map batch), scanned and applied undecoded."""
    payloads = [
        encode_batch([LMCACHE_VLLM_EVENT]),
        encode_batch([SGLANG_FIRST_EVENT, SGLANG_SECOND_EVENT], encoding="sglang-map", rank=0),
    ]
    for payload in payloads:
        wired, decoded = WritableIndex(), WritableIndex()
        wire = wired.wire_ingest("a")
        assert wire is not None
        batch = wire.scan(payload)
        assert batch is not None
        wire.apply([batch])
        decoded.apply("a", decode_batch(payload).events)
        assert internal_state(wired, "a") == internal_state(decoded, "a")
        assert wired.stats("a").stored_events == len(batch) > 0
