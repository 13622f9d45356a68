"""KV-event payloads as engines publish them, for the tests and the fuzzing of the compiled scan
(router/index/_ingest.pyx `scan_batch`): every encoding of events and batches, engine hash
styles, dropped trailing defaults and unknown fields (`payload_of`); random corruptions of them
(`mutate`); and the property the scan keeps on any payload (`check_scan`): it accepts only what the
msgpack decoder decodes, to the same events, which build the same index."""

from __future__ import annotations

import importlib
import random
from typing import Any

import msgspec

from kvgate_testing.event_publisher import encode_batch
from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.index_streams import StreamMaker, decode_streams, internal_state
from kvwire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, decode_batch, event_kind

STORED_FIELDS = tuple(BlockStored.__struct_fields__)
REMOVED_FIELDS = tuple(BlockRemoved.__struct_fields__)


# The spellings of an engine's block hashes that `wire_hash` writes.
HASH_STYLES = ("u64", "i64", "bytes")


def wire_hash(block_hash: Any, style: str) -> Any:
    """An engine hash as an engine of `style` spells it (the same hash always the same way)."""
    if not isinstance(block_hash, int):
        return block_hash
    if style == "i64":  # SGLang: signed
        return block_hash - 2**40 if block_hash % 3 == 0 else block_hash
    if style == "bytes":
        return block_hash.to_bytes(16, "big", signed=True)
    return block_hash | 1 << 63 if block_hash % 5 == 0 and 0 <= block_hash < 2**63 else block_hash  # uint64


def wire_event(event: KVEvent, encoding: str, hashes: str, rand: random.Random) -> Any:
    """`event` as msgpack-ready data: a map with "type" (vLLM >= 0.24) or an array, tag first
    (older vLLM, SGLang), trailing defaults dropped at random and unknown extra fields added."""
    kind = event_kind(event)
    if isinstance(event, AllBlocksCleared):
        return [kind] if encoding == "array" else {"type": kind}
    names = STORED_FIELDS if isinstance(event, BlockStored) else REMOVED_FIELDS
    values = {name: getattr(event, name) for name in names}
    values["block_hashes"] = [wire_hash(h, hashes) for h in event.block_hashes]
    if isinstance(event, BlockStored):
        values["parent_block_hash"] = wire_hash(event.parent_block_hash, hashes)
        # (msgpack's ints stop at 2**64 - 1: a larger token id goes out as the largest)
        values["token_ids"] = [min(token, 2**64 - 1) for token in event.token_ids]
        if values["extra_keys"] is None and rand.random() < 0.5:  # vLLM: one None per block
            values["extra_keys"] = [None] * len(event.block_hashes)
        if rand.random() < 0.5:
            values["kv_cache_spec_kind"] = "full_attention"
    if encoding == "array":
        row = [kind, *values.values()]
        if rand.random() < 0.2:  # a field of a later version, after all of these
            return [*row, {"a field": ["from", 1.5, b"a later version"]}]
        while len(row) > 2 and row[-1] is None and rand.random() < 0.7:
            row.pop()
        return row
    fields = {"type": kind, **values}
    if rand.random() < 0.5:
        fields = {name: value for name, value in fields.items() if value is not None or name == "type"}
    if rand.random() < 0.3:
        fields["a_newer_field"] = {"nested": [1, None, True, msgspec.msgpack.Ext(5, b"x")]}
    if rand.random() < 0.3:  # the tag need not come first
        fields = dict(reversed(list(fields.items())))
    return fields


def payload_of(events: list[KVEvent], rand: random.Random, hashes: str) -> bytes:
    event_encoding = rand.choice(["map", "map", "array"])
    batch_encoding = rand.choice(["array", "array", "map", "sglang-map"])
    wired = [wire_event(event, event_encoding, hashes, rand) for event in events]
    rank = rand.choice([0, None, 3])
    return encode_batch(wired, ts=1000.0 + rand.random(), rank=rank, encoding=batch_encoding)


def payload_corpus(rand: random.Random, maker: StreamMaker, calls: int) -> list[bytes]:
    """Payloads of `calls` calls of `maker`'s event streams, each in encodings and a hash style
    `rand` picks."""
    return [payload_of(events, rand, rand.choice(HASH_STYLES)) for events in decode_streams(maker, calls)]


# msgpack type bytes worth writing over a payload's bytes: fixmap/fixarray/fixstr edges, nil, bools,
# bin/ext/float/int/str/array/map headers of every width, negative fixint.
_FORMAT_BYTES = bytes(
    [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xC3, 0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9,
     0xCA, 0xCB, 0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD3, 0xD4, 0xD8, 0xD9, 0xDA, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF,
     0xE0, 0xFF]
)  # fmt: skip


def mutate(rand: random.Random, payload: bytes, corpus: list[bytes]) -> bytes:
    """`payload` with one to four random corruptions: a byte set, set to a msgpack type byte or
    bit-flipped, bytes deleted or inserted, the payload cut short, or bytes of another spliced in."""
    data = bytearray(payload)
    for _ in range(rand.randint(1, 4)):
        if not data:
            data = bytearray(rand.choice(corpus))
        at = rand.randrange(len(data))
        operation = rand.randrange(7)
        if operation == 0:
            data[at] = rand.randrange(256)
        elif operation == 1:
            data[at] = rand.choice(_FORMAT_BYTES)
        elif operation == 2:
            data[at] ^= 1 << rand.randrange(8)
        elif operation == 3:
            del data[at : at + rand.randint(1, 8)]
        elif operation == 4:
            data[at:at] = rand.randbytes(rand.randint(1, 8))
        elif operation == 5:
            del data[at:]
        else:
            other = rand.choice(corpus)
            start = rand.randrange(len(other))
            data[at:at] = other[start : start + rand.randint(1, 64)]
    return bytes(data)


def check_scan(payload: bytes) -> str:
    """What the compiled scan made of `payload` ("refused" by both, "decoded only", "scanned"),
    asserting that it scans only what the decoder decodes, to as many events, that build the index
    the decoded events build."""
    frames = importlib.import_module("kvwire._frames")
    batch = frames.scan_batch(payload)
    try:
        decoded = decode_batch(payload)
    except Exception as error:  # the decoder's refusal (kvwire.WireError or msgspec's)
        assert batch is None, f"scanned a payload the decoder refuses ({error!r}): {payload!r}"
        return "refused"
    if batch is None:
        return "decoded only"
    assert len(batch) == len(decoded.events), (payload, len(batch), len(decoded.events))
    wired, plain = WritableIndex(), WritableIndex(compiled_ingest=False)
    plain.apply("a", decoded.events)
    wire = wired.wire_ingest("a")
    assert wire is not None
    wire.apply([wire.scan(payload)])
    assert internal_state(wired, "a") == internal_state(plain, "a"), payload
    return "scanned"
