"""The seam through which optional parts plug into the gateway without the gateway importing them
(tests use it for stand-ins: kvgate_testing/sample_extension.py, loop_blocker.py).

An extension factory is a `"module:function"` string; router/wiring.py calls each as
`function(context)` with an `ExtensionContext`, after the KV index and the tokenizer are built and
before the policy is (so an extension may hand the policy another index), and keeps the Extension
it returns (None: the configuration does not need it). The gateway's own parts are built by
router/wiring.py itself: `EXTENSION_FACTORIES` is empty unless a test adds to it.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from starlette.routing import BaseRoute

    from router.backends import BackendRegistry, BackendState
    from router.config import Config
    from router.metrics import GatewayMetrics
    from router.route_request import RouteRequest
    from router.upstream import UpstreamPool

# "module:function" factories, called in this order after the gateway's own parts are built.
EXTENSION_FACTORIES: list[str] = []


@dataclass(eq=False)
class ExtensionContext:
    """What an extension factory is given: the gateway's parts it may use, and its two seams."""

    config: Config
    backends: BackendRegistry
    pool: UpstreamPool
    metrics: GatewayMetrics
    # The index the policy will be handed: the gateway's KVIndexService, unless an extension sets
    # its own here (read once every factory has run).
    kv_index: Any = None
    # Awaited with each RouteRequest the policy routes, before it chooses, in this order (the
    # tokenizer's comes first when the policy needs tokens); an extension may append its own.
    request_preparers: list[Callable[[RouteRequest], Awaitable[None]]] = field(default_factory=list)


class Extension(Protocol):
    def routes(self) -> list[BaseRoute]:
        """Extra HTTP routes mounted on the gateway's app."""
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


def load_extensions(factories: list[str], context: ExtensionContext) -> list[Extension]:
    """Call every factory with `context`; keep the extensions they return."""
    extensions: list[Extension] = []
    for spec in factories:
        module_name, _, function_name = spec.partition(":")
        factory = getattr(importlib.import_module(module_name), function_name)
        extension = factory(context)
        if extension is not None:
            extensions.append(extension)
    return extensions
