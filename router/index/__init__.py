"""KV-event index: router keys (keys), the prefix index and its lookups (store), the writers that
apply events to it (ingest), per-engine subscribers (subscriber) and the service that ties them
together for the gateway (service). The wire protocol is `kvwire`'s."""

from router.index.keys import DEFAULT_NAMESPACE, ROUTER_BLOCK_TOKENS, Namespace, prompt_prefix_keys
from router.index.store import BackendMatch, PrefixIndex

# Loads the compiled ingest module, which also computes prompt_prefix_keys when it is built.
from router.index import ingest as _ingest  # noqa: F401  isort: skip

__all__ = [
    "DEFAULT_NAMESPACE",
    "ROUTER_BLOCK_TOKENS",
    "BackendMatch",
    "Namespace",
    "PrefixIndex",
    "prompt_prefix_keys",
]
