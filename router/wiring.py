"""The gateway's parts, built in the order they depend on each other, and their lifecycle.

`Gateway(config)` builds, in this order, handing each part what it uses and nothing more:
1. the metrics, the one upstream client pool, the backend registry (with the configured backends);
2. the KV index (router/index/service.py): one event stream per backend with `kv_events`;
3. the tokenizer (router/tokenize/): the request preparer of the policies that route by tokens;
4. the extensions (router/extensions.py), which may hand the policy another index or add a preparer;
5. the policy (router/policies/), given the index, the metrics registry and the shared tiers;
6. the replica sync (`cluster:`), the health checker, the routing warnings, the backends found by
   label (`discovery:`, router/discovered_backends.py);
7. what the HTTP app serves: the forwarding context (with the prefill/decode disaggregation, when
   configured), /debug/prefix-map and /lookup.
router/app.py serves them over HTTP; `start()`/`stop()` run in the app's lifespan.
"""

from __future__ import annotations

import asyncio
import logging

from router import config as config_schema
from router.access_log import AccessLogWriter
from router.auth import ClientKeys
from router.backends import BackendRegistry, BackendState
from router.contract import ContractChecker
from router.debug_page import DebugPage
from router.disaggregation import Disaggregation
from router.extensions import EXTENSION_FACTORIES, Extension, ExtensionContext, load_extensions
from router.forward import ForwardContext
from router.health import HealthChecker
from router.index.service import KVIndexService
from router.lookup import LookupEndpoint
from router.metrics import GatewayMetrics
from router.policies import PolicyContext, make_policy
from router.routing_warnings import RoutingWarnings
from router.tokenize import RequestTokenizer
from router.upstream import UpstreamPool

log = logging.getLogger("kvgate")

# The policies that route by the prompt's tokens: the tokenizer prepares their requests.
_TOKEN_POLICIES = (config_schema.KVAwarePolicy, config_schema.ApproximatePolicy)


