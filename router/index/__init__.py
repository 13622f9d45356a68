"""KV-event index: router keys (keys), the prefix index, its rules and lookups (store), the one
writer that applies events to it (ingest, with the Python rules of python_writer), per-engine
subscribers (stream, transport) and the service that builds the index and its writer and ties
them together for the gateway (service). The wire protocol is `kvwire`'s."""

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
