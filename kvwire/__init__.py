"""kvwire: the KV-event wire protocol engines speak (vLLM's), defined once."""

from kvwire.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    EngineBlockHash,
    KVEvent,
    MalformedBatch,
    cache_salt_of,
    decode_batch,
    decode_batch_event_by_event,
    decode_event,
    decode_seq,
    encode_seq,
    event_class_kind,
    event_kind,
    tier_of,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "EngineBlockHash",
    "KVEvent",
    "MalformedBatch",
    "cache_salt_of",
    "decode_batch",
    "decode_batch_event_by_event",
    "decode_event",
    "decode_seq",
    "encode_seq",
    "event_class_kind",
    "event_kind",
    "tier_of",
]
