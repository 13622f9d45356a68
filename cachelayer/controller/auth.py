"""One shared secret authenticates the controller's three surfaces (docs/cachelayer.md, Security).

- HTTP API: `Authorization: Bearer <secret>`, compared in constant time.
- ZMQ messages (worker reports, controller commands, worker replies): a first frame
  `magic, timestamp, nonce, HMAC-SHA256` over the purpose, the timestamp, the nonce, the nonce of the
  command a reply answers, and every following frame. A message older or newer than
  `MAX_CLOCK_SKEW_S`, or whose nonce was already seen in that window, is refused (replay). A reply
  is bound to its command's nonce, so neither can be replayed nor passed off as the other.

An HMAC, not ZMQ CURVE: one secret from one environment variable serves HTTP and ZMQ alike, works
with any libzmq build, and needs no key pairs to distribute; what CURVE would add, encryption, the
HTTP side does not have either (see the docs for what crosses the network in the clear).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
import time
from collections import OrderedDict

from cachelayer.errors import CacheLayerError

# Where the secret comes from and when a socket needs one: shared with the daemon and the remote tier.
from cachelayer.shared_secret import (
    MIN_SECRET_LENGTH,
    AuthConfigError,
    is_loopback,
    refuse_open_socket_beyond_loopback,
    secret_from_env,
)

__all__ = [
    "COMMAND",
    "MAX_CLOCK_SKEW_S",
    "MIN_SECRET_LENGTH",
    "REPLY",
    "REPORT",
    "AuthConfigError",
    "AuthError",
    "MessageAuth",
    "bearer_token_matches",
    "is_loopback",
    "refuse_open_socket_beyond_loopback",
    "secret_from_env",
]

MAX_CLOCK_SKEW_S = 30.0
_MAGIC = b"KVA1"
_AUTH_FRAME = struct.Struct("<4sd16s32s")  # magic, unix time, nonce, mac
_REMEMBERED_NONCES = 200_000

REPORT = b"report"
COMMAND = b"command"
REPLY = b"reply"


class AuthError(CacheLayerError):
    """A message without a valid signature, or a replayed one."""


def bearer_token_matches(header: str, secret: bytes) -> bool:
    scheme, _, value = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), secret)


class MessageAuth:
    """Signs and checks ZMQ messages with the shared secret; with no secret it passes frames through."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def seal(
        self, purpose: bytes, frames: list[bytes], *, answering: bytes = b""
    ) -> tuple[list[bytes], bytes]:
        """The frames behind their auth frame, and the nonce a reply must answer."""
        if self._secret is None:
            return frames, b""
        timestamp, nonce = time.time(), secrets.token_bytes(16)
        mac = self._mac(purpose, timestamp, nonce, answering, frames)
        return [_AUTH_FRAME.pack(_MAGIC, timestamp, nonce, mac), *frames], nonce

    def open(
        self, purpose: bytes, frames: list[bytes], *, answering: bytes = b""
    ) -> tuple[list[bytes], bytes]:
        """The frames after the auth frame, and its nonce; AuthError unless signed with the secret,
        fresh and (for messages that answer nothing) never seen before."""
        if self._secret is None:
            return frames, b""
        if not frames or len(frames[0]) != _AUTH_FRAME.size:
            raise AuthError("the message carries no signature (is the shared secret set on both sides?)")
        magic, timestamp, nonce, mac = _AUTH_FRAME.unpack(frames[0])
        if magic != _MAGIC:
            raise AuthError("the message carries no signature (is the shared secret set on both sides?)")
        if not hmac.compare_digest(mac, self._mac(purpose, timestamp, nonce, answering, frames[1:])):
            raise AuthError("bad signature: the sender does not hold the same shared secret")
        now = time.time()
        if not abs(now - timestamp) <= MAX_CLOCK_SKEW_S:
            raise AuthError(
                f"signed {now - timestamp:+.1f} s away from this clock (at most {MAX_CLOCK_SKEW_S:.0f} s): "
                "a replay, or clocks out of sync"
            )
        if not answering:  # a reply is bound to its command's fresh nonce already
            self._remember(nonce, now)
        return frames[1:], nonce

    def _remember(self, nonce: bytes, now: float) -> None:
        with self._lock:
            while self._seen and (
                next(iter(self._seen.values())) < now or len(self._seen) >= _REMEMBERED_NONCES
            ):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise AuthError("replayed message (its nonce was already used)")
            self._seen[nonce] = now + 2 * MAX_CLOCK_SKEW_S

    def _mac(
        self, purpose: bytes, timestamp: float, nonce: bytes, answering: bytes, frames: list[bytes]
    ) -> bytes:
        assert self._secret is not None
        digest = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in (b"kvgate-cachelayer", purpose, struct.pack("<d", timestamp), nonce, answering):
            digest.update(struct.pack("<Q", len(part)))
            digest.update(part)
        for frame in frames:
            digest.update(struct.pack("<Q", len(frame)))
            digest.update(frame)
        return digest.digest()
