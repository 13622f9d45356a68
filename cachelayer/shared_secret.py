"""Shared secrets from the environment, and the rule that no socket is opened beyond loopback without
one unless the operator opted in: what the controller, the daemon and the remote tier all apply.

It lives below all three (not in cachelayer.controller) so that the storage tiers can use it without
knowing about the controller that serves the engine."""

from __future__ import annotations

import ipaddress
import os

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
