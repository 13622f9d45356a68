"""The KV events an engine publishes, declared once, field for field as vLLM's `kv_events.py` has them.

A block is announced stored (`BlockStored`) or removed (`BlockRemoved`), or the whole cache (or
one medium of it) is cleared (`AllBlocksCleared`). Every field but the block hashes has a default,
so that the field sets of older vLLM versions, SGLang and cache layers under the engine
(LMCache, `cachelayer`) decode into the same types. An event travels as an array whose first
element is the tag (these classes, as vLLM first declared them; SGLang and `cachelayer` write
them so) or as a map with a "type" key (vLLM >= 0.24): the `...Map` subclasses, which the decoder
builds for those.
"""

from __future__ import annotations

from typing import Any

import msgspec

# An engine's block id: opaque, only ever compared for equality.
EngineBlockHash = int | bytes

# The medium vLLM names its GPU blocks with.
MEDIUM_GPU = "GPU"


class BlockStored(msgspec.Struct, array_like=True, tag="BlockStored", tag_field="type"):
    """Blocks the engine now holds. Field order is the array order vLLM and SGLang use."""

    block_hashes: list[EngineBlockHash]
    parent_block_hash: EngineBlockHash | None = None
    token_ids: list[int] = []
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block (or None): LoRA name, multimodal ids, cache_salt on the first block.
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", tag_field="type"):
    """Blocks the engine no longer holds in `medium`."""

    block_hashes: list[EngineBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", tag_field="type"):
    """Everything the engine held is gone: in every medium, or only in `medium` when one is named.

    `medium` is kvgate's extension (vLLM's event has no field): the cache layer names the tier a
    restarted store lost (its shared daemon's), so the engine's other tiers keep their blocks. It
    is a trailing field with a default, so vLLM's own decoder reads the event as a whole clear and a
    clear without it means what it means in vLLM.
    """

    medium: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


# The map forms subclass the array forms and add no field: the same slots, so the index's compiled
# ingest reads either. Test an event's kind with isinstance (or `event_kind`), not its exact type.
class BlockStoredMap(BlockStored, array_like=False):
    """A `BlockStored` map-encoded (a "type" key, fields by name)."""


class BlockRemovedMap(BlockRemoved, array_like=False):
    """A `BlockRemoved` map-encoded."""


class AllBlocksClearedMap(AllBlocksCleared, array_like=False):
    """An `AllBlocksCleared` map-encoded."""


MAP_FORMS: dict[type, type] = {
    BlockStored: BlockStoredMap,
    BlockRemoved: BlockRemovedMap,
    AllBlocksCleared: AllBlocksClearedMap,
}


def event_kind(event: KVEvent) -> str:
    """ "BlockStored", "BlockRemoved" or "AllBlocksCleared", whichever encoding it arrived in."""
    return event_class_kind(type(event))


def event_class_kind(cls: type) -> str:
    """`event_kind` of every event of class `cls` (to count events by class, then by kind)."""
    if issubclass(cls, BlockStored):
        return "BlockStored"
    if issubclass(cls, BlockRemoved):
        return "BlockRemoved"
    return "AllBlocksCleared"


_TIER_ALIASES = {
    "gpu": "gpu",
    "cuda": "gpu",
    "cpu": "cpu",
    "localcpubackend": "cpu",
    "disk": "disk",
    "localdiskbackend": "disk",
}


def tier_of(medium: str | None) -> str:
    """The storage tier an event's `medium` names: "gpu" when absent, lower case otherwise."""
    if not medium:
        return "gpu"
    tier = _TIER_ALIASES.get(medium)
    if tier is None:
        tier = _TIER_ALIASES.get(medium.lower(), medium.lower())
        if len(_TIER_ALIASES) < 256:  # remember spellings seen (e.g. "GPU"), bounded
            _TIER_ALIASES[medium] = tier
    return tier


def cache_salt_of(event: BlockStored) -> str | None:
    """The cache_salt vLLM mixes into the first block (last string of its extra keys, LoRA name excluded).

    vLLM builds a block's extra keys as LoRA name + multimodal keys (tuples) + cache_salt (first
    block only). Strings other than the LoRA name are therefore the salt.
    """
    if not event.extra_keys:
        return None
    first = event.extra_keys[0]
    if not isinstance(first, (list, tuple)):
        return None
    strings = [item for item in first if isinstance(item, str)]
    if event.lora_name is not None and strings and strings[0] == event.lora_name:
        strings = strings[1:]
    if not strings:
        return None
    return strings[-1]
