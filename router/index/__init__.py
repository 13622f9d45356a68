"""KV-event index: wire decoding (events), per-engine subscribers (subscriber), the prefix index
(store) and the service that ties them together for the gateway (service)."""

from router.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, decode_batch
from router.index.store import (
    DEFAULT_NAMESPACE,
    ROUTER_BLOCK_TOKENS,
    BackendMatch,
    Namespace,
    PrefixIndex,
    prompt_prefix_keys,
)

__all__ = [
    "DEFAULT_NAMESPACE",
    "ROUTER_BLOCK_TOKENS",
    "AllBlocksCleared",
    "BackendMatch",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "Namespace",
    "PrefixIndex",
    "decode_batch",
    "prompt_prefix_keys",
]
