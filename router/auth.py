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
    """The keys a client may present; `allows` checks one Authorization header value."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(key.encode()) for key in keys]
        if not self._digests:
            raise ValueError("ClientKeys needs at least one key")

    def allows(self, authorization: bytes | None) -> bool:
        if authorization is None:
            return False
        scheme, _, value = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        presented = _digest(value.strip())
        allowed = False
        for digest in self._digests:  # no early exit: every key costs the same comparison
            allowed |= hmac.compare_digest(presented, digest)
        return allowed

    def allows_headers(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """`headers` with lower-case names, as ASGI and the direct path hold them."""
        for name, value in headers:
            if name == b"authorization":
                return self.allows(value)
        return False


def unauthorized_body() -> bytes:
    return error_body(401, UNAUTHORIZED_MESSAGE)
