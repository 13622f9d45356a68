"""The one decoder of KV-event batches, for every dialect an engine may publish.

vLLM (old array-encoded and new map-encoded events), SGLang (`attn_dp_rank`, signed hashes) and
cache-layer chunk events (LMCache style) all arrive as msgpack. Batches and events may be arrays or
maps, independently; hashes may be unsigned or signed 64-bit ints or raw bytes; unknown extra
fields and unknown event types are ignored. Decoding never raises on a stranger's payload except
`MalformedBatch` for a payload that is not a batch at all.
"""

from __future__ import annotations

import msgspec

from kvwire.errors import MalformedBatch
from kvwire.events import (
    AllBlocksCleared,
    AllBlocksClearedMap,
    BlockRemoved,
    BlockRemovedMap,
    BlockStored,
    BlockStoredMap,
    KVEvent,
)

# msgpack type bytes: fixarray, array16, array32 / fixmap, map16, map32.
_ARRAY_FIRST_BYTES = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
_MAP_FIRST_BYTES = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None
    attn_dp_rank: int | None = None  # SGLang's name for the same field


class DecodedBatch(msgspec.Struct, gc=False):
    """One decoded EventBatch. A Struct, not a dataclass: one is built per message, and a Struct's
    constructor is C; untracked by the cyclic GC (`gc=False`: it never takes part in a reference
    cycle)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None
    # Events that could not be decoded (wrong types) or whose type is unknown; they are skipped.
    skipped_events: int = 0
    skip_reasons: list[str] = []  # (msgspec gives each instance its own empty list)


_array_batch_decoder = msgspec.msgpack.Decoder(_ArrayBatch)
_map_batch_decoder = msgspec.msgpack.Decoder(_MapBatch)
_ArrayEvent = BlockStored | BlockRemoved | AllBlocksCleared
_MapEvent = BlockStoredMap | BlockRemovedMap | AllBlocksClearedMap
_array_event_decoder = msgspec.msgpack.Decoder(_ArrayEvent)
_map_event_decoder = msgspec.msgpack.Decoder(_MapEvent)


class _ArrayBatchOfArrayEvents(msgspec.Struct, array_like=True):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _ArrayBatchOfMapEvents(msgspec.Struct, array_like=True):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _MapBatchOfArrayEvents(msgspec.Struct):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None
    attn_dp_rank: int | None = None


class _MapBatchOfMapEvents(msgspec.Struct):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None
    attn_dp_rank: int | None = None


# Whole-batch typed decoders, by batch encoding: (array events, map events). Decoding a whole
# batch in one msgspec call skips a Raw slice and a decoder call per event. Any batch they refuse
# (an unknown or ill-typed event, events of both encodings) goes the event-by-event way, which
# skips and counts the bad events.
_typed_batch_decoders = {
    "array": (
        msgspec.msgpack.Decoder(_ArrayBatchOfArrayEvents),
        msgspec.msgpack.Decoder(_ArrayBatchOfMapEvents),
    ),
    "map": (msgspec.msgpack.Decoder(_MapBatchOfArrayEvents), msgspec.msgpack.Decoder(_MapBatchOfMapEvents)),
}
# Which event encoding the last batch used (0: array, 1: map): engines keep one, so try it first.
_last_event_encoding = [0]


def _decode_typed_batch(payload: bytes, batch_encoding: str) -> DecodedBatch | None:
    """The batch decoded in one call when every event is well formed, else None."""
    decoders = _typed_batch_decoders[batch_encoding]
    first = _last_event_encoding[0]
    for encoding in (first, 1 - first):
        try:
            typed = decoders[encoding].decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue
        _last_event_encoding[0] = encoding
        rank = typed.data_parallel_rank
        if rank is None and batch_encoding == "map":
            rank = typed.attn_dp_rank
        return DecodedBatch(ts=typed.ts, events=typed.events, data_parallel_rank=rank)
    return None


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one msgpack EventBatch; bad events inside a good batch are skipped and counted."""
    if not payload:
        raise MalformedBatch("empty payload")
    first = payload[0]
    if first in _ARRAY_FIRST_BYTES or first in _MAP_FIRST_BYTES:
        typed = _decode_typed_batch(payload, "array" if first in _ARRAY_FIRST_BYTES else "map")
        if typed is not None:
            return typed
    return decode_batch_event_by_event(payload)


def decode_batch_event_by_event(payload: bytes) -> DecodedBatch:
    """`decode_batch` without the whole-batch attempt: each event decoded (or skipped) on its own."""
    if not payload:
        raise MalformedBatch("empty payload")
    first = payload[0]
    try:
        if first in _ARRAY_FIRST_BYTES:
            raw_batch: _ArrayBatch | _MapBatch = _array_batch_decoder.decode(payload)
            rank = raw_batch.data_parallel_rank
        elif first in _MAP_FIRST_BYTES:
            raw_batch = _map_batch_decoder.decode(payload)
            rank = raw_batch.data_parallel_rank
            if rank is None:
                rank = raw_batch.attn_dp_rank
        else:
            raise MalformedBatch(f"payload starts with msgpack byte 0x{first:02x}, not an array or map")
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedBatch(f"not an EventBatch: {exc}") from None
    batch = DecodedBatch(ts=raw_batch.ts, events=[], data_parallel_rank=rank)
    for raw_event in raw_batch.events:
        try:
            batch.events.append(decode_event(raw_event))
        except (msgspec.ValidationError, msgspec.DecodeError, MalformedBatch) as exc:
            batch.skipped_events += 1
            if len(batch.skip_reasons) < 4:
                batch.skip_reasons.append(str(exc))
    return batch


def decode_event(encoded: bytes | msgspec.Raw) -> KVEvent:
    """Decode one msgpack event, array-encoded (tag first) or map-encoded (a "type" key)."""
    view = memoryview(encoded)
    if not view:
        raise MalformedBatch("empty event")
    first = view[0]
    if first in _ARRAY_FIRST_BYTES:
        return _array_event_decoder.decode(encoded)
    if first in _MAP_FIRST_BYTES:
        return _map_event_decoder.decode(encoded)
    raise MalformedBatch(f"event starts with msgpack byte 0x{first:02x}, not an array or map")
