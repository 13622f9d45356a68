"""kvwire: the KV-event wire protocol engines speak (vLLM's), defined once.

An engine announces the KV-cache blocks it stores and removes as msgpack batches of events on a
ZMQ PUB socket, and serves missed batches again over a replay ROUTER socket. This package holds
every part of that protocol and nothing else (it needs msgspec and pyzmq, never torch):
- `events`: the event types (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), field-compatible
  with vLLM's `kv_events.py`, and what their fields mean (`tier_of`, `cache_salt_of`);
- `encode`: batches as publishers write them, in the vLLM, old-vLLM array and SGLang encodings;
- `decode`: the one decoder for every dialect (`decode_batch`);
- `frames`: the compiled byte reader of event frames (`scan_batch`: a payload mapped in place,
  for consumers that read events without decoding them; None where it is not built);
- `replay`: seq frames, the replay end marker, the snapshot request and its client;
- `publisher`: the one publisher (PUB, replay buffer, snapshots), used by the simulator, the
  cache layer and the tests;
- `errors`: `WireError` and the errors under it.
"""

from kvwire.decode import DecodedBatch, decode_batch, decode_batch_event_by_event, decode_event
from kvwire.encode import ENCODINGS, Encoding, encode_batch
from kvwire.errors import (
    MalformedBatch,
    MalformedFrame,
    PublisherBindError,
    PublisherConfigError,
    SnapshotUnavailable,
    WireError,
)
from kvwire.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KVEvent,
    cache_salt_of,
    event_class_kind,
    event_kind,
    tier_of,
)
from kvwire.publisher import EventPublisher, KVEventsConfig, SnapshotSource, parse_kv_events_config
from kvwire.replay import END_SEQ, SNAPSHOT_REQUEST, decode_seq, encode_seq, fetch_snapshot

__all__ = [
    "ENCODINGS",
    "END_SEQ",
    "MEDIUM_GPU",
    "SNAPSHOT_REQUEST",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "Encoding",
    "EngineBlockHash",
    "EventPublisher",
    "KVEvent",
    "KVEventsConfig",
    "MalformedBatch",
    "MalformedFrame",
    "PublisherBindError",
    "PublisherConfigError",
    "SnapshotSource",
    "SnapshotUnavailable",
    "WireError",
    "cache_salt_of",
    "decode_batch",
    "decode_batch_event_by_event",
    "decode_event",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "event_class_kind",
    "event_kind",
    "fetch_snapshot",
    "parse_kv_events_config",
    "tier_of",
]
