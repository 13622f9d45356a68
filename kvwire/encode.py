"""Event batches as publishers write them, in the three encodings engines use.

A batch is the msgpack array `[ts, [event, ...], data_parallel_rank]` (the rank left out when
None). Its events are written in one of these encodings:
- "vllm": maps with a "type" key and every field of `kvwire.events` (vLLM >= 0.24);
- "vllm-array": arrays, the tag first, then vLLM's fields up to `extra_keys` (older vLLM; the
  cache layer publishes these);
- "sglang": arrays with SGLang's field set and block hashes as signed 64-bit ints.
Array events leave out trailing fields that are None, as a decoder takes a missing field as None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from kvwire.events import MAP_FORMS, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

Encoding = Literal["vllm", "vllm-array", "sglang"]
ENCODINGS: tuple[Encoding, ...] = ("vllm", "vllm-array", "sglang")

# How many leading fields each array encoding writes, per event type.
_ARRAY_FIELD_COUNTS: dict[str, dict[type, int]] = {
    # up to extra_keys; a clear's medium (kvgate's extension) only when one is named
    "vllm-array": {BlockStored: 8, BlockRemoved: 2, AllBlocksCleared: 1},
    "sglang": {BlockStored: 6, BlockRemoved: 2, AllBlocksCleared: 0},  # up to medium
}
_TAGS = {BlockStored: "BlockStored", BlockRemoved: "BlockRemoved", AllBlocksCleared: "AllBlocksCleared"}
_encoder = msgspec.msgpack.Encoder()


def encode_batch(
    events: Sequence[KVEvent],
    *,
    ts: float,
    data_parallel_rank: int | None = None,
    encoding: Encoding = "vllm",
) -> bytes:
    """The msgpack payload of one batch of `events` in `encoding`."""
    if encoding == "vllm":
        written: Sequence[Any] = [_as_map(event) for event in events]
    else:
        written = [_as_array(event, encoding) for event in events]
    if data_parallel_rank is None:
        return _encoder.encode([ts, written])
    return _encoder.encode([ts, written, data_parallel_rank])


def _event_type(event: KVEvent) -> type:
    for event_type in _TAGS:
        if isinstance(event, event_type):
            return event_type
    raise TypeError(f"not a KV event: {type(event).__name__}")


def _as_map(event: KVEvent) -> KVEvent:
    map_form = MAP_FORMS.get(type(event))
    if map_form is None:  # a map form already, or not an event
        _event_type(event)
        return event
    return map_form(*msgspec.structs.astuple(event))


def _as_array(event: KVEvent, encoding: Encoding) -> list[Any]:
    event_type = _event_type(event)
    fields = list(msgspec.structs.astuple(event)[: _ARRAY_FIELD_COUNTS[encoding][event_type]])
    while fields and fields[-1] is None:
        fields.pop()
    if encoding == "sglang" and fields:
        fields[0] = [_signed64(value) for value in fields[0]]
        if event_type is BlockStored and len(fields) > 1 and fields[1] is not None:
            fields[1] = _signed64(fields[1])
    return [_TAGS[event_type], *fields]


def _signed64(value: int | bytes) -> int | bytes:
    """SGLang writes a block hash as a signed 64-bit int."""
    if isinstance(value, int) and value >= 1 << 63:
        return value - (1 << 64)
    return value
