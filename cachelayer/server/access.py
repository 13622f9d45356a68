"""Who may use the cache daemon's data plane, and which key spaces each client may reach.

A client proves who it is with a shared secret, the way the controller's HTTP API does (a bearer
secret, compared in constant time; cachelayer.controller.auth reads it from an environment variable
and refuses an open socket beyond loopback). On the ZMQ data plane the secret travels in the
connection's handshake (ZMTP's PLAIN mechanism) and is checked by this daemon's ZAP handler before
the connection may send a single message: a client without it is disconnected before libzmq
buffers any of its frames, and every message of an accepted connection carries the name of its
credential ("User-Id"), which the daemon checks against the key space each request names.

Why the handshake and not the controller's per-message HMAC: the data plane carries KV bytes (a
SHA-256 pass over each would cost more than the copy), and a signature checked after a message
arrives cannot stop the message from being buffered; the handshake refuses the sender first.
PLAIN sends the secret in the clear, like a bearer token over HTTP: beyond one host, use a
private network or an encrypted tunnel (docs/cachelayer.md, Security).

A `Credential` allows every key space (`models` None) or only those whose model name (the part of
`KeySpace.model` before "@") it lists. Only a credential that allows every key space may map the
shared pool, which holds every key space's chunks.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from dataclasses import dataclass

import zmq

from cachelayer.server.protocol import KeySpace

log = logging.getLogger(__name__)

# libzmq asks for ZAP verdicts on this endpoint of the socket's context (RFC 27).
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# The PLAIN user name clients send; credentials are told apart by their secret alone.
PLAIN_USERNAME = b"cachelayer"
# The credential name of every client of a daemon without secrets.
ANONYMOUS = "anonymous"


@dataclass(frozen=True, slots=True)
class Credential:
    """A secret and what it may reach: every key space (`models` None) or the listed model names."""

    name: str
    secret: bytes
    models: frozenset[str] | None = None

    @property
    def allows_every_key_space(self) -> bool:
        return self.models is None


def model_name(space: KeySpace) -> str:
    """The model name a key space belongs to: `KeySpace.model` up to its first "@" (the revision,
    block size and layout follow it; see cachelayer.connectors.vllm.key_space)."""
    return space.model.split("@", 1)[0]


def may_reach(credential: Credential | None, space: KeySpace) -> bool:
    """Whether a client of `credential` (None: a daemon without secrets) may use `space`."""
    return credential is None or credential.models is None or model_name(space) in credential.models


class RateLimitedLog:
    """Warning lines `template % (what, why, suffix)`, at most `per_s` a second; the lines skipped
    are counted in the next one, so a flood of bad frames or connections costs a few lines a second."""

    def __init__(self, logger: logging.Logger, template: str, per_s: int) -> None:
        self._logger, self._template, self.per_s = logger, template, per_s
        self._window = 0.0
        self._logged = 0
        self._skipped = 0
        self._lock = threading.Lock()

    def line(self, what: str, why: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._window >= 1.0:
                self._window, self._logged = now, 0
            if self._logged >= self.per_s:
                self._skipped += 1
                return
            self._logged += 1
            skipped, self._skipped = self._skipped, 0
        suffix = f" ({skipped} more since the last line)" if skipped else ""
        self._logger.warning(self._template, what, why[:300], suffix)


class ZapHandler:
    """Answers libzmq's ZAP requests for one context: a PLAIN handshake passes when its password is
    one credential's secret (constant-time compare), and the connection is then labelled with the
    credential's name. Anything else (another mechanism, a wrong secret) is refused."""

    def __init__(self, context: zmq.Context, credentials: list[Credential]) -> None:
        if not credentials:
            raise ValueError("a ZAP handler needs at least one credential")
        self._credentials = list(credentials)
        # Bound before any socket of the context asks: with no handler bound, libzmq would let
        # every PLAIN handshake through.
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self.refused = 0
        self._refusals = RateLimitedLog(log, "cachelayer server: refused a connection from %s: %s%s", 5)
        self._thread = threading.Thread(target=self._serve, name="cachelayer-zap", daemon=True)
        self._thread.start()

    def _verdict(self, request: list[bytes]) -> tuple[bytes, bytes, bytes]:
        """(status code, status text, user id) for one ZAP request
        [version, request id, domain, address, routing id, mechanism, credentials...]."""
        if len(request) < 6 or request[0] != b"1.0":
            return b"400", b"malformed ZAP request", b""
        mechanism = request[5]
        if mechanism != b"PLAIN" or len(request) != 8:
            return b"400", b"this daemon needs the shared secret (ZMTP PLAIN)", b""
        password = request[7]
        matched = None
        for credential in self._credentials:  # every one compared: the time says nothing
            if hmac.compare_digest(password, credential.secret):
                matched = credential
        if matched is None:
            return b"400", b"wrong secret", b""
        return b"200", b"OK", matched.name.encode()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            request = self._socket.recv_multipart()
            status, text, user_id = self._verdict(request)
            if status != b"200":
                self.refused += 1
                address = request[3].decode(errors="replace") if len(request) > 3 else "?"
                self._refusals.line(address, text.decode())
            version = request[0] if request else b"1.0"
            request_id = request[1] if len(request) > 1 else b""
            self._socket.send_multipart([version, request_id, status, text, user_id, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
