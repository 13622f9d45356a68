"""The seams through which optional parts (the KV index, the tokenizer, debug pages) plug into the
gateway without the gateway importing them.

An extension factory is a `"module:function"` string in EXTENSION_FACTORIES; the function is called
as `function(gateway)` while the gateway is built (before the policy, so an extension can set
`gateway.kv_index` for the policy to find) and returns an Extension or None when the configuration
does not need it. Besides the Extension methods, a factory may append an async preparer to
`gateway.request_preparers`: each is awaited with the RouteRequest before the policy chooses (for
example to fill `RouteRequest.tokens` and `.namespace` when `gateway.policy.needs_tokens`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from starlette.routing import BaseRoute

    from router.app import Gateway
    from router.backends import BackendState

# "module:function" factories, called in this order. The KV index and tokenizer add theirs here.
EXTENSION_FACTORIES: list[str] = [
    # KV-event index (gateway.kv_index), tokenizer preparer, /debug/prefix-map and /lookup.
    "router.debug_page:create_extension",
]


class Extension(Protocol):
    def routes(self) -> list[BaseRoute]:
        """Extra HTTP routes (for example /debug/prefix-map, /lookup) mounted on the gateway's app."""
        ...

    async def start(self) -> None:
        """Called in the app's startup, after the gateway's own parts are running."""
        ...

    async def stop(self) -> None:
        """Called in the app's shutdown, before the gateway's own parts stop."""
        ...

    def backend_added(self, backend: BackendState) -> None:
        """A backend joined (from the configuration at start, or POST /backends)."""
        ...

    def backend_removed(self, backend: BackendState) -> None:
        """A backend left (DELETE /backends/{name}, after draining)."""
        ...


def load_extensions(gateway: Gateway, factories: list[str] | None = None) -> list[Extension]:
    """Call every factory with the gateway; keep the extensions they return."""
    extensions: list[Extension] = []
    for spec in EXTENSION_FACTORIES if factories is None else factories:
        module_name, _, function_name = spec.partition(":")
        factory = getattr(importlib.import_module(module_name), function_name)
        extension = factory(gateway)
        if extension is not None:
            extensions.append(extension)
    return extensions
