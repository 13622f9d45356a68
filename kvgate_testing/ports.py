"""Free TCP ports on loopback, asked from the OS (tests run concurrently: never hard-code ports)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just reported free. Racy by nature, so bind soon after asking."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
