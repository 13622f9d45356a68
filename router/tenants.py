"""Tenants apart: the convention that turns a client API key's tenant (auth.tenants) into the
request's cache_salt, and the checks on the configuration that names tenants.

The salt convention, shared with the cache layer (docs/cachelayer.md, "Tenant quotas"): a tenant's
request carries `cache_salt` = `<tenant>`, or `<tenant>:<client salt>` when the client sent a salt
of its own; the cache layer reads the tenant as the salt's part before the first ':'. A client salt
is namespaced, not refused: a client may still partition its own cache (per user, vLLM's purpose for
cache_salt), but whatever it sends stays under its own tenant. docs/gateway.md, "Tenants".
"""

from __future__ import annotations

import os
import re
from typing import Any, Protocol

from router.errors import KvgateError

# The paths whose bodies vLLM reads `cache_salt` from: a tenant's requests on them are salted. The
# generation paths (completions, chat, and the Responses and Anthropic Messages APIs it renders as
# chat), and the pooling paths: every vLLM pooling request (embeddings, rerank, score) takes
# `cache_salt` (vllm/entrypoints/pooling/base/protocol.py, PoolingBasicRequestMixin, vLLM 0.32) and
# salts its prompt's blocks, which prefix caching shares like a generation's.
SALTED_PATHS = frozenset(
    (
        "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
        "/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score",
    )
)  # fmt: skip

# A tenant's name becomes its requests' cache_salt and a metric label: plain, short, and free of ':'
# (the cache layer reads the tenant as the salt's part before the first ':').
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def salt_for_tenant(tenant: str, client_salt: Any) -> str:
    """The cache_salt a tenant's request carries: the tenant's name, or `<tenant>:<client salt>`
    when the client sent one (never another tenant's: the part before the first ':' is its own)."""
    if isinstance(client_salt, str) and client_salt:
        return f"{tenant}:{client_salt}"
    return tenant


def keys_from(api_keys: list[str], api_keys_env: list[str], where: str) -> list[str]:
    """The keys written in the file plus those in the named environment variables; raises ValueError
    naming a variable that is unset or empty (`where`: the key path, for the message)."""
    keys = [key for key in api_keys if key]
    for name in api_keys_env:
        value = os.environ.get(name, "")
        found = [key.strip() for key in value.split(",") if key.strip()]
        if not found:
            raise ValueError(
                f"environment variable {name} is unset or empty; export it with the API key(s) "
                f"(comma-separated) or remove it from {where}"
            )
        keys += found
    return keys


class TenantConfigError(KvgateError, ValueError):
    """A bad `auth` section; `key` is the key path the message is about."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class _TenantSpec(Protocol):
    name: str
    api_keys: list[str]
    api_keys_env: list[str]


class _AuthSpec(Protocol):
    tenants: list[Any]

    def keys_with_tenants(self) -> list[tuple[str, str | None]]: ...


def check_tenants(auth: _AuthSpec) -> None:
    """Raise TenantConfigError for a bad tenant name, a tenant listed twice or without keys, an
    unset key variable, or one key under two tenants."""
    seen: set[str] = set()
    for i, tenant in enumerate(auth.tenants):
        where = f"auth.tenants[{i}].name"
        if not _TENANT_NAME.fullmatch(tenant.name):
            raise TenantConfigError(
                where,
                f"{tenant.name!r} is not a tenant name; use 1-64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit (no ':', which separates a tenant from a client's "
                "own cache_salt)",
            )
        if tenant.name in seen:
            raise TenantConfigError(
                where, f"the tenant {tenant.name!r} is listed twice; list each tenant once, with all its keys"
            )
        seen.add(tenant.name)
        if not tenant.api_keys and not tenant.api_keys_env:
            raise TenantConfigError(
                f"auth.tenants[{i}]",
                f"the tenant {tenant.name!r} has no keys; give it api_keys_env (or api_keys), or remove it",
            )
    try:
        auth.keys_with_tenants()
    except ValueError as exc:
        raise TenantConfigError("auth", str(exc)) from None
