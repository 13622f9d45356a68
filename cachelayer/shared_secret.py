"""Shared secrets from the environment, and the rule that no socket is opened beyond loopback without
one unless the operator opted in: what the controller, the daemon and the remote tier all apply.

It lives below all three (not in cachelayer.controller) so that the storage tiers can use it without
knowing about the controller that serves the engine."""

from __future__ import annotations

import ipaddress
import os
from urllib.parse import urlsplit

from cachelayer.errors import CacheLayerError

MIN_SECRET_LENGTH = 16


class AuthConfigError(CacheLayerError, ValueError):
    """A secret that cannot be used, or an open socket beyond loopback that was not opted into."""


def secret_from_env(variable: str | None, where: str) -> bytes | None:
    """The secret held by environment variable `variable`; None when no variable is named."""
    if not variable:
        return None
    value = os.environ.get(variable)
    if not value:
        raise AuthConfigError(
            f"{where} names the environment variable {variable!r} for the shared secret, but it is "
            "not set: set it (the same value on the controller and every engine) or remove the setting"
        )
    if len(value) < MIN_SECRET_LENGTH:
        raise AuthConfigError(
            f"the secret in {variable} has {len(value)} characters; use at least {MIN_SECRET_LENGTH} "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return value.encode()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname other than localhost, or a wildcard such as 0.0.0.0 / *


def refuse_open_socket_beyond_loopback(
    host: str, secret: bytes | None, allow_unauthenticated: bool, what: str, fix: str
) -> None:
    """Raise unless `host` is loopback, a secret is set, or the operator opted into an open socket."""
    if secret is None and not allow_unauthenticated and not is_loopback(host):
        raise AuthConfigError(
            f"{what} would listen on {host!r} without authentication: anyone who reaches it could "
            f"read which prompts are cached and write into the cache. {fix}"
        )


def remote_tier_secret(
    url: str, secret_env: str | None, authenticate_values: bool, allow_unauthenticated: bool
) -> bytes | None:
    """The secret values are tagged with (None: checksum only), after refusing an unauthenticated
    tier beyond loopback: whoever can write to that Redis could feed any KV to every engine."""
    secret = secret_from_env(secret_env, "remote_auth_secret_env")
    if secret is not None and authenticate_values:
        return secret
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "unix" and not is_loopback(host) and not allow_unauthenticated:
        raise AuthConfigError(
            f"remote_url names the Redis at {host!r}, beyond loopback, and remote values are not "
            "authenticated: anyone who can write to it could make every engine load KV of their "
            "choosing. Set remote_auth_secret_env to a variable holding a secret the engines share "
            "(with remote_authenticate_values: true), or set remote_allow_unauthenticated: true if "
            "only trusted hosts can reach that Redis."
        )
    return None
