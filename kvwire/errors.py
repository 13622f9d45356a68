"""How the wire fails: one root, `WireError`, and under it each failure with the builtin base its
callers already catch (a malformed payload is a ValueError, a socket that cannot bind an OSError)."""

from __future__ import annotations

import zmq


class WireError(Exception):
    """Root of every error kvwire raises."""


class MalformedBatch(WireError, ValueError):
    """The payload is not an EventBatch in any known encoding."""


class MalformedFrame(WireError, ValueError):
    """A message frame does not have the protocol's shape (a seq frame is exactly 8 bytes)."""


class SnapshotUnavailable(WireError):
    """A publisher did not answer a snapshot request in time, or answered something else."""


class PublisherConfigError(WireError, ValueError):
    """A publisher setting is invalid: an unknown encoding, an endpoint, --kv-events-config."""


class PublisherBindError(WireError, OSError, zmq.ZMQError):
    """A publisher socket could not bind or connect its endpoint (`errno` says why: EADDRINUSE...).

    Also a `zmq.ZMQError`, which is what pyzmq raises for it and what callers retrying a bind catch."""
