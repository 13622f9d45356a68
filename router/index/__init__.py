"""KV-event index: wire decoding (events), router keys (keys), the prefix index and its lookups
(store), the writers that apply events to it (ingest), per-engine subscribers (subscriber) and the
service that ties them together for the gateway (service)."""

from router.index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, decode_batch
from router.index.keys import DEFAULT_NAMESPACE, ROUTER_BLOCK_TOKENS, Namespace, prompt_prefix_keys
from router.index.store import BackendMatch, PrefixIndex

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
