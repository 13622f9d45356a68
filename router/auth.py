"""Client API keys: `Authorization: Bearer <key>` on every route but /health and /metrics.

Like `vllm serve --api-key`, with several keys allowed (one per client, so one can be revoked alone).
Keys come from environment variables (`auth.api_keys_env`) or, less safely, the file
(`auth.api_keys`). Every presented key is compared with every configured key through SHA-256
digests and `hmac.compare_digest`, so the time taken says nothing about how much of a key matched,
nor about its length or which key it was.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from router.errors import error_body

# Probes and scrapers stay open, as vLLM leaves them open under --api-key.
OPEN_PATHS = frozenset({"/health", "/metrics"})
UNAUTHORIZED_MESSAGE = (
    "missing or invalid API key: send `Authorization: Bearer <key>` with a key from the gateway's "
    "`auth` configuration"
)
UNAUTHORIZED_HEADERS = [(b"www-authenticate", b'Bearer realm="kvgate"')]


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ClientKeys:
    """The keys a client may present, each speaking for a tenant or for none (auth.tenants);
    `tenant_of` checks one Authorization header value."""

    def __init__(self, keys: Iterable[str | tuple[str, str | None]]) -> None:
        pairs = [(key, None) if isinstance(key, str) else key for key in keys]
        self._digests = [_digest(key.encode()) for key, _tenant in pairs]
        self._tenants = [tenant for _key, tenant in pairs]
        if not self._digests:
            raise ValueError("ClientKeys needs at least one key")

    def tenant_of(self, authorization: bytes | None) -> tuple[bool, str | None]:
        """(whether the key is allowed, the tenant it speaks for or None)."""
        if authorization is None:
            return False, None
        scheme, _, value = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False, None
        presented = _digest(value.strip())
        allowed = False
        tenant: str | None = None
        for digest, owner in zip(self._digests, self._tenants, strict=True):
            # No early exit: every key costs the same comparison, whichever matched.
            match = hmac.compare_digest(presented, digest)
            allowed |= match
            if match:
                tenant = owner
        return allowed, tenant

    def allows(self, authorization: bytes | None) -> bool:
        return self.tenant_of(authorization)[0]

    def tenant_of_headers(self, headers: Iterable[tuple[bytes, bytes]]) -> tuple[bool, str | None]:
        """`tenant_of` for `headers` with lower-case names, as ASGI and the direct path hold them."""
        for name, value in headers:
            if name == b"authorization":
                return self.tenant_of(value)
        return False, None

    def allows_headers(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        return self.tenant_of_headers(headers)[0]


def unauthorized_body() -> bytes:
    return error_body(401, UNAUTHORIZED_MESSAGE)
