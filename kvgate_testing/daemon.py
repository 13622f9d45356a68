"""Helpers for tests and fuzzers of the shared cache daemon: a `cachelayer server` on free loopback
ports, and a raw ZMQ client that sends whatever frames it is given (the hostile party)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx
import zmq

from cachelayer.server import protocol
from cachelayer.server.access import PLAIN_USERNAME
from cachelayer.server.protocol import Reply, Request
from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, wait_for_http


@dataclass
class RunningDaemon:
    process: ManagedProcess
    endpoint: str
    http_url: str

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.http_url}/metrics", timeout=5).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line[0] != "#"}


@contextlib.contextmanager
def running_daemon(
    *flags: str,
    env: dict[str, str] | None = None,
    chunk_size: int = 16,
    l1_size_gb: float = 0.001,
    port: int | None = None,
    http_port: int | None = None,
) -> Iterator[RunningDaemon]:
    """`cachelayer server` on 127.0.0.1 and free ports (or those given: a daemon restarted where
    its clients know it) with `flags`, killed on exit."""
    port, http_port = port or free_port(), http_port or free_port()
    args = [sys.executable, "-m", "cachelayer.cli", "server", "--host", "127.0.0.1", "--port", str(port),
            "--http-port", str(http_port), "--chunk-size", str(chunk_size), "--l1-size-gb", str(l1_size_gb),
            *flags]  # fmt: skip
    with ManagedProcess(args, env=env) as process:
        http_url = f"http://127.0.0.1:{http_port}"
        wait_for_http(f"{http_url}/healthcheck", process, timeout_s=60)
        yield RunningDaemon(process, f"tcp://127.0.0.1:{port}", http_url)


class RawClient:
    """A DEALER that sends any frames (optionally with a secret in its handshake) and reads replies."""

    def __init__(self, endpoint: str, secret: bytes | None = None) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, 2000)
        if secret is not None:
            self.socket.plain_username = PLAIN_USERNAME
            self.socket.plain_password = secret
        self.socket.connect(endpoint)

    def send_frames(self, frames: Sequence[bytes | memoryview]) -> bool:
        """False when the frames could not even be queued (no connection came up)."""
        try:
            self.socket.send_multipart(list(frames), copy=False)
        except zmq.Again:
            return False
        return True

    def receive(self, timeout_s: float) -> list[bytes] | None:
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return self.socket.recv_multipart()

    def ask(self, request: Request, *payload: bytes, timeout_s: float = 5.0) -> Reply | None:
        """The daemon's reply to one request, or None when none came within `timeout_s`."""
        if not self.send_frames([b"", protocol.encode(request), *payload]):
            return None
        frames = self.receive(timeout_s)
        return protocol.decode_reply(frames[1]) if frames is not None else None

    def close(self) -> None:
        self.socket.close(linger=0)
