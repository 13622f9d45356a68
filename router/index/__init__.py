"""KV-event index: per-engine subscribers (subscriber), the prefix index (prefix_index) and the
service that ties them together for the gateway (service). The wire protocol is `kvwire`'s."""

from router.index.prefix_index import (
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
    "BackendMatch",
    "Namespace",
    "PrefixIndex",
    "prompt_prefix_keys",
]
