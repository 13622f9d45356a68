"""Free TCP ports on loopback for tests (tests run concurrently: never hard-code ports)."""

from __future__ import annotations

import random
import socket
import threading
from collections import deque
from pathlib import Path

from router.launch import port_is_free

# The ports handed out lately by this process. Two calls in a row could otherwise get one port
# (nothing is bound to it between them), and a caller that asks for an engine's HTTP, KV-event and
# replay ports at once would then bind two of them to one port (seen in CI: "Address already in
# use" from `kvgate sim` given one port for PUB and replay).
_RECENT_KEPT = 4096
_recent: deque[int] = deque()
_recent_set: set[int] = set()
_lock = threading.Lock()
_LOWEST = 20000
_draw = random.Random()


def _ephemeral_low() -> int:
    """The lowest port the OS hands to outgoing connections (Linux's ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, below the OS's ephemeral range, and never one this process was
    handed among its last 4096. A port the OS picks itself (bind to 0) comes from the ephemeral
    range, which every outgoing connection also draws from: a server told to bind it a second
    later could find a client's socket there (seen in CI: a launched `kvgate sim` whose port an
    outgoing connection had taken). Racy by nature against other processes: bind soon after."""
    high = _ephemeral_low()
    with _lock:
        for _attempt in range(200):
            if high - _LOWEST > 2 * _RECENT_KEPT:
                port = _draw.randrange(_LOWEST, high)
            else:  # an unusual port range: fall back to the OS's choice
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind((host, 0))
                    port = sock.getsockname()[1]
            if port in _recent_set or not port_is_free(host, port):
                continue
            _recent.append(port)
            _recent_set.add(port)
            if len(_recent) > _RECENT_KEPT:
                _recent_set.discard(_recent.popleft())
            return port
    raise RuntimeError(f"no free port found on {host} below {high} in 200 draws")
