"""Free TCP ports on loopback, asked from the OS (tests run concurrently: never hard-code ports)."""

from __future__ import annotations

import socket
import threading
from collections import deque

# The ports handed out lately by this process. The OS may report the same free port to two calls
# in a row (nothing is bound to it between them), and a caller that asks for an engine's HTTP,
# KV-event and replay ports at once would then bind two of them to one port (seen in CI:
# "Address already in use" from `kvgate sim` given one port for PUB and replay).
_RECENT_KEPT = 4096
_recent: deque[int] = deque()
_recent_set: set[int] = set()
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just reported free, never one this process was handed among its last
    4096. Racy by nature against other processes, so bind soon after asking."""
    with _lock:
        for _attempt in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port in _recent_set:
                continue
            _recent.append(port)
            _recent_set.add(port)
            if len(_recent) > _RECENT_KEPT:
                _recent_set.discard(_recent.popleft())
            return port
    raise RuntimeError(f"the OS kept reporting ports handed out already on {host}")