class Gateway:
    """Everything one gateway process runs, built from its configuration (see the module docstring)."""

    def __init__(self, config: config_schema.Config, extension_factories: list[str] | None = None) -> None:
        self.config = config
        # 1. What every part reports to, talks through, and routes to.
        self.metrics = GatewayMetrics()
        self.pool = UpstreamPool(config.limits.connect_timeout_s, config.limits.max_connections)
        self.backends = BackendRegistry(self.metrics)
        for spec in config.backends:
            self.backends.add(spec)  # its listeners hear of these at start()
        self.admin_token = config.admin.resolved_token()
        # Client API keys (router/auth.py); the admin token opens what a client key opens.
        client_keys = config.auth.keys_with_tenants()
        if client_keys and self.admin_token:
            client_keys.append((self.admin_token, None))
        self.client_keys = ClientKeys(client_keys) if client_keys else None

        # 2. The KV index: what each engine's events say it holds.
        self.index_service = KVIndexService(registry=self.metrics.registry)
        self.index_service.share_removals(config.shared_tiers)
        self.metrics.missed_reuse.enabled = config.missed_reuse.enabled
        # A backend routed by load only for a contract mismatch: its missed reuse has that reason.
        self.metrics.missed_reuse.uncredited = self.index_service.uncredited
        self.backends.listen(_IndexSubscriptions(self.index_service))

        # 3. The tokenizer, for the policies that route by the prompt's tokens.
        self.tokenizer = RequestTokenizer(config, self.backends, self.pool)
        self.routes_by_tokens = isinstance(config.policy, _TOKEN_POLICIES)
        request_preparers = [self.tokenizer.prepare] if self.routes_by_tokens else []

        # 4. Extensions: optional parts (and tests' stand-ins), given the parts built so far.
        context = ExtensionContext(
            config, self.backends, self.pool, self.metrics, self.index_service, request_preparers
        )
        self.extensions: list[Extension] = load_extensions(
            EXTENSION_FACTORIES if extension_factories is None else extension_factories, context
        )
        # The index the policy reads: the service above, unless an extension brought its own.
        self.kv_index = context.kv_index

        # 5. The policy.
        self.policy = make_policy(
            config.policy,
            PolicyContext(
                kv_index=self.kv_index,
                metrics_registry=self.metrics.registry,
                shared_tiers=config.shared_tiers,
            ),
        )

        # 6. Replica sync (`cluster:`), health checks, routing warnings.
        self.cluster = None
        if config.cluster is not None:
            # Imported only when configured: it brings the redis client (the `cluster` extra).
            from router.cluster import ClusterSync

            self.cluster = ClusterSync(config.cluster, self.backends, self.policy, self.metrics.registry)
            self.backends.listen(self.cluster)
        self.health = HealthChecker(self.backends, self.pool, config.health, self.metrics)
        self.routing_warnings = RoutingWarnings(
            config.models,
            self.index_service,
            self.policy,
            self.metrics.registry,
            enabled=self.routes_by_tokens,
        )
        self.backends.listen(self.routing_warnings)
        # The contract check (router/contract.py; `contract_check:`), its findings among the warnings.
        self.contract = ContractChecker(config, self.backends, self.index_service, self.tokenizer, self.pool)
        self.backends.listen(self.contract)
        self.routing_warnings.sources.append(self.contract.warnings)
        for extension in self.extensions:
            self.backends.listen(extension)
        # Backends found by label (`discovery:`), into the same registry; its credentials now, so
        # that a gateway that cannot reach the API refuses to start with the reason.
        self.discovered = None
        if config.discovery is not None:
            from router.discovered_backends import DiscoveredBackends

            self.discovered = DiscoveredBackends(config.discovery, self.backends)

        # 7. What the HTTP app serves (and, when on, the access log of what it forwards).
        self.access_log = (
            AccessLogWriter(config.access_log, self.metrics.registry) if config.access_log.enabled else None
        )
        # Prefill/decode disaggregation, when configured (router/disaggregation.py).
        self.disaggregation = None
        if config.disaggregation is not None:
            self.disaggregation = Disaggregation(
                config.disaggregation, self.backends, self.pool, self.metrics.registry
            )
        self.forwarding = ForwardContext(
            config,
            self.backends,
            self.policy,
            self.pool,
            self.metrics,
            cluster=self.cluster,
            request_preparers=context.request_preparers,
            client_keys=self.client_keys,
            access_log=self.access_log,
            disaggregation=self.disaggregation,
        )
        self.debug_page = DebugPage(
            config,
            self.backends,
            self.index_service,
            self.policy,
            self.tokenizer,
            self.routing_warnings,
            self.admin_token,
            self.disaggregation,
            self.metrics.missed_reuse,
        )
        self.lookup = LookupEndpoint(self.index_service, self.backends, self.admin_token)

    async def start(self) -> None:
        if self.access_log is not None:
            self.access_log.start()
        self.health.start()
        self.index_service.start()
        if self.routes_by_tokens:
            await self._load_tokenizers()
            self.tokenizer.start_sandboxes()  # for models that accept client templates, if any
            self.routing_warnings.start()
            self.contract.start()
        for extension in self.extensions:
            await extension.start()
        # The configured backends: the index subscribes to their events, the extensions hear of them.
        self.backends.announce()
        if self.discovered is not None:
            self.discovered.start()  # after announce(): its backends reach the listeners as they join
        if self.cluster is not None:
            await self.cluster.start()

    async def stop(self) -> None:
        if self.discovered is not None:
            await self.discovered.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        for extension in reversed(self.extensions):
            try:
                await extension.stop()
            except Exception:
                log.exception("extension %r failed to stop", extension)
        await self.contract.stop()
        await self.routing_warnings.stop()
        self.index_service.stop()
        await self.tokenizer.close()
        await self.health.stop()
        self.pool.close()
        if self.access_log is not None:
            await asyncio.to_thread(self.access_log.stop)  # writes the lines still queued

    async def _load_tokenizers(self) -> None:
        """Load every model's tokenizer now, not on its first request (about 2 s for Qwen3); one that
        fails to load is a routing warning (its requests are routed by load)."""
        for model in self.config.models:
            try:
                await asyncio.to_thread(self.tokenizer.tokenizer, model.name)
            except Exception as exc:
                self.routing_warnings.tokenizer_errors[model.name] = str(exc)


class _IndexSubscriptions:
    """Subscribes the KV index to a backend's events when it joins, and drops them when it leaves."""

    def __init__(self, index: KVIndexService) -> None:
        self.index = index

    def backend_added(self, backend: BackendState) -> None:
        self.index.add_backend(backend.name, backend.kv_events)

    def backend_removed(self, backend: BackendState) -> None:
        self.index.remove_backend(backend.name)
