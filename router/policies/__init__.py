"""Routing policies and the one factory that builds the configured one.

Each policy lives in its own module of this package and exposes
`create(policy_config, context: PolicyContext) -> Policy` (see router/policies/base.py for the
interface); the context holds what a policy may need besides its configuration, and each takes
only what it uses. The factory imports the module lazily, so a policy's dependencies load only
when it is chosen.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router import config as config_schema
from router.errors import KvgateError
from router.policies.base import Choice, PeerPlacement, Policy, RouteRequest

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from router.policies.kv_aware import KVIndex

# Config struct type -> module implementing it. Adding a policy: a struct in router/config.py,
# a module here with `create`, and one line in this table.
POLICY_MODULES: dict[type, str] = {
    config_schema.RoundRobinPolicy: "router.policies.round_robin",
    config_schema.LeastLoadedPolicy: "router.policies.least_loaded",
    config_schema.SessionPolicy: "router.policies.session",
    config_schema.KVAwarePolicy: "router.policies.kv_aware",
    config_schema.ApproximatePolicy: "router.policies.approximate",
}


class PolicyUnavailable(KvgateError):
    """The configured policy cannot be built (its module is missing or broken, or it refuses its
    configuration); `kvgate serve` reports it in one line and exits 2."""


class InvalidPolicyConfig(PolicyUnavailable, ValueError):
    """A `policy:` value the policy cannot work with; the message names the key and the fix."""


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What router/wiring.py hands the policy factory besides the policy's own configuration."""

    # The KV index kv_aware looks prompts up in (router/index/service.py KVIndexService); None: none.
    kv_index: KVIndex | None = None
    # Where the cache-aware policies register their kvgate_route_* metrics; None: not exported.
    metrics_registry: CollectorRegistry | None = None
    # The configuration's `shared_tiers` (stores several backends read), for kv_aware.
    shared_tiers: Sequence[config_schema.SharedTier] = ()


def make_policy(policy_config: config_schema.Policy, context: PolicyContext | None = None) -> Policy:
    """Build the policy that `policy_config` (one of the config structs) selects."""
    module_name = POLICY_MODULES.get(type(policy_config))
    if module_name is None:
        known = ", ".join(config_schema.POLICY_NAMES)
        raise PolicyUnavailable(
            f"no policy implements {type(policy_config).__name__}; known policies: {known}"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        name = type(policy_config).__struct_config__.tag
        raise PolicyUnavailable(
            f"policy {name!r} is not available in this installation (module {module_name} is missing); "
            "choose another `policy.name` in the configuration"
        ) from None
    return module.create(policy_config, context or PolicyContext())


__all__ = [
    "POLICY_MODULES",
    "Choice",
    "InvalidPolicyConfig",
    "PeerPlacement",
    "Policy",
    "PolicyContext",
    "PolicyUnavailable",
    "RouteRequest",
    "make_policy",
]
